"""The compiled decode step (runtime/model/compiled_decode.py) on every architecture the runtime serves, beside the
eager step it replaces, in one run: where it applies, its logits and tokens against the eager worker's, and the
decode step's time both ways.

Per architecture (examples/hf_tiny/architectures.py: each one's own transformers config at toy size, here with
seeded random weights) or per `--config FILE` (a real config cut to `--layers` blocks), two world-of-one service
workers (BatchWorker over the runtime's Engine, `benchmarks/single_rank_engine.py`) run the same step plans:
sequences of 1-20 prompt tokens joining in groups and leaving after 2-12 tokens, greedy. One is eager, the other
warmed up by `decode_compile.enable_compiled_decode` as a service does (its seconds: `compile s`). Printed: the
decode steps that took the compiled path, max |logit difference| over every forward, whether every token
matched, and the median decode step of each (steps timed alternately, 1 torch thread) with the ratio.

    .venv/bin/python benchmarks/compiled_decode.py [--arch qwen3_moe mixtral ...] [--steps 60]
    .venv/bin/python benchmarks/compiled_decode.py --config examples/qwen3_moe/config.json --layers 4
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))


def schedule(seed: int, steps: int, vocab: int) -> list:
    """Step plans: sequences joining in groups of 1-4 (1-20 prompt tokens), each leaving after 2-12 tokens."""
    from moeplan.runtime.serving.step_plan import STEP, Admission, StepPlan

    rng, plans, live, seq = random.Random(seed), [], {}, 100
    for _ in range(steps):
        admit = []
        if rng.random() < 0.35 and len(live) < 12:
            for _ in range(rng.randint(1, 4)):
                prompt = tuple(rng.randint(3, vocab - 1) for _ in range(rng.randint(1, 20)))
                admit.append(Admission(seq, 0, prompt, seed=0, temperature=0.0, top_p=1.0, top_k=0))
                live[seq], seq = rng.randint(2, 12), seq + 1
        depart = sorted(s for s, left in live.items() if left <= 0)
        for s in depart:
            live.pop(s)
        plans.append(StepPlan(STEP, admit, depart))
        for s in live:
            live[s] -= 1
    return plans


def worker_of(config: dict):
    """A service's worker (records nothing) over a seeded world-of-one engine, and the logits of its forwards."""
    import torch

    from moeplan.runtime.serving.worker import BatchWorker
    from single_rank_engine import build_engine

    engine = build_engine(config, torch.device("cpu"), torch.float32, seed=0)[0]
    return BatchWorker(engine, "transformers", tokens_to_rank0=False), keep_logits(engine)


def keep_logits(engine) -> list:
    """The list the engine's forwards append their token rows' logits to from now on (each forward's, in order;
    a left-padded prefill's padding rows hold no token: what they compute is the mask's business)."""
    logits, forward = [], engine.forward_rows

    def keep(ids, pos, key_mask, cache, keys):
        out = forward(ids, pos, key_mask, cache, keys)
        logits.append(out[0][(keys >= 0).to(out[0].device)].detach().clone())
        return out
    engine.forward_rows = keep
    return logits


def measure(name: str, config: dict, steps: int) -> dict:
    import torch

    from moeplan.runtime.serving.decode_compile import enable_compiled_decode
    from moeplan.runtime.serving.row_cache import UnsupportedCache, check_cache_layers

    # each model's graphs apart: dynamo keeps at most 8 graphs per function's code, then runs it eager (one
    # service compiles 2)
    torch._dynamo.reset()
    eager, eager_logits = worker_of(config)
    try:
        check_cache_layers(eager.engine.model.model, "transformers")
    except UnsupportedCache as exc:  # the service refuses it before any step
        return {"name": name, "refused": str(exc)}
    fast, fast_logits = worker_of(config)
    start = time.perf_counter()
    why = enable_compiled_decode(fast)
    compile_s = time.perf_counter() - start
    compiled = fast.engine.model.compiled_decode
    warm = compiled.steps if compiled is not None else 0
    eager_logits.clear()
    fast_logits.clear()
    times = {"eager": [], "compiled": []}
    same, diff, decodes = True, 0.0, 0
    for plan in schedule(0, steps, int(config["vocab_size"])):
        decoding = bool(eager.running - set(plan.depart))  # a sequence still running after the departures
        decodes += decoding
        ticks = []
        for w in (eager, fast):
            t = time.perf_counter()
            ticks.append(w.step(plan))
            ticks.append(time.perf_counter() - t)
        if decoding and not plan.admit:
            times["eager"].append(ticks[1])
            times["compiled"].append(ticks[3])
        same = same and ticks[0] == ticks[2]
        for a, b in zip(fast_logits, eager_logits):  # this step's forwards
            diff = max(diff, float((a - b).abs().max()))
        fast_logits.clear()
        eager_logits.clear()
        if not same:
            break
    for w in (eager, fast):
        w.close()
    ran = (compiled.steps - warm) if compiled is not None else 0
    e, c = statistics.median(times["eager"]), statistics.median(times["compiled"])
    return {"name": name, "why_eager": why, "compile_s": compile_s, "compiled_steps": ran, "decode_steps": decodes,
            "max_logit_diff": diff, "tokens_match": same, "eager_ms": e * 1e3, "compiled_ms": c * 1e3}


def main() -> int:
    import torch

    from moeplan.passes.importers.resolve import import_file

    tiny = import_file(ROOT / "examples" / "hf_tiny" / "architectures.py")
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", nargs="+", default=list(tiny.ARCHITECTURES), choices=tiny.ARCHITECTURES)
    ap.add_argument("--config", type=Path, help="a config.json (cut to --layers blocks) in place of the tiny architectures")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    os.environ["MOEPLAN_COMPILE"] = "1"
    torch.set_num_threads(1)
    cases = []
    if args.config:
        config = json.loads(args.config.read_text())
        config["num_hidden_layers"] = args.layers
        cases.append((args.config.parent.name, config))
    else:
        root = Path(tempfile.mkdtemp(prefix="compiled_decode_"))
        for arch in args.arch:
            cases.append((arch, json.loads((tiny.build(arch, root) / "config.json").read_text())))
    print(f"# compiled decode step beside the eager one, {args.steps} step plans, 1 thread; "
          f"load average {os.getloadavg()[0]:.2f}")
    print(f"{'model':22s} {'compile s':>9s} {'compiled/decode':>15s} {'max|dlogit|':>11s} {'tokens':>6s} "
          f"{'eager ms':>8s} {'compiled ms':>11s} {'eager/compiled':>14s}  note")
    rows = []
    for name, config in cases:
        try:
            row = measure(name, config, args.steps)
        except Exception as exc:  # one architecture's failure is a row of the table, not the end of the run
            row = {"name": name, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"}
        rows.append(row)
        if "error" in row or "refused" in row:
            print(f"{name:22s} {'error' if 'error' in row else 'refused by the service'}: {row.get('error') or row['refused']}")
            continue
        print(f"{name:22s} {row['compile_s']:9.1f} {row['compiled_steps']:>7d}/{row['decode_steps']:<7d} "
              f"{row['max_logit_diff']:11.2e} {'same' if row['tokens_match'] else 'DIFF':>6s} {row['eager_ms']:8.2f} "
              f"{row['compiled_ms']:11.2f} {row['eager_ms'] / row['compiled_ms']:13.2f}x  {row['why_eager'] or ''}")
    print(f"# load average {os.getloadavg()[0]:.2f}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
