"""The runtime's decode step measured on the GPU at hand, beside the cost model's prediction for the same
cell, with CUDA graphs off and on (issue 39 item 5). Run by benchmarks/gpu/serve_check.sh; never in tests.

The model: a real architecture's config (default examples/configs/qwen3-30b-a3b.json, the issue's cell) cut to
`--layers` decoder blocks so that it fits one GPU with room for the experts' stacked copy, built by the runtime's
own builder (`runtime/model/library_model.py`: transformers' module, eager attention) with seeded random weights at
the precision the runtime holds on this GPU (`runtime/precision.py`: bf16), every expert on the one rank, run by
the runtime's Engine (world of one: routing stays on the device, grouped-GEMM experts).

Per batch B (`--batches`), every sequence with a prompt of `--context` tokens, three decode steps are timed
(CUDA events around each step, median of `--steps` after 2 warm-ups):
* `runtime`: the service's own step, `BatchWorker.step` (runtime/serving/worker.py): the library's growing
  DynamicCache, the host-side sampler, the step's bookkeeping; what a bundle runs today;
* `static eager`: the same engine and model over transformers' StaticCache (fixed shapes: the precondition of a
  graph), greedy next token on the device;
* `static graph`: that step captured once as a CUDA graph (torch.cuda.graph) and replayed; its tokens are
  compared with the eager static step's from the same prefill (`graph_tokens_match`);
* `service graph`: the service's own step with its decode steps captured as CUDA graphs, as a GPU rank alone now
  serves (runtime/model/graph_decode.py over the KV pools of runtime/serving/row_pool.py); its tokens against the
  eager step's (`service_graph_tokens_match_runtime`; bf16 sums in another shape may flip near-ties);
* `fused graph`: `service graph` with inductor's fused kernels captured instead of the eager ones
  (`MOEPLAN_GRAPH_INDUCTOR=1`: off by default until this measures it), its tokens against the eager step's
  (`fused_graph_tokens_match_runtime`). Both graph parts count the GPU kernels one replayed step launches
  (`*_kernels`, torch.profiler over one step): what a captured step's price is per kernel;
* `compiled`: the service's own step again with its decode step compiled as a CPU rank alone serves it
  (runtime/model/compiled_decode.py; inductor's default mode, no CUDA graphs; enabled on CPUs only so far: this is
  its first GPU figure), its tokens against the eager step's (`compiled_tokens_match_runtime`).
Beside them: the aten ops one runtime step dispatches (runtime/op_counter.py) and the runtime step over them
(seconds per op, what the cost model's `op_overhead_s` stands for), and the torchrun cost model's predicted
decode step for the same model, batch, context and GPU profile (passes/cost/cost_model.py, 1 GPU), as a ratio.

    python benchmarks/gpu/decode_step.py --out DIR [--layers 16] [--batches 1 16 64] [--context 1024] [--parts ...]
    python benchmarks/gpu/decode_step.py --allow-cpu --out DIR   (a dry run with tiny dims: seconds mean nothing)
    python benchmarks/gpu/decode_step.py --reprice benchmarks/gpu/results/*decode_step*.json   (here, no GPU)

`--reprice` prices the cells of decode_step.json files measured earlier (benchmarks/gpu/results/) with this
checkout's cost model, eager and captured as a graph, and prints them beside the measured steps (the service's
graph step where the file has it, else the static graph step): how a cost-model change meets the GPU's figures.

Writes DIR/decode_step.json and prints a table.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
from runtime_prediction import predicted_decode_step  # noqa: E402
from single_rank_engine import build_engine  # noqa: E402
QWEN3 = REPO / "examples" / "configs" / "qwen3-30b-a3b.json"
PARTS = ("runtime", "service graph", "static", "predicted", "fused graph", "compiled")
TINY = {"hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "num_experts": 16, "num_experts_per_tok": 4, "vocab_size": 512}


def cut_config(path: Path, layers: int, tiny: bool) -> dict:
    """The config with `layers` decoder blocks (tiny dims for a CPU dry run)."""
    config = json.loads(path.read_text())
    config["num_hidden_layers"] = layers
    if tiny:
        config.update(TINY)
    for key in ("mlp_only_layers", "layer_types"):
        if isinstance(config.get(key), list):
            config[key] = [x for x in config[key] if not isinstance(x, int) or x < layers] if key == "mlp_only_layers" \
                else config[key][:layers]
    return config


class Timer:
    """Seconds of one call: CUDA events on a GPU, perf_counter on the CPU."""

    def __init__(self, device):
        import torch

        self.cuda = device.type == "cuda"
        self.torch = torch

    def __call__(self, fn) -> float:
        if not self.cuda:
            start = time.perf_counter()
            fn()
            return time.perf_counter() - start
        begin, end = self.torch.cuda.Event(enable_timing=True), self.torch.cuda.Event(enable_timing=True)
        self.torch.cuda.synchronize()
        begin.record()
        fn()
        end.record()
        end.synchronize()
        return begin.elapsed_time(end) / 1e3


def device_kernels(fn) -> int | None:
    """GPU kernels launched while `fn()` runs (torch.profiler's CUDA activities; None without CUDA)."""
    import torch

    if not torch.cuda.is_available():
        return None
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def runtime_step(engine, batch: int, context: int, steps: int, vocab: int, timer, seed: int,
                 graphs: bool = False) -> dict:
    """The service's own decode step (BatchWorker over the engine): median seconds and the ops of one step;
    `graphs`: its decode steps captured as CUDA graphs over KV pools of `batch` rows, as a GPU rank alone serves."""
    import torch

    from moeplan.runtime.op_counter import OpCounter
    from moeplan.runtime.serving.decode_compile import enable_graph_decode
    from moeplan.runtime.serving.step_plan import STEP, Admission, StepPlan
    from moeplan.runtime.serving.worker import BatchWorker

    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, vocab, (batch, context), generator=g).tolist()
    worker = BatchWorker(engine, "transformers", tokens_to_rank0=False)
    try:
        if graphs and (why := enable_graph_decode(worker, batch)) is not None:
            raise RuntimeError(why)
        admit = [Admission(s, 0, tuple(p), seed=0, temperature=0.0, top_p=1.0, top_k=0) for s, p in enumerate(prompts)]
        prefill = timer(lambda: worker.step(StepPlan(STEP, admit)))
        tokens = []
        times = [timer(lambda: tokens.append(worker.step(StepPlan(STEP)))) for _ in range(steps + 2)][2:]
        with OpCounter() as ops:
            worker.step(StepPlan(STEP))
        kernels = device_kernels(lambda: worker.step(StepPlan(STEP))) if graphs else None
    finally:
        worker.close()
    return {"prefill_s": prefill, "step_s": statistics.median(times), "ops_per_step": ops.total,
            "top_ops": dict(ops.by_op.most_common(8)), "tokens": [[t[s] for s in range(batch)] for t in tokens],
            **({"kernels": kernels} if graphs else {})}


