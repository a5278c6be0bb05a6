"""Gathered decode steps of standard EP (runtime/ep/gathered_moe.py, equal_exchange.py) and their compiled form over
several ranks (runtime/serving/decode_compile.py), in real processes over a real gloo group: a gathered worker gives
the dynamic-gating worker's tokens, logits and slot counts through sequences joining and leaving on either rank,
over gloo and over the shared-memory channel; compiled, it takes every decode step through one graph per shape
warmed up before service and compiles nothing after; ranks agree on eager when any one of them cannot compile;
engines it cannot serve say why."""
from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moeplan.passes.importers.resolve import import_file
from moeplan.runtime.ep.gathered_moe import gather_refusal
from moeplan.runtime.model.compiled_decode import ENV, compiler_missing
from moeplan.runtime.model.graph_decode import FUSED_ENV
from moeplan.runtime.serving.decode_compile import why_not_compiled
from moeplan.runtime.serving.step_plan import StepPlan
from moeplan.runtime.serving.worker import BatchWorker
from runtime_fixtures import contiguous_placement, hf_model_dir

ROOT = Path(__file__).resolve().parents[1]
GRAPH_SEQUENCES = 24  # the service's sequences a "graphs" pair's pools are sized for (12 rows a rank)
needs_compiler = pytest.mark.skipif(compiler_missing() is not None, reason=str(compiler_missing()))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _engine(directory: Path, rank: int, world: int, exchanger: str = "gloo", mode: str = "standard",
            replicate=(), record: bool = False, dtype: str = "float32"):
    """Rank `rank` of `world`'s Engine over the saved tiny model at `dtype`, experts contiguous (`replicate`: on every
    rank too); `exchanger`: "gloo" (the process group's collectives) or "shm" (the host channel, collective)."""
    import transformers

    from moeplan.runtime.counters import Counters
    from moeplan.runtime.ep.engine import Engine
    from moeplan.runtime.ep.exchange import Exchanger
    from moeplan.runtime.ep.expert_table import ExpertTable
    from moeplan.runtime.model.library_model import RankModel, build_transformers, decoder_layers
    from moeplan.runtime.model.moe_adapter import find_containers, split_expert_state

    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=getattr(torch, dtype))
    containers = find_containers(*reversed(decoder_layers(model)))
    weights = split_expert_state({k: v.detach() for k, v in model.state_dict().items()}, containers)
    experts = containers[0].num_experts
    placement = contiguous_placement(len(containers), experts, 1, world, replicate=replicate)
    table = ExpertTable.from_placement(placement)
    local = {c.moe: sorted(set(placement["layers"][c.moe]["devices"][rank])) for c in containers}
    rank_model = RankModel(build_transformers(directory, dtype=getattr(torch, dtype)), "transformers", None, local,
                           weights, 64)
    counters = Counters(rank_model.num_layers)
    cpu = torch.device("cpu")
    ex = (Exchanger.for_process_group(rank, world, counters, cpu, 60.0) if exchanger == "shm"
          else Exchanger(rank, world, counters, cpu))
    top_k = model.config.num_experts_per_tok  # the routing's k (the engine's join rows are that wide)
    return Engine(rank_model, table, ex, counters, rank, world, mode, cpu, top_k, record=record)


def _schedule(world: int, seed: int, steps: int) -> list:
    """benchmarks/compiled_decode.py's plans of sequences joining and leaving, owned by ranks in turn."""
    bench = import_file(ROOT / "benchmarks" / "compiled_decode.py")
    plans = []
    for plan in bench.schedule(seed, steps, vocab=64):
        admit = [type(a)(a.seq, a.seq % world, *[getattr(a, f) for f in ("prompt", "seed", "temperature", "top_p",
                                                                           "top_k")]) for a in plan.admit]
        plans.append(StepPlan(plan.kind, admit, plan.depart))
    return plans


def _keep_logits(engine) -> list:
    bench = import_file(ROOT / "benchmarks" / "compiled_decode.py")
    return bench.keep_logits(engine)


