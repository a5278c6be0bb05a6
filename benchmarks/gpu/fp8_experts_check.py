"""One MoE layer's routed experts held as bfloat16 and as FP8 with block scales (`runtime/model/fp8_experts.py`,
weight-only: the experts a call touches are dequantized for it), timed on the GPU at hand at a real model's size,
with the bytes each holds and how far the FP8 output is from the bf16 one. Run by device_checks.sh; never in tests.

The layer: the config's first MoE block (default examples/configs/qwen3-30b-a3b.json: 128 experts of 2048 x 768,
top-8), built by the runtime's own builder with seeded random weights at bf16, every expert on the one rank; its
adapter's `slot_output` (what the engine calls) on B token rows routed uniformly at random (`--batches`), CUDA
events around each call, median of `--repeats` after 3 warm-ups; then the same module's experts quantized on
128 x 128 blocks (`hold_fp8`) and timed again.

    python benchmarks/gpu/fp8_experts_check.py --out DIR [--batches 1 16 64 256] [--repeats 20]
    python benchmarks/gpu/fp8_experts_check.py --allow-cpu --out DIR   (a dry run with tiny dims: seconds mean nothing)

Writes DIR/fp8_experts.json and prints a table.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO / "benchmarks" / "gpu"))
from decode_step import QWEN3, Timer, cut_config  # noqa: E402
from single_rank_engine import build_engine  # noqa: E402


def time_experts(adapter, hidden: int, experts: int, top_k: int, batch: int, repeats: int, timer, device, seed: int):
    """(median seconds of one slot_output call, its output [B, D]) for B rows routed uniformly at random."""
    import torch

    g = torch.Generator().manual_seed(seed + batch)
    h = (torch.randn(batch, hidden, generator=g) * 0.5).to(device=device, dtype=torch.bfloat16)
    slots = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(batch)]).to(device)
    weights = torch.softmax(torch.randn(batch, top_k, generator=g), -1).to(device)
    with torch.no_grad():
        for _ in range(3):
            out = adapter.slot_output(h, slots, weights)
        times = [timer(lambda: adapter.slot_output(h, slots, weights)) for _ in range(repeats)]
    return statistics.median(times), out.float()


def held_bytes(module) -> int:
    return sum(t.numel() * t.element_size() for t in list(module.parameters()) + list(module.buffers()))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(QWEN3))
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 16, 64, 256])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=os.environ.get("OUT", str(REPO / "build" / "gpu_fp8_experts")))
    ap.add_argument("--allow-cpu", action="store_true", help="dry run without CUDA, tiny dims (seconds mean nothing)")
    args = ap.parse_args(argv)
    import torch

    from moeplan.runtime.model.fp8_experts import hold_fp8

    cuda = torch.cuda.is_available()
    if not cuda and not args.allow_cpu:
        print("error: no CUDA device here; run this on a GPU machine (or pass --allow-cpu for a dry run)", file=sys.stderr)
        return 2
    device = torch.device("cuda:0" if cuda else "cpu")
    config = cut_config(Path(args.config), 1, tiny=not cuda)
    engine, model, top_k = build_engine(config, device, torch.bfloat16, args.seed)
    adapter = engine.model.adapters[0]
    experts, hidden = adapter.container.num_experts, int(config["hidden_size"])
    module = adapter.library_experts
    block = (128, 128) if cuda else (8, 8)
    timer = Timer(device)
    report = {"gpu": torch.cuda.get_device_name(device) if cuda else "cpu", "torch": torch.__version__,
              "config": Path(args.config).name, "experts": experts, "top_k": top_k, "block": list(block),
              "load_average": os.getloadavg()[0], "bf16_bytes": held_bytes(module), "cells": []}
    bf16 = {b: time_experts(adapter, hidden, experts, top_k, b, args.repeats, timer, device, args.seed) for b in args.batches}
    hold_fp8(module, [p for p, shape in adapter.container.params if len(shape) == 3], block)
    report["fp8_bytes"] = held_bytes(module)
    print(f"{report['gpu']}: one MoE layer of {report['config']} ({experts} experts, top-{top_k}), held bytes bf16 "
          f"{report['bf16_bytes'] / 2**20:.1f} MiB, FP8 + scales {report['fp8_bytes'] / 2**20:.1f} MiB "
          f"({report['fp8_bytes'] / report['bf16_bytes']:.3f}x), load {report['load_average']:.2f}")
    print(f"{'batch':>6} {'bf16 ms':>9} {'fp8 ms':>9} {'fp8/bf16':>9} {'max |diff| / max |bf16|':>24}")
    for b in args.batches:
        seconds, out = time_experts(adapter, hidden, experts, top_k, b, args.repeats, timer, device, args.seed)
        ref_s, ref = bf16[b]
        diff = float((out - ref).abs().max() / ref.abs().max().clamp(min=1e-30))
        report["cells"].append({"batch": b, "bf16_s": ref_s, "fp8_s": seconds, "relative_diff": diff})
        print(f"{b:>6} {ref_s * 1e3:>9.3f} {seconds * 1e3:>9.3f} {seconds / ref_s:>8.2f}x {diff:>24.2e}")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "fp8_experts.json").write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
