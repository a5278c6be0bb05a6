"""Runtime prefetch benchmark: the example model's torchrun bundle with an expert cache, run with and
without prefetch, measured side by side (issue 13).

For each cache size (a share of the 96 (layer, expert) entries of examples/tiny_moe) four bundles
are compiled from the same planning trace (the training corpus) and run on the same held-out
prompts through the real CLI and torchrun (1 rank, CPU, `--verify`):
  demand (eviction moeplan, --prefetch none)      vs  moeplan prefetch (eviction moeplan)
  demand (eviction moe-infinity, --prefetch none) vs  moe-infinity prefetch (eviction moe-infinity)
Each pair differs only in the prefetcher. Printed per run: hit ratio, loads (prefetched, and how
many of those hit), bytes moved, measured wall ms per forward on this machine, the stepper's
modelled ms per forward (the plan's hardware profile, rtx4090-pcie4) and the time the runtime
waited for its background reader; then per pair the ratios prefetch / demand. Every run must
verify (logits, tokens, measured == simulated); the script stops otherwise.

    .venv/bin/python benchmarks/offload_runtime.py [--caches 0.2 0.4] [--new-tokens 16]
        [--prompts 4] [--repeats 3] [--json]

Wall times are the best of `--repeats` launches, demand and prefetch launched in turn. The
machine is shared (other jobs load its two cores), so wall times are noisy: compare the ratios of
one run, not absolute figures. Loads on demand (loads less prefetches) are deterministic: the
reads a step waits for on the compute thread. Experts of this model are 96 KiB (float32), read
from the page cache: on CPU a load costs little next to Python overhead, so the wall-time effect
of prefetch here says little about a GPU with PCIe copies; the modelled figures are the planner's
view of that setting.

`--json`: the last line is {"cases": [...], "pairs": [...], "setting": ...}.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BUILD = REPO / "build" / "offload_runtime_bench"
MODEL = REPO / "examples" / "tiny_moe"
PAIRS = (("moeplan", "moeplan"), ("moe-infinity", "moe-infinity"))  # (eviction, prefetcher)


def moeplan(*args) -> str:
    proc = subprocess.run([sys.executable, "-m", "moeplan.planner.cli", *map(str, args)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"moeplan {' '.join(map(str, args[:2]))} failed: {proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    return proc.stdout


def planning_trace(tokens: int) -> Path:
    out = BUILD / f"tiny_train_{tokens}.npz"
    if not out.exists():
        BUILD.mkdir(parents=True, exist_ok=True)
        moeplan("trace", MODEL, "--data", MODEL / "corpus_train.txt", "--max-tokens", tokens, "--out", out, "--quiet")
    return out


def prompts_file(count: int) -> Path:
    """`count` held-out lines of 40 characters (the same prompts for every run)."""
    text = " ".join((MODEL / "corpus_heldout.txt").read_text().split())
    out = BUILD / f"prompts_{count}.txt"
    out.write_text("\n".join(text[i * 40:(i + 1) * 40] for i in range(count)) + "\n")
    return out


HARDWARE = "rtx4090-pcie4"  # the modelled clock: the GPU a cache like this one would serve from


def compile_bundle(trace: Path, cache: int, eviction: str, prefetch: str) -> Path:
    bundle = BUILD / f"bundle_{cache}_{eviction}_{prefetch}"
    moeplan("compile", MODEL, "--trace", trace, "--policy", "contiguous", "--mode", "standard", "--expert-cache", cache,
            "--eviction", eviction, "--prefetch", prefetch, "--hardware", HARDWARE, "--out", bundle, "--quiet")
    return bundle


def run_bundle(bundle: Path, prompts: Path, new_tokens: int) -> dict:
    """One verified launch; its expert-cache report."""
    report = json.loads(moeplan("run", bundle, "--verify", "--new-tokens", new_tokens, "--mode", "standard",
                                "--prompts", prompts, "--results", bundle.with_name(bundle.name + "_results"),
                                "--json").strip().splitlines()[-1])
    c = report["expert_cache"]
    if not (report["verified"] and c["matches_simulation"]):
        raise SystemExit(f"bundle {bundle.name} did not verify: {json.dumps(c)}")
    return c


def summarise(bundle: Path, cache: int, eviction: str, prefetch: str, reports: list) -> dict:
    """The counters (the same in every launch: they depend on the routing only) and the best wall time."""
    walls = [c["seconds_per_token"]["measured_wall"] for c in reports]
    c = reports[-1]
    m, t = c["measured"], c["seconds_per_token"]
    return {"cache": cache, "eviction": eviction, "prefetch": prefetch, "hit_ratio": round(m["hit_ratio"], 4),
            "requests": m["requests"], "loads": m["loads"], "prefetches": m["prefetches"], "prefetch_hits": m["prefetch_hits"],
            "demand_loads": m["loads"] - m["prefetches"], "bytes_moved": m["bytes_moved"],
            "wall_ms_per_forward": round(min(walls) * 1e3, 3), "wall_ms_per_forward_all": [round(w * 1e3, 3) for w in walls],
            "modelled_ms_per_forward": round(t["modelled_for_these_tokens"] * 1e3, 4) if t["modelled_for_these_tokens"] else None,
            "reader_wait_ms": round(min(r["measured"]["prefetch_wait_s"] for r in reports) * 1e3, 3), "forwards": t["forwards"],
            "measured_equals_simulated": all(r["matches_simulation"] for r in reports),
            "counters_equal_across_launches": all(r["measured"]["loads"] == m["loads"] and r["measured"]["hits"] == m["hits"]
                                                  for r in reports), "bundle": bundle}


def modelled_demand_ms(demand: dict, prefetched: dict) -> float:
    """The demand run's modelled ms per forward on the prefetch bundle's timing (the same hardware
    profile): its logged requests replayed through the stepper without a prefetcher."""
    import torch

    from moeplan.passes.optimize.offload.replay import rank_stepper
    from moeplan.runtime.offload.stepper import rank_timing
    from moeplan.passes.optimize.offload.stream import stream_from_log

    spec = json.loads((demand["bundle"] / "plan.json").read_text())["communication"]["expert_cache"]
    timing = json.loads((prefetched["bundle"] / "plan.json").read_text())["communication"]["expert_cache"]["timing"]
    log = torch.load(demand["bundle"].with_name(demand["bundle"].name + "_results") / "standard" / "expert_cache.pt",
                     weights_only=True)["logs"][0]
    stream = stream_from_log(log)
    cache = rank_stepper(spec, 0, None, stream, timing=rank_timing({"timing": timing, "host": spec.get("host")}, 0,
                                                                   stream.num_experts))
    for s in range(len(stream.step_layer)):
        cache.step(s)
    return round(cache.now / stream.num_tokens * 1e3, 4)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--caches", type=float, nargs="+", default=[0.2, 0.4], help="cache sizes as shares of the 96 entries")
    ap.add_argument("--plan-tokens", type=int, default=4096)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    trace, prompts = planning_trace(args.plan_tokens), prompts_file(args.prompts)
    out = sys.stderr if args.json else sys.stdout
    cases, pairs = [], []
    for share in args.caches:
        cache = max(1, int(round(share * 96)))
        for eviction, prefetcher in PAIRS:
            bundles = {p: compile_bundle(trace, cache, eviction, p) for p in ("none", prefetcher)}
            reports = {p: [] for p in bundles}
            for _ in range(args.repeats):  # interleaved launches, so both see the same machine load
                for p, bundle in bundles.items():
                    reports[p].append(run_bundle(bundle, prompts, args.new_tokens))
            demand, pre = (summarise(bundles[p], cache, eviction, p, reports[p]) for p in ("none", prefetcher))
            cases += [demand, pre]
            for r in (demand, pre):
                print(f"cache {cache:>3} {r['eviction']:<12} prefetch {r['prefetch']:<12} hit ratio {r['hit_ratio']:.4f}  "
                      f"loads {r['loads']:>4} ({r['prefetches']} prefetched, {r['prefetch_hits']} hit; "
                      f"{r['demand_loads']} on demand)  "
                      f"{r['bytes_moved'] / 2**20:7.1f} MiB  wall {r['wall_ms_per_forward']:7.2f} ms/forward  "
                      f"waited {r['reader_wait_ms']:.2f} ms", file=out, flush=True)
            pair = {"cache": cache, "eviction": eviction, "prefetcher": prefetcher,
                    "wall_ratio": round(pre["wall_ms_per_forward"] / demand["wall_ms_per_forward"], 3),
                    "hit_ratio_ratio": round(pre["hit_ratio"] / demand["hit_ratio"], 3) if demand["hit_ratio"] else None,
                    "bytes_ratio": round(pre["bytes_moved"] / demand["bytes_moved"], 3) if demand["bytes_moved"] else None,
                    "demand_loads_ratio": round(pre["demand_loads"] / demand["demand_loads"], 3) if demand["demand_loads"] else None,
                    "modelled_ms_demand": modelled_demand_ms(demand, pre), "modelled_ms_prefetch": pre["modelled_ms_per_forward"]}
            pair["modelled_ratio"] = round(pair["modelled_ms_prefetch"] / pair["modelled_ms_demand"], 3)
            pairs.append(pair)
            print(f"  {prefetcher} prefetch / demand: wall {pair['wall_ratio']:.3f}x, hit ratio {pair['hit_ratio_ratio']}x, "
                  f"bytes {pair['bytes_ratio']}x, loads on demand {pair['demand_loads_ratio']}x; modelled on {HARDWARE} {pair['modelled_ms_prefetch']} vs "
                  f"{pair['modelled_ms_demand']} ms/forward ({pair['modelled_ratio']}x)",
                  file=out, flush=True)
    setting = ("examples/tiny_moe (6 MoE layers x 16 experts, top-2, 96 KiB float32 experts), 1 rank on CPU, "
               f"{args.prompts} held-out prompts batched, {args.new_tokens} new tokens, wall = best of {args.repeats}; "
               "shared 2-core machine under load")
    for c in cases:
        c["bundle"] = str(c["bundle"].relative_to(REPO))
    if args.json:
        print(json.dumps({"cases": cases, "pairs": pairs, "setting": setting}, sort_keys=True))
    else:
        print("setting: " + setting)
    return 0


if __name__ == "__main__":
    sys.exit(main())
