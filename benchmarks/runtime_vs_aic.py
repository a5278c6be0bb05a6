"""moeplan's own runtime (torchrun bundles) as its cost model predicts it on H100s, beside AIConfigurator 0.12.0's
SGLang estimate for the same cell (issue 39 item 4: within 2x at Qwen3-30B-A3B, 8 GPUs, batch 16).

For Qwen3-30B-A3B on 1 and 8 H100s (experts contiguous over the GPUs, standard mode) at 1, 16 and 64 requests per
GPU, and DeepSeek-V3 on 64 H100s (8 nodes of 8, EP 64; at bf16 it fits no fewer) at 1 and 16 (`--deepseek`; its
prediction replays every prompt token, minutes at 64 per GPU), 1024 prompt tokens and 128 new (each decode step
priced at the middle context, 1088 tokens): the torchrun cost model's decode step (`passes/cost/cost_model.py`, launch counts from `runtime_ops.py`: the runtime's counted
ops at the op cost measured on an H200, docs/gpu_checks.md; a service's GPU ranks replay their decode steps as
CUDA graphs, priced at the graph's measured op cost, ranks of several gathered), the same eager, the same with the
fitted counts it used before, and
AIConfigurator's TPOT (`cli_estimate` through benchmarks/aic_peer.py, in a Python with `aiconfigurator==0.12.0`,
run here in the same process tree). Balanced routing: k distinct experts per token, uniform.

    .venv/bin/python benchmarks/runtime_vs_aic.py [--aic-python /work/scratch/aic/venv/bin/python] [--deepseek]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from gpu_cost_vs_aic import DEFAULT_AIC_PYTHON, aic  # noqa: E402
from runtime_prediction import predicted_decode_step  # noqa: E402

QWEN3 = ("qwen3-30b-a3b.json", "Qwen/Qwen3-30B-A3B", 8)
DEEPSEEK = ("deepseek-v3.json", "deepseek-ai/DeepSeek-V3", 8)
CELLS = (("Qwen3-30B-A3B 1xH100", QWEN3, 1), ("Qwen3-30B-A3B 8xH100 ep8", QWEN3, 8))
DEEPSEEK_CELLS = (("DeepSeek-V3 64xH100 ep64", DEEPSEEK, 64),)


def runtime_step(model: tuple, gpus: int, per_gpu: int, context: int, profile, graphs: bool = True) -> float:
    """Seconds of one decode step of `per_gpu` x `gpus` sequences at `context` tokens (see module docstring)."""
    config = json.loads((ROOT / "examples" / "configs" / model[0]).read_text())
    return predicted_decode_step(config, profile, per_gpu * gpus, context, gpus, graphs=graphs,
                                 gpus_per_node=min(gpus, model[2]))


def main() -> int:
    from moeplan.core.hardware import load_hardware

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--aic-python", default=DEFAULT_AIC_PYTHON)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64], help="requests per GPU")
    ap.add_argument("--isl", type=int, default=1024)
    ap.add_argument("--osl", type=int, default=128)
    ap.add_argument("--deepseek", action="store_true", help="add DeepSeek-V3 on 64 H100s at 1 and 16 requests per GPU")
    args = ap.parse_args()
    if not Path(args.aic_python).is_file():
        print(f"error: --aic-python {args.aic_python} does not exist; give a Python with aiconfigurator==0.12.0",
              file=sys.stderr)
        return 2
    h100 = load_hardware("h100-sxm")
    fitted = dataclasses.replace(h100, runtime_op_overhead_s=None, graph_op_overhead_s=None, graph_op_row_s=None)
    rows = [(label, model, gpus, b) for label, model, gpus in CELLS for b in args.batches]
    if args.deepseek:
        rows += [(label, model, gpus, b) for label, model, gpus in DEEPSEEK_CELLS for b in args.batches if b <= 16]
    cells = [{"label": f"{label} b{b}", "model": model[1], "system": "h100_sxm", "tp": 1, "dp": gpus,
              "moe_tp": 1, "moe_ep": gpus, "batch": b, "isl": args.isl, "osl": args.osl, "distribution": "balanced"}
             for label, model, gpus, b in rows]
    peer = aic(cells, args.aic_python)
    context = args.isl + args.osl // 2
    print(f"# moeplan's runtime (torchrun cost model, h100-sxm) beside AIConfigurator 0.12.0 (sglang 0.5.14), "
          f"{args.isl} + {args.osl} tokens, decode at {context}; load average {os.getloadavg()[0]:.2f}")
    print(f"{'deployment':26s} {'req/GPU':>7s} {'runtime ms':>10s} {'eager ms':>8s} {'fitted ms':>9s} {'AIC ms':>8s} "
          f"{'runtime/AIC':>11s} {'eager/AIC':>9s} {'fitted/AIC':>10s}")
    for (label, model, gpus, b), other in zip(rows, peer):
        ours = runtime_step(model, gpus, b, context, h100) * 1e3
        before = runtime_step(model, gpus, b, context, fitted) * 1e3
        eager = runtime_step(model, gpus, b, context, h100, graphs=False) * 1e3
        theirs = other["tpot_ms"]
        ratio = (f"{ours / theirs:11.2f} {eager / theirs:9.2f} {before / theirs:10.2f}" if theirs
                 else f"{'-':>11s} {'-':>9s} {'-':>10s}")
        print(f"{label:26s} {b:7d} {ours:10.1f} {eager:8.1f} {before:9.1f} {theirs or 0:8.2f} {ratio}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