def compiled_steps(engine, compiled, batch: int, context: int, steps: int, vocab: int, timer, seed: int) -> dict:
    """The service's step again with its decode step compiled (runtime/model/compiled_decode.py; on a GPU inductor's
    default mode: fused triton kernels, no CUDA graphs): median seconds and tokens. The first two timed steps
    (dropped) include the compile. (Its op count is not kept: under the op counter's dispatch mode dynamo runs the
    step eager.)"""
    engine.model.compiled_decode = compiled
    try:
        out = runtime_step(engine, batch, context, steps, vocab, timer, seed)
    finally:
        engine.model.compiled_decode = None
    return {"compiled_step_s": out["step_s"], "compiled_tokens": out["tokens"]}


def graph_steps(engine, batch: int, context: int, steps: int, vocab: int, timer, seed: int, fused: bool = False) -> dict:
    """The service's own step with its decode steps captured as CUDA graphs (runtime/model/graph_decode.py over
    the KV pools of runtime/serving/row_pool.py, sized here for this cell's context; `fused`: inductor's kernels
    captured, MOEPLAN_GRAPH_INDUCTOR=1): median seconds, the host's ops and the GPU's kernels per replayed step, the
    buckets captured (capture included in the prefill's and first steps' time), tokens."""
    from moeplan.runtime.model.graph_decode import FUSED_ENV

    model = engine.model
    saved, saved_env = model.cache_columns, os.environ.get(FUSED_ENV)
    model.cache_columns = context + 3 * steps + 16
    os.environ[FUSED_ENV] = "1" if fused else "0"
    try:
        out = runtime_step(engine, batch, context, steps, vocab, timer, seed, graphs=True)
        graphs = model.compiled_decode
        if fused and not graphs.fused:
            raise RuntimeError(f"inductor refused the step: {graphs.failure}")
    finally:
        model.cache_columns, model.compiled_decode = saved, None
        if saved_env is None:
            del os.environ[FUSED_ENV]
        else:
            os.environ[FUSED_ENV] = saved_env
    key = "fused_graph" if fused else "service_graph"
    return {f"{key}_step_s": out["step_s"], f"{key}_ops": out["ops_per_step"], f"{key}_kernels": out["kernels"],
            f"{key}_buckets": graphs.captures, f"{key}_tokens": out["tokens"]}


