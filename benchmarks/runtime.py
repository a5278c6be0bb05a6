"""Runtime benchmark: contiguous + standard EP vs ilp + context-coherent EP (and each change alone).

On the example model, for 2 ranks (1 node x 2) and 4 ranks (2 nodes x 2): compile one bundle per
placement policy from a trace of the training corpus, then run held-out prompts through every
(placement, mode) pair with `torchrun --standalone` (gloo on CPU) and report all-to-all bytes and
messages per generated token and tokens/s, side by side with the baseline measured in the same
run. `--verify` also checks each run against the source model. GPU runs need one GPU per rank
(nccl); with fewer GPUs they are reported as skipped.

    python benchmarks/runtime.py [--ranks 2 4] [--new-tokens 8] [--prompts 8] [--json]

With --json the last line is {"runs": [{"ranks", "placement", "mode", "bytes_per_token",
"messages_per_token", "tokens_per_second", ...}, ...]}.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TOPOLOGIES = {2: (1, 2), 4: (2, 2)}
PAIRS = (("contiguous", "standard"), ("contiguous", "coherent"), ("ilp", "standard"), ("ilp", "coherent"))


def record(model: str, text_path: Path, max_tokens: int, out: Path) -> Path:
    from moeplan.passes.analysis.trace.record import record_trace
    from moeplan.passes.analysis.trace.format import save_trace
    from moeplan.planner.importers import load_model

    save_trace(record_trace(load_model(model), text_path.read_text(encoding="utf-8"), max_tokens=max_tokens), out)
    return out


def held_out_prompts(path: Path, count: int, length: int) -> list:
    text = " ".join(path.read_text(encoding="utf-8").split())
    step = max(1, (len(text) - length) // max(count, 1))
    return [text[i * step: i * step + length].strip() for i in range(count)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(REPO / "examples" / "tiny_moe"))
    ap.add_argument("--trace", default=None, help="placement trace; default: record one on the training corpus")
    ap.add_argument("--trace-tokens", type=int, default=4096)
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4], choices=sorted(TOPOLOGIES))
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-length", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--time-limit", type=float, default=20.0, help="ilp solver time limit, seconds")
    ap.add_argument("--verify", action="store_true")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    import torch

    from moeplan.planner.pipeline.run import run_modes
    from moeplan.planner.pipeline.targets import compile_bundle

    runs = []
    with tempfile.TemporaryDirectory(prefix="moeplan-bench-") as scratch:
        scratch = Path(scratch)
        model_dir = Path(args.model)
        trace = Path(args.trace) if args.trace else record(args.model, model_dir / "corpus_train.txt",
                                                          args.trace_tokens, scratch / "trace.npz")
        prompts_file = scratch / "prompts.txt"
        prompts_file.write_text("\n".join(held_out_prompts(model_dir / "corpus_heldout.txt", args.prompts,
                                                           args.prompt_length)) + "\n")
        gpus = torch.cuda.device_count()
        for ranks in args.ranks:
            nodes, per_node = TOPOLOGIES[ranks]
            bundles = {}
            for policy in ("contiguous", "ilp"):
                out = scratch / f"bundle-{ranks}-{policy}"
                compile_bundle(args.model, str(trace), nodes, per_node, str(out),
                               {"policy": policy, "time_limit": args.time_limit}, quiet=True)
                bundles[policy] = out
            if gpus and gpus < ranks:
                print(f"note: {ranks} ranks on {gpus} GPU(s) cannot use nccl; skipped", file=sys.stderr)
                continue
            reports = {policy: run_modes(str(bundles[policy]), ranks, str(prompts_file), args.new_tokens,
                                         ("standard", "coherent"), args.verify, None, 600)
                       for policy in bundles}
            for policy, mode in PAIRS:
                r = reports[policy][mode]
                runs.append({
                    "ranks": ranks, "placement": policy, "mode": mode, "device": "cuda" if gpus else "cpu",
                    "bytes_per_token": round(r["bytes_per_token"], 1),
                    "messages_per_token": round(r["messages_per_token"], 3),
                    "tokens_per_second": round(r["tokens_per_second"], 2),
                    "total_bytes_per_token": round(r["total_bytes_per_token"], 1),
                    "gpu_local_fraction": round(r["gpu_local_fraction"], 4),
                    "predicted_gpu_local_fraction": round(r["predicted_gpu_local_fraction"], 4),
                    **({"verified": r["verified"]} if args.verify else {}),
                })
    _table(runs)
    if args.json:
        print(json.dumps({"runs": runs}, sort_keys=True))
    return 0


def _table(runs: list) -> None:
    print(f"{'ranks':>5} {'placement':>10} {'mode':>9} {'a2a B/tok':>10} {'vs base':>8} {'msg/tok':>8} "
          f"{'all B/tok':>10} {'tok/s':>7} {'vs base':>8} {'gpu_local':>9}")
    for r in runs:
        base = next(b for b in runs if b["ranks"] == r["ranks"] and b["placement"] == "contiguous" and b["mode"] == "standard")
        print(f"{r['ranks']:>5} {r['placement']:>10} {r['mode']:>9} {r['bytes_per_token']:>10.0f} "
              f"{r['bytes_per_token'] / base['bytes_per_token']:>8.2f} {r['messages_per_token']:>8.2f} "
              f"{r['total_bytes_per_token']:>10.0f} {r['tokens_per_second']:>7.1f} "
              f"{r['tokens_per_second'] / base['tokens_per_second']:>8.2f} {r['gpu_local_fraction']:>9.3f}")


if __name__ == "__main__":
    sys.exit(main())
