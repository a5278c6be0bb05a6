"""The offloading runtime's backing store: bytes read from disk vs copied from host memory per
token at several host-tier sizes, measured in real runs beside the simulator's prediction.

The example model (examples/qwen3_moe: a real transformers directory, 4 MoE layers x 8 experts,
top-2) is compiled with `--weights reference` (ranks read experts straight from the original
checkpoint) and an expert cache of `--cache` entries, at each host tier of `--host-fractions` of
a rank's experts (`--host-memory` = that many float32 experts x ranks). Each bundle runs
`moeplan run --verify` on held-out text: the ranks preload the plan's host-tier experts, count
every later load as a disk read or a host copy, and verify compares the counts with the
simulator's replay of the same requests (passes/optimize/offload/tiers.py). The all-disk tier
(fraction 0) is the baseline: the other rows give their disk bytes as a ratio of it. Bytes are
exact; CPU seconds are not reported (the OS page cache makes a "disk" read a memory copy here).

    .venv/bin/python benchmarks/offload_tiers.py [--host-fractions 0 0.5 1] [--cache 8] [--ranks 1 2]
        [--new-tokens 16] [--json]

`--json`: the last line is {"rows": [{"ranks", "host_fraction", "host_experts_per_rank",
"disk_bytes_per_token": {"measured", "predicted"}, "host_bytes_per_token": {...}, "verified",
"disk_ratio_vs_all_disk"}], "model", "cache"}.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MODEL = REPO / "examples" / "qwen3_moe"
CORPUS = REPO / "examples" / "tiny_moe"


def moeplan(*args) -> dict:
    """Run the CLI; the JSON object of its last line."""
    proc = subprocess.run([sys.executable, "-m", "moeplan.planner.cli", *map(str, args), "--json"], capture_output=True,
                          text=True)
    if proc.returncode != 0:
        raise SystemExit(f"moeplan {' '.join(map(str, args))} failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def prompts(path: Path, count: int) -> Path:
    """`count` held-out lines of the corpus, as run prompts (first 60 characters each)."""
    lines = [l.strip()[:60] for l in (CORPUS / "corpus_heldout.txt").read_text().splitlines() if len(l.strip()) > 20]
    path.write_text("\n".join(lines[:count]) + "\n")
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host-fractions", type=float, nargs="+", default=[0.0, 0.5, 1.0])
    ap.add_argument("--cache", type=int, default=8, help="expert cache entries per rank")
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--work", default=str(REPO / "build" / "offload_tiers"))
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    trace = work / "trace.npz"
    if not trace.exists():
        subprocess.run([sys.executable, "-m", "moeplan.planner.cli", "trace", str(MODEL), "--data",
                        str(CORPUS / "corpus_train.txt"), "--max-tokens", "4096", "--out", str(trace), "--quiet"], check=True)
    prompt_file = prompts(work / "prompts.txt", args.prompts)
    config = json.loads((MODEL / "config.json").read_text())
    keys = config["num_hidden_layers"] * config["num_local_experts"]
    from moeplan.passes.optimize.offload.rank_caches import runtime_expert_bytes
    from moeplan.passes.importers.hf_streaming import load_directory_meta

    expert_bytes = runtime_expert_bytes(load_directory_meta(MODEL).ir)  # one float32 expert, as the host tier holds it
    rows = []
    for ranks in args.ranks:
        baseline = None
        for fraction in args.host_fractions:
            bundle = work / f"r{ranks}_h{fraction:g}"
            per_rank = round(fraction * keys / ranks)
            host_bytes = per_rank * expert_bytes * ranks
            moeplan("compile", MODEL, "--trace", trace, "--gpus-per-node", ranks, "--policy", "contiguous", "--mode",
                    "standard", "--weights", "reference", "--expert-cache", args.cache, "--eviction", "lru",
                    "--host-memory", host_bytes, "--hardware", "rtx4090-pcie4",  # the prefetch choice's clock, as measured
                    "--out", bundle, "--quiet")
            spec = json.loads((bundle / "plan.json").read_text())["communication"]["expert_cache"]
            report = moeplan("run", bundle, "--verify", "--nproc", ranks, "--mode", "standard", "--new-tokens",
                             args.new_tokens, "--prompts", prompt_file)
            report = report["modes"]["standard"] if "modes" in report else report
            cache = report["expert_cache"]
            m, p = cache["measured"], cache["simulated"]
            tokens = args.new_tokens * args.prompts
            row = {"ranks": ranks, "host_fraction": fraction, "host_experts_per_rank": spec["host"]["capacity"],
                   "cache_per_rank": spec["capacity"], "hit_ratio": m["hit_ratio"], "loads": m["loads"],
                   "disk_bytes_per_token": {"measured": m["disk_bytes"] / tokens, "predicted": p["disk_bytes"] / tokens},
                   "host_bytes_per_token": {"measured": m["host_bytes"] / tokens, "predicted": p["host_bytes"] / tokens},
                   "preload_bytes": m["preload_bytes"], "verified": report["verified"],
                   "split_matches": all(m[k] == p[k] for k in ("disk_loads", "disk_bytes", "host_loads", "host_bytes"))}
            baseline = m["disk_bytes"] if baseline is None else baseline
            row["disk_ratio_vs_all_disk"] = m["disk_bytes"] / baseline if baseline else None
            rows.append(row)
            if not args.json:
                print(f"ranks {ranks} host {fraction:.2f} ({row['host_experts_per_rank']} experts/rank): disk "
                      f"{row['disk_bytes_per_token']['measured']:.0f} B/token (predicted "
                      f"{row['disk_bytes_per_token']['predicted']:.0f}), host {row['host_bytes_per_token']['measured']:.0f} "
                      f"(predicted {row['host_bytes_per_token']['predicted']:.0f}), x{row['disk_ratio_vs_all_disk']:.3f} of "
                      f"all-disk, verified {row['verified']}", flush=True)
    out = {"model": "examples/qwen3_moe", "cache": args.cache, "new_tokens": args.new_tokens, "prompts": args.prompts,
           "rows": rows}
    print(json.dumps(out, sort_keys=True))
    return 0 if all(r["verified"] and r["split_matches"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