def static_steps(engine, model, batch: int, context: int, steps: int, vocab: int, timer, seed: int, graphs: bool) -> dict:
    """The same engine and model over a StaticCache: eager decode steps, then (on a GPU, `graphs`) one step
    captured as a CUDA graph and replayed from the same prefill; median seconds of each, tokens compared."""
    import torch
    from transformers import StaticCache

    dev = engine.device
    dtype = next(model.parameters()).dtype
    total = context + 3 * steps + 16
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, vocab, (batch, context), generator=g).to(dev)
    cache = StaticCache(config=model.config, max_cache_len=total)
    kwarg = engine.model.cache_kwarg
    engine.install_hooks()
    try:
        _prepare_engine(engine, batch * context)
        with torch.no_grad():
            out = model(input_ids=prompt, position_ids=torch.arange(context, device=dev).expand(batch, -1),
                        use_cache=True, logits_to_keep=1, **{kwarg: cache})
        ids = out.logits[:, -1:].argmax(-1)                                       # int64 [B, 1], static
        pos = torch.full((batch, 1), context, dtype=torch.int64, device=dev)       # int64 [B, 1], static
        columns = torch.arange(total, device=dev)
        low = torch.finfo(dtype).min

        def step():
            """One decode step, all state on the device: mask from the position, next token into `ids`."""
            mask = torch.where(columns[None, None, None, :] <= pos[:, None, :, None], 0.0, low).to(dtype)  # [B, 1, 1, T]
            logits = model(input_ids=ids, position_ids=pos, attention_mask=mask, use_cache=True, **{kwarg: cache}).logits
            ids.copy_(logits[:, -1:].argmax(-1))
            pos.add_(1)

        _prepare_engine(engine, batch)
        saved = _cache_state(cache) + [ids.clone(), pos.clone()]
        eager_tokens = []

        def eager():
            with torch.no_grad():
                step()
            eager_tokens.append(ids[:, 0].clone())
        eager_times = [timer(eager) for _ in range(steps + 2)][2:]
        result = {"eager_step_s": statistics.median(eager_times), "static_tokens": [t.tolist() for t in eager_tokens]}
        if not graphs:
            return result
        _restore(cache, ids, pos, saved)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), torch.no_grad():
            for _ in range(3):  # warm-ups on a side stream, as torch.cuda.graphs asks
                step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        _restore(cache, ids, pos, saved)
        with torch.cuda.graph(graph), torch.no_grad():
            step()
        _restore(cache, ids, pos, saved)
        graph_tokens = []

        def replay():
            graph.replay()
            graph_tokens.append(ids[:, 0].clone())
        graph_times = [timer(replay) for _ in range(steps + 2)][2:]
        same = [bool(torch.equal(a, b)) for a, b in zip(eager_tokens, graph_tokens)]
        result.update(graph_step_s=statistics.median(graph_times), graph_tokens_match=sum(same) / len(same))
        return result
    finally:
        engine.remove_hooks()


def _prepare_engine(engine, rows: int) -> None:
    """The per-forward state `Engine.forward_rows` sets, for forwards made outside it: every row a real token."""
    import torch

    engine.keys = torch.arange(rows, dtype=torch.int64)
    engine.all_real, engine.replicated, engine._key_index = True, False, None
    engine.active = torch.arange(rows)
    engine.dev_active = engine.active.to(engine.device)
    engine.mine = torch.ones(rows, dtype=torch.bool)


def _cache_state(cache) -> list:
    return [t.clone() for layer in cache.layers for t in (layer.keys, layer.values, layer.cumulative_length)]


def _restore(cache, ids, pos, saved: list) -> None:
    """Put the cache, the next ids and positions back as they were after the prefill (in place: a graph
    holds their addresses)."""
    tensors = [t for layer in cache.layers for t in (layer.keys, layer.values, layer.cumulative_length)] + [ids, pos]
    for t, s in zip(tensors, saved):
        t.copy_(s)


