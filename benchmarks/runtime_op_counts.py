"""The aten ops moeplan's runtime dispatches in one decode step, per architecture and per part of a decoder block
(issue 39 item 2: the cost model's launch counts from the runtime's real op counts).

For each architecture of examples/hf_tiny/architectures.py (the architecture's own transformers config at toy
size) and the demo's own model (examples/tiny_moe, `tiny_moe`), the runtime's Engine at world 1 (every expert
local, `single_rank_engine.py`) runs one decode step of the service's BatchWorker at bf16 (what the runtime holds a
bf16 checkpoint at on a GPU) for 4 sequences; a dispatch counter (runtime/op_counter.py's rule: every non-view aten
op) attributes each op to where it ran (a module's forward hooks included):
* `moe_block`: inside an MoE block (router, grouped experts, the engine's route, shared experts), per MoE block;
* `dense_mlp_block`: inside a dense block's MLP, per dense block;
* `attention_block`: the rest of a decoder block (norms, attention, residuals), per decoder block;
* `fixed`: outside the decoder blocks (embedding, final norm, head, the step's sampling and bookkeeping);
* `moe_block_ep`: an MoE block on rank 0 of 2 ranks (gloo processes here, standard mode, experts split
  contiguously): the route with its dispatch and combine exchanges. At 4 ranks it is the same (qwen3_moe: 78 at
  2 and at 4, counted before the combine stopped exchanging its row counts; 76 since): packing by destination
  and the exchange are one call whatever the ranks, so the count has no per-peer part;
* `attention_block_captured`: `attention_block` over the caches a service whose steps compile or are captured
  builds (every layer with spare columns; MLA's latents too, which eager steps keep in the library's layers:
  runtime/model/growable_cache.py), what the cost model prices such a service's attention with;
* `coherent_block`, `coherent_block_ep`, `coherent_step_ep`: what coherent mode's step dispatches beyond standard
  mode's at one rank (`coherent_excess`), per decoder block at 1 and at 2 ranks and per step at 2 (its routing pass,
  context and block-output hooks, its context, dispatch and merge exchanges, its token sync); `coherent_block_per_rank`
  and `coherent_step_per_rank`: what each rank beyond 2 adds, from the count at 4 ranks (qwen3_moe: 100, 106 and 118
  ops a block at 2, 4 and 8 ranks; 9, 13 and 21 a step: linear);
* `moe_block_gathered`: the same block where the decode step gathers (runtime/ep/gathered_moe.py: every rank
  sends every other its rows, two exchanges of fixed shape, the replica rule on the device), as GPU ranks of several
  capture it in a CUDA graph (runtime/model/graph_decode.py); None where the engine cannot gather (its refusal in
  `skipped_gathered`).
The step counted is the second decode step after the prefill: the first moves the prefill's K/V into the cache's
buffers with spare columns (runtime/model/growable_cache.py, a copy once per 64 columns or more), the steady
state writes its column (as many ops as the library's concatenation).
The op counts do not grow with the batch or with the experts a batch touches (grouped experts); checked here by
counting at 4 and 8 sequences (at one sequence MLA attention dispatches 2 ops fewer per block).

On an H200 the same step of Qwen3-30B-A3B (16 and 48 layers) dispatched 1,543 and 4,519 ops
(benchmarks/gpu/decode_step.py; docs/gpu_checks.md); this table's qwen3_moe row gave 49 + 93 L here on the CPU
then (49 + 89 L since the grouped attention).

    python benchmarks/runtime_op_counts.py [--arch qwen3_moe mixtral] [--write passes/cost/runtime_op_counts.json]

The table is keyed by the model class (the IR's `architecture`, e.g. Qwen3MoeForCausalLM); the torchrun cost model
reads it (passes/cost/runtime_ops.py) for hardware profiles that give the runtime's measured cost of one op.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from moeplan.runtime.op_counter import OpCounter
from moeplan.runtime.process_exit import leave

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
TINY_MOE = "tiny_moe"  # the demo's own model (examples/tiny_moe), counted beside the library's architectures
PARTS = ("attention_block", "moe_block", "dense_mlp_block", "fixed")
EP_PART = "moe_block_ep"  # an MoE block at 2 ranks or more: the engine's dispatch and combine exchanges included
GATHERED_PART = "moe_block_gathered"  # the same, gathered (fixed-shape exchanges: a captured step's)
CAPTURED_PART = "attention_block_captured"  # the attention part over a compiled or captured service's caches
COHERENT_PART = "coherent_block"  # coherent mode's ops a decoder block beyond standard mode's, at one rank
COHERENT_EP_PART = "coherent_block_ep"  # the same at 2 ranks (its exchanges included)
COHERENT_STEP_PART = "coherent_step_ep"  # coherent mode's ops a step beyond standard mode's, at 2 ranks (token sync)
COHERENT_PEER_PART = "coherent_block_per_rank"  # what each rank beyond 2 adds to COHERENT_EP_PART (from 4 ranks)
COHERENT_STEP_PEER_PART = "coherent_step_per_rank"  # and to COHERENT_STEP_PART
DTYPES = ("bfloat16", "float32")  # "architectures" at bf16 (a GPU's, an AMX CPU's), "architectures_float32" (other CPUs)
COHERENT_PARTS = (COHERENT_PART, COHERENT_EP_PART, COHERENT_STEP_PART, COHERENT_PEER_PART, COHERENT_STEP_PEER_PART)


def tiny_architectures():
    """examples/hf_tiny/architectures.py (by path: benchmarks/ has an architectures.py of its own)."""
    from moeplan.passes.importers.resolve import import_file

    return import_file(REPO / "examples" / "hf_tiny" / "architectures.py")


class RegionCounter(OpCounter):
    """runtime/op_counter.py's ops, also counted by region ("fixed" outside the decoder blocks, "attention_block",
    "moe_block", "dense_mlp_block"), the region set while a module runs: `watch`."""

    def __init__(self):
        super().__init__()
        self.counts = dict.fromkeys(PARTS, 0)
        self.stack = ["fixed"]

    def count(self, func) -> None:
        super().count(func)
        self.counts[self.stack[-1]] += 1

    def watch(self, module, region: str) -> list:
        """Count what `module` runs as `region`, its forward hooks included (coherent mode's block-output hook
        among them: these hooks run after every hook registered before them), even where it raises (coherent
        mode's routing pass stops an MoE block at its experts, runtime/ep/engine.py). Handles to remove."""
        forward = module.forward

        def regional(*args, **kwargs):
            self.stack.append(region)
            try:
                return forward(*args, **kwargs)
            except BaseException:
                self.stack.pop()
                raise

        def leave(module, args, output):
            self.stack.pop()

        module.forward = regional
        return [_Restore(module), module.register_forward_hook(leave)]


class _Restore:
    """A handle putting a module's own forward back (`RegionCounter.watch`)."""

    def __init__(self, module):
        self.module = module

    def remove(self) -> None:
        del self.module.forward


def count(arch: str, batch: int, dtype, rank: int = 0, world: int = 1, folder: Path | None = None,
          gathered: bool = False, captured: bool = False, mode: str = "standard") -> dict:
    """{part: ops} of one decode step of `arch` (see module docstring) at `batch` sequences, on `rank` of `world`
    (experts split contiguously; a process group must be up when world > 1), in `mode`; `gathered`: the decode
    steps gather (`gathered_moe.py`), or {"refused": why} where the engine cannot; `captured`: over the caches a
    service whose steps compile or are captured builds (every layer with spare columns, MLA's latents too)."""
    if captured:
        from moeplan.runtime.model import library_model

        library = library_model.growable_cache
        library_model.growable_cache = lambda config, columns, latents=False: library(config, columns, latents=True)
        try:
            return count(arch, batch, dtype, rank, world, folder, gathered, mode=mode)
        finally:
            library_model.growable_cache = library
    import torch
    from single_rank_engine import build_engine

    from moeplan.runtime.ep.gathered_moe import enable_gathering, gather_refusal

    from moeplan.runtime.serving.step_plan import STEP, Admission, StepPlan
    from moeplan.runtime.serving.worker import BatchWorker

    folder = folder or build_architecture(arch, Path(tempfile.mkdtemp(prefix="op_counts_")))
    config = json.loads((folder / "config.json").read_text())
    engine, model, _ = build_engine(config, torch.device("cpu"), dtype, seed=0, rank=rank, world=world, mode=mode)
    if gathered:
        if gather_refusal(engine) is not None:
            return {"refused": gather_refusal(engine)}
        enable_gathering(engine)
    rank_model = engine.model
    vocab = int(config.get("vocab_size", 320))
    prompts = torch.randint(3, vocab, (batch, 6), generator=torch.Generator().manual_seed(0)).tolist()
    worker = BatchWorker(engine, rank_model.kind, tokens_to_rank0=False)  # installs the engine's hooks: before ours
    moe_blocks = {c.layer: rank_model.model.get_submodule(c.block) for c in rank_model.containers}
    counter = RegionCounter()
    handles, dense = [], 0
    for index, layer in enumerate(rank_model.layers):
        handles += counter.watch(layer, "attention_block")
        block = moe_blocks.get(index)
        if block is None:
            block = getattr(layer, "mlp", None) or getattr(layer, "feed_forward", None)
            dense += block is not None
        if block is not None:
            handles += counter.watch(block, "moe_block" if index in moe_blocks else "dense_mlp_block")
    try:
        worker.step(StepPlan(STEP, [Admission(s, s % world, tuple(p), seed=0, temperature=0.0, top_p=1.0, top_k=0)
                                    for s, p in enumerate(prompts)]))
        worker.step(StepPlan(STEP))  # the first decode step moves the prefill's K/V into buffers with spare columns
        with counter:
            worker.step(StepPlan(STEP))
    finally:
        worker.close()
        for h in handles:
            h.remove()
    layers, moe = len(rank_model.layers), len(moe_blocks)
    c = counter.counts
    return {"architecture": type(model).__name__, "layers": layers, "moe_blocks": moe, "dense_blocks": dense,
            "attention_block": round(c["attention_block"] / layers, 2),
            "moe_block": round(c["moe_block"] / max(moe, 1), 2),
            "dense_mlp_block": round(c["dense_mlp_block"] / dense, 2) if dense else 0.0,
            "fixed": c["fixed"], "total": sum(c.values())}


def coherent_excess(coherent: dict, standard: dict) -> tuple:
    """(ops a decoder block, ops a step) that coherent mode's step (`count`'s, at any ranks) dispatches beyond
    standard mode's at one rank (`standard`): its hooks, its context, dispatch and merge exchanges, its first MoE
    block's replicated routing, spread evenly over the decoder blocks; the step's own part apart (the token sync)."""
    blocks = (coherent["total"] - coherent["fixed"]) - (standard["total"] - standard["fixed"])
    return round(blocks / coherent["layers"], 2), coherent["fixed"] - standard["fixed"]


def build_architecture(arch: str, folder: Path) -> Path:
    """The model directory `count` builds from: examples/hf_tiny's architecture `arch` at toy size, or for
    "tiny_moe" the demo's own model's config (examples/tiny_moe: its weights are drawn anew)."""
    if arch == TINY_MOE:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text((REPO / "examples" / "tiny_moe" / "config.json").read_text())
        return folder
    return tiny_architectures().build(arch, folder)


STEPS = {"dynamic": {}, "gathered": {"gathered": True}, "coherent": {"mode": "coherent"}}  # `count`'s, by name


def _rank(rank: int, world: int, arch: str, folder: str, port: int, out: str, dtype: str, steps: tuple) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        held = getattr(torch, dtype)
        counted = [count(arch, 4 * world, held, rank, world, Path(folder), **STEPS[step]) for step in steps]
        if rank == 0:
            Path(out).write_text(json.dumps(counted))
    finally:
        dist.destroy_process_group()
    leave(0)  # without the interpreter's teardown, which a spawned gloo rank can abort in (runtime/process_exit.py)


def count_at_world(arch: str, world: int, dtype: str = "bfloat16", steps: tuple = tuple(STEPS)) -> list:
    """Rank 0's `count` in a world of `world` ranks (gloo processes on this machine), 4 sequences per rank, at `dtype`,
    of each of `steps` (STEPS: standard mode by dynamic gating, gathered, coherent mode)."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    scratch = Path(tempfile.mkdtemp(prefix="op_counts_world_"))
    folder = build_architecture(arch, scratch)  # here: transformers saves from the main process only
    out = scratch / "rank0.json"
    mp.spawn(_rank, args=(world, arch, str(folder), port, str(out), dtype, steps), nprocs=world, join=True)
    return json.loads(out.read_text())


class TwoRanksRefused(RuntimeError):
    """The engine at 2 ranks refused an architecture (`count_row`)."""


def count_row(arch: str, dtype: str) -> tuple:
    """(model class, the table's row for `arch` at `dtype`, its step's total, whether batch 8 counts the same, why
    the engine does not gather it or None); raises where the serving loop refuses it, TwoRanksRefused where the
    engine at 2 ranks does."""
    import torch

    held = getattr(torch, dtype)
    four, eight = count(arch, 4, held), count(arch, 8, held)
    four[CAPTURED_PART] = count(arch, 4, held, captured=True)["attention_block"]
    try:
        dynamic, gathered, coherent = count_at_world(arch, 2, dtype)
    except Exception as exc:
        raise TwoRanksRefused(f"2 ranks: {type(exc).__name__}: {str(exc)[:200]}") from exc
    four[EP_PART] = dynamic["moe_block"]
    four[GATHERED_PART] = gathered.get("moe_block")
    four[COHERENT_PART], _ = coherent_excess(count(arch, 4, held, mode="coherent"), four)
    # over one rank's standard step at any world: the cost model prices a coherent block's library MoE block with
    # `moe_block` (its routed experts go through coherent mode's own exchanges, in the excess)
    four[COHERENT_EP_PART], four[COHERENT_STEP_PART] = coherent_excess(coherent, four)
    coherent4, = count_at_world(arch, 4, dtype, ("coherent",))
    block4, step4 = coherent_excess(coherent4, four)  # its exchanges' few ops per peer: the slope to 4 ranks
    # never below zero: where a rank of 4 received no rows a path or two did not run (phimoe -6.25 a block)
    four[COHERENT_PEER_PART] = max(round((block4 - four[COHERENT_EP_PART]) / 2, 2), 0.0)
    four[COHERENT_STEP_PEER_PART] = max(round((step4 - four[COHERENT_STEP_PART]) / 2, 2), 0.0)
    row = {p: four[p] for p in (*PARTS, EP_PART, GATHERED_PART, CAPTURED_PART, *COHERENT_PARTS)}
    return (four["architecture"], row, four["total"], all(four[p] == eight[p] for p in PARTS),
            gathered.get("refused"))


def main(argv=None) -> int:
    ARCHITECTURES = tiny_architectures().ARCHITECTURES

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", nargs="+", default=[*ARCHITECTURES, TINY_MOE])
    ap.add_argument("--write", default=None, help="write the table (JSON) here, e.g. passes/cost/runtime_op_counts.json")
    args = ap.parse_args(argv)
    import torch
    import transformers

    tables, skipped, refused = {dtype: {} for dtype in DTYPES}, {}, {}
    for dtype in DTYPES:
        print(f"{'at ' + dtype:<16} {'attention':>9} {'captured':>8} {'moe':>7} {'moe (EP)':>8} {'gathered':>8} "
              f"{'dense mlp':>9} {'fixed':>6} {'step (batch 4)':>14}  same at batch 8   {'coherent':>9} "
              f"{'coherent (EP)':>12} {'+ per step':>10} {'+ per rank':>10} {'(per step)':>10}")
        for arch in args.arch:
            if arch in skipped:
                continue
            try:
                cls, row, total, same, refusal = count_row(arch, dtype)
            except Exception as exc:  # the serving loop refuses it (linear or chunked attention), or 2 ranks do
                skipped[arch] = str(exc) if isinstance(exc, TwoRanksRefused) else f"{type(exc).__name__}: {exc}"
                print(f"{arch:<16} skipped: {skipped[arch][:100]}")
                continue
            tables[dtype][cls] = row
            if refusal is not None:
                refused[cls] = refusal
            print(f"{arch:<16} {row['attention_block']:>9} {row[CAPTURED_PART]:>8} {row['moe_block']:>7} "
                  f"{row[EP_PART]:>8} {str(row[GATHERED_PART]):>8} {row['dense_mlp_block']:>9} {row['fixed']:>6} "
                  f"{total:>14}  {same}   {row[COHERENT_PART]:>9} {row[COHERENT_EP_PART]:>12} "
                  f"{row[COHERENT_STEP_PART]:>10} {row[COHERENT_PEER_PART]:>10} {row[COHERENT_STEP_PEER_PART]:>10}")
    if args.write:
        table = {"dtype": "bfloat16", "counted_with": f"torch {torch.__version__.split('+')[0]}, transformers "
                 f"{transformers.__version__}", "counted_by": "benchmarks/runtime_op_counts.py",
                 "architectures": tables["bfloat16"], "architectures_float32": tables["float32"],
                 "skipped": skipped, "skipped_gathered": refused}
        Path(args.write).write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
        print(f"wrote {args.write}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