def _pair(rank: int, world: int, port: int, directory: str, out: str, exchanger: str, compile_: str,
          replicate: tuple = (), prefill_cap: int | None = None, dtype: str = "float32") -> None:
    """Rank `rank`: a dynamic-gating worker (gloo) and a gathered one (`exchanger`), stepped alike through the
    schedule; `compile_`: "" (gathered, eager), "service" (`enable_compiled_decode`), "refuse" (this rank has no C++
    compiler), "fail" (this rank's compiler raises while tracing). Writes what it saw to `out`."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from torch._dynamo.utils import counters as dynamo_counters

    from moeplan.runtime.ep import gathered_moe
    from moeplan.runtime.ep.gathered_moe import enable_gathering
    from moeplan.runtime.serving.decode_compile import enable_compiled_decode, enable_graph_decode

    if prefill_cap is not None:  # longer prefills exchange by dynamic gating, eager
        gathered_moe.GATHERED_PREFILL_ROWS = prefill_cap

    base_engine = _engine(Path(directory), rank, world, replicate=replicate, dtype=dtype)
    fast_engine = _engine(Path(directory), rank, world, exchanger, replicate=replicate, dtype=dtype)
    base, fast = BatchWorker(base_engine, "transformers", tokens_to_rank0=False), BatchWorker(
        fast_engine, "transformers", tokens_to_rank0=False)
    why, graphs = None, 0
    if compile_ == "":
        enable_gathering(fast_engine)
    else:
        os.environ[ENV] = "1"
        if compile_ == "refuse" and rank == 1:
            os.environ["CXX"] = "no-such-compiler"
        if compile_ == "fail" and rank == 1:
            def failing(fn, **kwargs):
                def raise_(*args):
                    raise torch._dynamo.exc.TorchRuntimeError("injected: the tracer met an op it cannot run")
                return raise_
            torch.compile = failing
        why = enable_graph_decode(fast, GRAPH_SEQUENCES) if compile_ == "graphs" else enable_compiled_decode(fast)
        graphs = dynamo_counters["stats"]["unique_graphs"]
    compiled = fast_engine.model.compiled_decode
    warm = compiled.steps if compiled is not None else 0
    base_logits, fast_logits = _keep_logits(base_engine), _keep_logits(fast_engine)
    same, diff, decodes, own = True, 0.0, 0, 0
    for plan in _schedule(world, seed=11, steps=36):
        decoding = base.running - set(plan.depart)
        decodes += bool(decoding)
        own += any(base.owner[s] == rank for s in decoding)  # a rank with none joins with an eager dummy row
        expected, got = base.step(plan), fast.step(plan)  # both, always: every rank runs every exchange
        same = same and expected == got
        for a, b in zip(fast_logits, base_logits, strict=True):
            diff = max(diff, float((a - b).abs().max()))
        base_logits.clear()
        fast_logits.clear()
    slots = [[(layer["local_slots"], layer["slots"]) for layer in e.counters.layers] for e in (base_engine, fast_engine)]
    Path(out).joinpath(f"{rank}.json").write_text(json.dumps({
        "same": same, "diff": diff, "decodes": decodes, "own_decodes": own, "why": why, "gathers": fast_engine.gathers,
        "compiled_steps": (compiled.steps - warm) if compiled is not None else 0,
        "compiled_prefills": compiled.prefills if compiled is not None else 0,
        "recompiled": dynamo_counters["stats"]["unique_graphs"] - graphs if compile_ else 0,
        "slots_equal": slots[0] == slots[1], "slots": slots[1],
        "buckets": sorted(getattr(compiled, "buckets", {})), "pool_rows": getattr(fast.rows, "capacity_rows", None),
        "fused": getattr(compiled, "fused", None),
        "dispatch_bytes": [layer["dispatch"]["bytes"] for layer in fast_engine.counters.layers],
        "combine_bytes": [layer["combine"]["bytes"] for layer in fast_engine.counters.layers]}))
    for e in (base_engine, fast_engine):
        e.ex.close()
    dist.destroy_process_group()
    # Leave without the interpreter's teardown: in these spawned processes it aborted about 1 run in 10 ("terminate
    # called without an active exception", SIGABRT) after both ranks had written their results (checked: 1 of 12).
    os._exit(0)


def _run_pair(tmp_path: Path, exchanger: str, compile_: str, replicate: tuple = (), prefill_cap=None,
              arch: str = "mixtral", dtype: str = "float32") -> list:
    if arch == "mixtral":
        directory, _ = hf_model_dir(tmp_path, "mixtral")
    else:  # examples/hf_tiny's config of that architecture (vocabulary 320: the schedule's ids fit)
        directory = import_file(ROOT / "examples" / "hf_tiny" / "architectures.py").build(arch, tmp_path / arch)
    out = tmp_path / "out"
    out.mkdir()
    mp.spawn(_pair, args=(2, _free_port(), str(directory), str(out), exchanger, compile_, replicate, prefill_cap,
                          dtype), nprocs=2)
    return [json.loads((out / f"{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("exchanger, replicate", [("gloo", ()), ("shm", ()), ("shm", (1, 3, 6))])
def test_gathered_steps_give_dynamic_gatings_tokens_logits_and_slot_counts(tmp_path, exchanger, replicate):
    """With copies of experts 1, 3 and 6 on both ranks too: the device's replica rule picks the host's copies (the
    slot counts, local against all, match dynamic gating's)."""
    for rank, seen in enumerate(_run_pair(tmp_path, exchanger, "", replicate)):
        assert seen["same"] and seen["diff"] <= 1e-5, (rank, seen)
        assert seen["decodes"] > 20 and seen["slots_equal"] and seen["gathers"], (rank, seen)
        counted = [(local, total) for local, total in seen["slots"] if total]  # (MoE layer 0's slots are not counted)
        assert len(counted) == 2 and all(0 < local < total for local, total in counted), seen  # both ranks serve slots


def test_bfloat16_gathered_rows_travel_at_half_the_bytes_and_give_dynamic_gatings_tokens_and_logits(tmp_path):
    """At bfloat16 a gathered block's rows travel as bfloat16 (ids as int16 bit patterns), not float32: the same
    tokens and slot counts as dynamic gating at bfloat16, logits within bfloat16's rounding (the grouped GEMMs see
    other rows than dynamic gating's: max |dlogit| 0.0029 here, the same as with float32 rows on the wire before),
    each exchange's bytes half float32's. (With copies of experts, the slot counts at bfloat16 differ from dynamic
    gating's, before this change as after: bfloat16's rounding moves a few slots' experts, and so the copies' turns.)"""
    half = _run_pair(tmp_path / "bf16", "shm", "", dtype="bfloat16")
    full = _run_pair(tmp_path / "fp32", "shm", "")
    for rank, seen in enumerate(half):
        assert seen["same"] and seen["diff"] <= 1e-2 and seen["slots_equal"] and seen["gathers"], (rank, seen)
        assert seen["decodes"] > 20, (rank, seen)
        for phase in ("dispatch_bytes", "combine_bytes"):
            assert all(2 * b == f for b, f in zip(seen[phase], full[rank][phase], strict=True)), (rank, phase)
            assert sum(seen[phase]) > 0, (rank, phase)


def test_ranks_agree_on_eager_steps_when_one_cannot_compile(tmp_path):
    """Rank 1 has no C++ compiler: both ranks stay eager (dynamic gating again), each saying why."""
    first, second = _run_pair(tmp_path, "shm", "refuse")
    assert first["why"] == "rank 1: " + second["why"]
    assert second["why"].startswith("no C++ compiler (no-such-compiler) on PATH")
    for seen in (first, second):
        assert not seen["gathers"] and seen["compiled_steps"] == 0 and seen["same"] and seen["diff"] == 0, seen


@pytest.mark.slow
@needs_compiler
@pytest.mark.parametrize("replicate, prefill_cap, arch, dtype", [((), 8, "mixtral", "float32"),
                                                                ((1, 3, 6), None, "mixtral", "float32"),
                                                                ((), None, "deepseek_v3", "float32"),
                                                                ((), None, "mixtral", "bfloat16")])
def test_compiled_gathered_steps_match_dynamic_gating_and_compile_nothing_after_the_warm_up(tmp_path, replicate,
                                                                                            prefill_cap, arch, dtype):
    """With copies of three experts; with prefills of more than 8 rows exchanging by dynamic gating (eager)
    between gathered ones; DeepSeek-V3 (MLA's latents in spare-column layers, a dense block, shared experts); and
    at bfloat16, its rows on the wire as bfloat16 words inside the compiled graph: every decode step compiled, none
    recompiled (its tokens are not compared: inductor's fused bfloat16 kernels round otherwise than eager's, and
    this tiny model's greedy picks have near ties, one of which flipped in 29 steps)."""
    for rank, seen in enumerate(_run_pair(tmp_path, "shm", "service", replicate, prefill_cap, arch, dtype)):
        assert seen["why"] is None and seen["gathers"], (rank, seen)
        if dtype == "float32":
            assert seen["same"] and seen["diff"] <= 1e-4 and seen["slots_equal"], (rank, seen)
        assert seen["compiled_steps"] == seen["own_decodes"] > 15, (rank, seen)  # every decode step with rows here
        if prefill_cap is None:
            assert seen["compiled_prefills"] > 5, (rank, seen)  # prefills too, gathered
        assert seen["recompiled"] == 0, (rank, seen)


@pytest.mark.slow
@needs_compiler
def test_a_rank_whose_compiler_fails_mid_warm_up_keeps_the_exchanges_paired_and_every_rank_eager(tmp_path):
    """Rank 1's tracer raises at its first compiled step: that step runs eager (its exchanges pair with rank 0's
    compiled ones), the warm-up ends, and both ranks serve eager steps by dynamic gating."""
    first, second = _run_pair(tmp_path, "shm", "fail")
    assert first["why"] == "rank 1: " + second["why"]
    assert second["why"].startswith("torch.compile failed on this model (TorchRuntimeError: injected")
    for seen in (first, second):
        assert not seen["gathers"] and seen["compiled_steps"] == 0 and seen["same"] and seen["diff"] == 0, seen


@pytest.mark.parametrize("fused, arch", [(False, "mixtral"), (False, "deepseek_v3"),
                                         pytest.param(True, "mixtral", marks=[pytest.mark.slow, needs_compiler])])
def test_bucketed_gathered_steps_over_the_pools_match_dynamic_gating_in_step_on_both_ranks(tmp_path, monkeypatch, fused,
                                                                                           arch):
    """The path GPU ranks of several capture as CUDA graphs (model/graph_decode.py), uncaptured on CPU: both ranks'
    decode steps run in the same buckets (the fullest rank's rows, the longest context), padding rows routing nowhere;
    a rank with no row joins the exchanges at the bucket's rows. Tokens, logits and slot counts are dynamic
    gating's; `fused` (MOEPLAN_GRAPH_INDUCTOR=1): inductor's step with its exchanges inside, no graph compiled after
    the warm-up; DeepSeek-V3: MLA's latents in the pools, a dense first block, shared experts, grouped top-k."""
    monkeypatch.setenv(FUSED_ENV, "1" if fused else "0")  # the spawned ranks inherit it
    first, second = _run_pair(tmp_path, "gloo", "graphs", arch=arch)
    for rank, seen in enumerate((first, second)):
        assert seen["why"] is None and seen["gathers"] and seen["pool_rows"] == GRAPH_SEQUENCES // 2, (rank, seen)
        assert seen["fused"] is fused and seen["recompiled"] == 0, (rank, seen)
        assert seen["same"] and seen["diff"] <= 1e-5 and seen["slots_equal"], (rank, seen)
        assert seen["compiled_steps"] == seen["own_decodes"] > 15, (rank, seen)  # every decode step with rows here
    assert first["buckets"] == second["buckets"] and len(first["buckets"]) >= 3  # the same buckets, in step
    assert first["decodes"] == second["decodes"]
    assert first["own_decodes"] + second["own_decodes"] > first["decodes"]  # some steps had rows on both ranks
    assert min(first["own_decodes"], second["own_decodes"]) < first["decodes"]  # a rank with none joined them


def test_engines_it_cannot_gather_say_why(tmp_path, monkeypatch):
    """In-process rank 0 of 2 (no exchange runs): what gathers, and each reason it does not."""
    monkeypatch.setenv(ENV, "1")
    directory, _ = hf_model_dir(tmp_path, "mixtral")
    engine = _engine(directory, 0, 2)
    assert gather_refusal(engine) is None
    worker = BatchWorker(engine, "transformers", tokens_to_rank0=False)
    assert why_not_compiled(worker) == compiler_missing()
    assert gather_refusal(_engine(directory, 0, 1)) == "gathered decode steps are for standard mode over several ranks"
    assert (gather_refusal(_engine(directory, 0, 2, mode="coherent"))
            == "gathered decode steps are for standard mode over several ranks")
    coherent = BatchWorker(_engine(directory, 0, 2, mode="coherent"), "transformers")
    assert why_not_compiled(coherent) == "coherent mode's ranks run eager decode steps"
    assert gather_refusal(_engine(directory, 0, 2, record=True)) == "a recording engine reads the routing on the host"
    assert gather_refusal(_engine(directory, 0, 2, replicate=(3,))) is None  # the rule runs on the device
    engine.model.adapters[0].fp8_block = (128, 128)
    assert gather_refusal(engine) == "expert caches and FP8 experts run the dynamic-gating exchange"
