"""The runtime's decode step over the KV cache with spare columns (runtime/model/growable_cache.py) beside the
same step over the library's own DynamicCache, which concatenates the whole cache at every step.

In one process, for each (batch, prompt tokens) cell: the service's BatchWorker (`single_rank_engine.py`: the
runtime's Engine at world 1, seeded random weights at float32, the precision this CPU holds) over
examples/qwen3_moe's config (head_dim 32, positions raised to 4,096 so long prompts fit), one admission step,
a few decode steps to warm up, then `--steps` timed decode steps; median ms per step for each cache, each
measurement in a fresh process (as a service runs: the allocator's state after one cache's run would
otherwise carry into the other's), the two caches alternating `--rounds` times (a shared machine drifts),
and their ratio.

    python benchmarks/kv_cache_growth.py [--cells 16x160 64x160 16x1024 64x512] [--steps 30] [--rounds 2]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))


def step_ms(config: dict, batch: int, prompt: int, steps: int, growable: bool) -> float:
    """Median ms of `steps` decode steps of `batch` sequences after prompts of `prompt` tokens."""
    import torch
    from single_rank_engine import build_engine
    from transformers import DynamicCache

    import moeplan.runtime.model.library_model as library_model
    from moeplan.runtime.model.growable_cache import growable_cache
    from moeplan.runtime.serving.step_plan import STEP, Admission, StepPlan
    from moeplan.runtime.serving.worker import BatchWorker

    library_model.growable_cache = growable_cache if growable else (lambda cfg, columns: DynamicCache(config=cfg))
    engine = build_engine(config, torch.device("cpu"), torch.float32, 0)[0]
    prompts = torch.randint(1, int(config["vocab_size"]), (batch, prompt), generator=torch.Generator().manual_seed(0))
    worker = BatchWorker(engine, "transformers", tokens_to_rank0=False)
    try:
        worker.step(StepPlan(STEP, [Admission(s, 0, tuple(p), seed=0, temperature=0.0, top_p=1.0, top_k=0)
                                    for s, p in enumerate(prompts.tolist())]))
        for _ in range(3):
            worker.step(StepPlan(STEP))
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            worker.step(StepPlan(STEP))
            times.append(time.perf_counter() - start)
    finally:
        worker.close()
        library_model.growable_cache = growable_cache
    return statistics.median(times) * 1e3


def measured(batch: int, prompt: int, steps: int, threads: int, growable: bool) -> float:
    """`step_ms` in a fresh Python process."""
    cmd = [sys.executable, __file__, "--one", f"{batch}x{prompt}", "spare" if growable else "library", "--steps",
           str(steps), "--threads", str(threads)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return float(out.strip().splitlines()[-1])


def main(argv=None) -> int:
    import torch

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--one", nargs=2, default=None, metavar=("BATCHxPROMPT", "CACHE"), help=argparse.SUPPRESS)
    ap.add_argument("--cells", nargs="+", default=["16x160", "64x160", "16x1024", "64x512"], help="BATCHxPROMPT")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.one:  # one measurement, in this (fresh) process
        config = json.loads((REPO / "examples" / "qwen3_moe" / "config.json").read_text())
        config.update(head_dim=32, max_position_embeddings=4096)
        batch, prompt = (int(x) for x in args.one[0].split("x"))
        print(step_ms(config, batch, prompt, args.steps, growable=args.one[1] == "spare"))
        return 0
    print(f"# decode step, qwen3_moe dims (head_dim 32), float32, {args.threads} thread(s), median of {args.steps} steps, "
          f"{args.rounds} alternating rounds")
    print(f"{'batch':>5} {'prompt':>6} {'library ms':>10} {'spare cols ms':>13} {'library/spare':>13}  load")
    for cell in args.cells:
        batch, prompt = (int(x) for x in cell.split("x"))
        library, spare = [], []
        for _ in range(args.rounds):
            library.append(measured(batch, prompt, args.steps, args.threads, growable=False))
            spare.append(measured(batch, prompt, args.steps, args.threads, growable=True))
        a, b = statistics.median(library), statistics.median(spare)
        print(f"{batch:5d} {prompt:6d} {a:10.2f} {b:13.2f} {a / b:13.2f}x  {os.getloadavg()[0]:.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
