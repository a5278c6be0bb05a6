"""How close `make demo`'s predicted ms/token come to the measured ones on this machine (issue 31 item 5).

    python benchmarks/demo_accuracy.py [--runs 5] [--calibrations 1] [--new-tokens 32 8]
                                       [--calibration-model examples/tiny_moe] [--work DIR] [--json]

Per calibration: a fresh `moeplan calibrate` (by default this machine's, on the seeded Qwen3-MoE,
into an empty cache, priced with `--hardware this-machine`; with `--calibration-model DIR`, on
that model's engine into a file, as `make demo` does with examples/tiny_moe), the demo's compile
(`examples/tiny_moe`, its held-out trace, 2 x 2 ranks, ILP), then `--runs` times the demo's
`moeplan run BUNDLE --nproc 4 --new-tokens N --mode both` for each N of `--new-tokens` (the
demo's 32 first). Prints, per run and mode, predicted and measured ms/token, the error (predicted
- measured) / measured, and how many runs fall within 25 % in both modes; the machine's 1-minute
load beside each. The demo's plan and prompts are none of the calibration's (contiguous experts,
8 x 32 token ids), nor, by default, its model: those figures are held out of the fit.
Run it on a quiet machine: a CPU prediction holds at the load it was calibrated at.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from moeplan.core.hardware import profile_from_dict

ROOT = Path(__file__).resolve().parents[1]
BOUND = 0.25


def moeplan(*args: str, env: dict) -> str:
    proc = subprocess.run([sys.executable, "-m", "moeplan.planner.cli", *args], env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"moeplan {' '.join(args)} failed: {(proc.stderr or proc.stdout).strip().splitlines()[-1:]}")
    return proc.stdout


def one_calibration(work: Path, runs: int, lengths: list, model: str | None = None) -> dict:
    """Calibrate into a fresh cache under `work` (on `model`'s engine into a file, if given), compile
    the demo, run it `runs` times per new-token count."""
    env = dict(os.environ, XDG_CACHE_HOME=str(work / "cache"))
    load = os.getloadavg()[0]
    work.mkdir(parents=True, exist_ok=True)
    hardware = "this-machine" if model is None else str(work / "hardware.yaml")
    own = [] if model is None else ["--model", model, "--out", hardware]
    profile = json.loads(moeplan("calibrate", *own, "--json", env=env))["profile"]
    trace = work / "trace.npz"
    if not trace.exists():
        moeplan("trace", str(ROOT / "examples" / "tiny_moe"), "--data", str(ROOT / "examples" / "tiny_moe" / "corpus_heldout.txt"),
                "--out", str(trace), env=env)
    bundle = work / "bundle"
    moeplan("compile", str(ROOT / "examples" / "tiny_moe"), "--trace", str(trace), "--target", "torchrun", "--nodes", "2",
            "--gpus-per-node", "2", "--policy", "ilp", "--time-limit", "20", "--hardware", hardware, "--out",
            str(bundle), "--force", env=env)
    rows = []
    for new_tokens in lengths:
        for _ in range(runs):
            report = json.loads(moeplan("run", str(bundle), "--nproc", "4", "--new-tokens", str(new_tokens), "--mode", "both",
                                        "--json", env=env))["modes"]
            rows.append({"new_tokens": new_tokens} | {mode: figures(r) for mode, r in report.items()})
    latency = {w: profile_from_dict(profile, "calibration").collective_latency(w) for w in (2, 4)}
    return {"calibration_load": round(load, 2), "op_overhead_us": profile["op_overhead_s"] * 1e6,
            "exchange_call_us": {w: v * 1e6 for w, v in latency.items()}, "runs": rows}


def figures(report: dict) -> dict:
    """One mode of `moeplan run --json`: predicted and measured ms/token, the error, the load."""
    predicted, measured = report["predicted_seconds_per_token"], report["seconds_per_token"]
    return {"predicted_ms": predicted * 1e3, "measured_ms": measured * 1e3, "error": predicted / measured - 1,
            "load": report["load_average"]}


def modes(row: dict) -> dict:
    return {k: v for k, v in row.items() if k != "new_tokens"}


def within(rows: list) -> int:
    """Runs whose error is within the bound in both modes."""
    return sum(all(abs(m["error"]) <= BOUND for m in modes(r).values()) for r in rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5, help="demo runs per calibration")
    ap.add_argument("--calibrations", type=int, default=1, help="fresh calibrations, each followed by --runs runs")
    ap.add_argument("--new-tokens", type=int, nargs="+", default=[32, 8], help="new tokens per run (the demo's: 32)")
    ap.add_argument("--calibration-model", default=None,
                    help="calibrate on this model directory's engine (calibrate --model DIR --out F) instead of the default")
    ap.add_argument("--work", default=None, help="directory for caches, trace and bundles (default: a temporary one)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="moeplan-demo-accuracy-") as tmp:
        work = Path(args.work or tmp)
        results = [one_calibration(work / f"calibration-{i}", args.runs, args.new_tokens, args.calibration_model) for i in range(args.calibrations)]
    if args.json:
        print(json.dumps(results, sort_keys=True))
        return
    for i, c in enumerate(results):
        calls = ", ".join(f"{v:.0f} us at {w} ranks" for w, v in c["exchange_call_us"].items())
        print(f"calibration {i} (load {c['calibration_load']}): framework call {c['op_overhead_us']:.1f} us, exchange call {calls}")
        for r in c["runs"]:
            print(f"  {r['new_tokens']:3d} new: " + "   ".join(
                f"{mode} predicted {m['predicted_ms']:.2f} measured {m['measured_ms']:.2f} ms/token ({m['error']:+.1%})"
                for mode, m in sorted(modes(r).items())) + f"   load {r['coherent']['load']}")
    for n in args.new_tokens:
        rows = [r for c in results for r in c["runs"] if r["new_tokens"] == n]
        errors = {mode: [r[mode]["error"] for r in rows] for mode in ("coherent", "standard")}
        print(f"{n} new tokens: " + ", ".join(f"{mode} {min(e):+.1%} .. {max(e):+.1%}" for mode, e in errors.items())
              + f"; {within(rows)} of {len(rows)} runs within {BOUND:.0%} in both modes")

if __name__ == "__main__":
    main()