def predicted_cell(config: dict, profile_name: str, batch: int, context: int, seed: int) -> dict:
    """The cost model's step for the cell: eager (what `runtime` and `static eager` run) and captured as a CUDA
    graph (what `service graph` and `static graph` run)."""
    from moeplan.core.hardware import load_hardware

    profile = load_hardware(profile_name)
    return {"predicted_step_s": predicted_decode_step(config, profile, batch, context, seed=seed, graphs=False),
            "predicted_graph_step_s": predicted_decode_step(config, profile, batch, context, seed=seed)}


def reprice(paths: list) -> int:
    """Price the cells of earlier decode_step.json files with this checkout's cost model (module docstring)."""
    print(f"{'file':<44} {'batch':>5} {'runtime ms':>10} {'predicted':>9} {'ratio':>6} {'graph ms':>9} "
          f"{'predicted':>9} {'ratio':>6}  load {os.getloadavg()[0]:.2f}")
    for path in paths:
        report = json.loads(Path(path).read_text())
        config = cut_config(QWEN3, report["layers"], tiny=False)
        for cell in report["cells"]:
            priced = predicted_cell(config, report["profile"], cell["batch"], report["context"], seed=0)
            eager, graph = priced["predicted_step_s"], priced["predicted_graph_step_s"]
            measured = cell.get("service_graph_step_s", cell.get("graph_step_s"))
            ratio = f"{measured / graph:>6.2f}" if measured else f"{'-':>6}"
            print(f"{Path(path).name:<44} {cell['batch']:>5} {cell['step_s'] * 1e3:>10.2f} {eager * 1e3:>9.2f} "
                  f"{cell['step_s'] / eager:>6.2f} {(measured or 0) * 1e3:>9.2f} {graph * 1e3:>9.2f} {ratio}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reprice", nargs="+", default=None, help="decode_step.json files to price again here")
    ap.add_argument("--config", default=str(QWEN3))
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 16, 64])
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=os.environ.get("OUT", str(REPO / "build" / "gpu_decode_step")))
    ap.add_argument("--allow-cpu", action="store_true", help="dry run without CUDA, tiny dims (seconds mean nothing)")
    ap.add_argument("--parts", nargs="+", default=list(PARTS), choices=PARTS,
                    help="the parts to run per cell (default: all; the inductor ones compile for minutes)")
    args = ap.parse_args(argv)
    if args.reprice:
        return reprice(args.reprice)
    import torch

    from moeplan.runtime.precision import device_precision

    cuda = torch.cuda.is_available()
    if not cuda and not args.allow_cpu:
        print("error: no CUDA device here; run this on a GPU machine (or pass --allow-cpu for a dry run)", file=sys.stderr)
        return 2
    device = torch.device("cuda:0" if cuda else "cpu")
    name = torch.cuda.get_device_name(device) if cuda else "cpu"
    profile = "h200-sxm" if "H200" in name else "h100-sxm"
    dtype = torch.bfloat16 if cuda else torch.float32  # the runtime holds a bf16 checkpoint at bf16 on sm80+
    config = cut_config(Path(args.config), args.layers, tiny=not cuda)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"gpu": name, "profile": profile, "torch": torch.__version__, "config": Path(args.config).name,
              "layers": args.layers, "context": args.context, "dtype": str(dtype).replace("torch.", ""),
              "device_precision": device_precision(device), "load_average": os.getloadavg()[0], "cells": []}
    built = time.perf_counter()
    engine, model, _ = build_engine(config, device, dtype, args.seed)
    report["build_s"] = time.perf_counter() - built
    if cuda:
        report["weights_gib"] = torch.cuda.memory_allocated(device) / 2**30
    timer = Timer(device)
    vocab = int(config["vocab_size"])
    from moeplan.runtime.model.compiled_decode import CompiledDecode

    compiled = CompiledDecode(engine.model.model, engine.model.cache_kwarg)  # one for every cell: its graphs are kept
    for batch in args.batches:
        cell = {"batch": batch}
        parts = (("runtime", runtime_step, (engine, batch, args.context, args.steps, vocab, timer, args.seed)),
                 ("service graph", graph_steps, (engine, batch, args.context, args.steps, vocab, timer, args.seed)),
                 ("static", static_steps, (engine, model, batch, args.context, args.steps, vocab, timer, args.seed, cuda)),
                 ("predicted", predicted_cell, (config, profile, batch, args.context, args.seed)),
                 # last: their first cell compiles triton kernels (a minute or more), which a short lease may cut off
                 ("fused graph", graph_steps, (engine, batch, args.context, args.steps, vocab, timer, args.seed, True)),
                 ("compiled", compiled_steps, (engine, compiled, batch, args.context, args.steps, vocab, timer, args.seed)))
        for part, fn, fn_args in parts:
            if part not in args.parts:
                continue
            try:
                cell.update(fn(*fn_args))
            except Exception as exc:  # one part failing must not lose the others' figures
                cell[f"{part}_error"] = f"{type(exc).__name__}: {exc}"
                traceback.print_exc()
            if cuda:
                torch.cuda.empty_cache()
        if "step_s" in cell:
            cell["seconds_per_op"] = cell["step_s"] / max(cell["ops_per_step"], 1)
            if "predicted_step_s" in cell:
                cell["runtime_over_predicted"] = cell["step_s"] / cell["predicted_step_s"]
        if "service_graph_step_s" in cell and "predicted_graph_step_s" in cell:
            cell["service_graph_over_predicted"] = cell["service_graph_step_s"] / cell["predicted_graph_step_s"]
        if "tokens" in cell and "compiled_tokens" in cell:  # the compiled step runs the same model
            pairs = list(zip(cell["tokens"], cell.pop("compiled_tokens")))
            cell["compiled_tokens_match_runtime"] = sum(a == b for a, b in pairs) / len(pairs)
            if "compiled_step_s" in cell and "step_s" in cell:
                cell["runtime_over_compiled"] = cell["step_s"] / cell["compiled_step_s"]
        for key in ("service_graph", "fused_graph"):  # bf16 near-ties may flip between bucket shapes
            if "tokens" in cell and f"{key}_tokens" in cell:
                pairs = list(zip(cell["tokens"], cell.pop(f"{key}_tokens")))
                cell[f"{key}_tokens_match_runtime"] = sum(a == b for a, b in pairs) / len(pairs)
                if f"{key}_step_s" in cell and "step_s" in cell:
                    cell[f"runtime_over_{key}"] = cell["step_s"] / cell[f"{key}_step_s"]
        if "tokens" in cell and "static_tokens" in cell:  # the static step runs the same model: same greedy tokens
            pairs = list(zip(cell.pop("tokens"), cell.pop("static_tokens")))
            cell["static_tokens_match_runtime"] = sum(a == b for a, b in pairs) / len(pairs)
        cell.pop("tokens", None)
        if "graph_step_s" in cell:
            cell["eager_over_graph"] = cell["eager_step_s"] / cell["graph_step_s"]
        report["cells"].append(cell)
        print(json.dumps(cell, sort_keys=True), flush=True)
        (out / "decode_step.json").write_text(json.dumps(report, indent=1, sort_keys=True))
    print(f"{name} ({profile}), {Path(args.config).name} cut to {args.layers} layers, context {args.context}, "
          f"{report['dtype']}, load {report['load_average']:.2f}")
    print(f"{'batch':>5} {'runtime ms':>11} {'ops':>6} {'us/op':>6} {'svc graph ms':>12} {'fused graph ms':>14} "
          f"{'kernels':>7} {'compiled ms':>11} "
          f"{'static ms':>10} {'graph ms':>9} "
          f"{'eager/graph':>11} {'predicted ms':>12} {'runtime/pred':>12} {'pred graph ms':>13} {'svc graph/pred':>14}")
    for c in report["cells"]:
        def ms(key, c=c):
            return f"{c[key] * 1e3:.2f}" if key in c else "-"
        print(f"{c['batch']:>5} {ms('step_s'):>11} {c.get('ops_per_step', '-'):>6} "
              f"{(c['seconds_per_op'] * 1e6 if 'seconds_per_op' in c else 0):>6.1f} {ms('service_graph_step_s'):>12} "
              f"{ms('fused_graph_step_s'):>14} {str(c.get('fused_graph_kernels', '-')):>7} {ms('compiled_step_s'):>11} "
              f"{ms('eager_step_s'):>10} "
              f"{ms('graph_step_s'):>9} {c.get('eager_over_graph', 0):>11.2f} {ms('predicted_step_s'):>12} "
              f"{c.get('runtime_over_predicted', 0):>12.2f} {ms('predicted_graph_step_s'):>13} "
              f"{c.get('service_graph_over_predicted', 0):>14.2f}")
    return 0 if all(not any(k.endswith("_error") for k in c) for c in report["cells"]) else 1


if __name__ == "__main__":
    sys.exit(main())
