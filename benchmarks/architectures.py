"""Support matrix: every MoE architecture through trace, compile and a verified run, per target.

For each architecture (and each variant that once failed, `VARIANTS`: DeepSeek-V2 with its greedy,
unsorted top-4) a tiny seeded transformers model (examples/hf_tiny/architectures.py) goes
through the real CLI: `moeplan trace`, `moeplan compile --target torchrun` at 2 and 4 ranks and
`--target kubernetes` at 2 ranks, each followed by `moeplan run --verify --mode both` (coherent
and standard in one launch; a Kubernetes bundle's pods run exactly the bundle `run` launches),
and `compile --target lambda`. A cell passes when both modes reproduce transformers' logits
within 1e-4 (fp32) with identical greedy tokens and, in coherent mode, the measured
gpu_local_fraction equals the planner's prediction; otherwise it shows the one-line reason. The
lambda cell compiles the Lambda bundle (`--slo 5`) and runs `moeplan run --verify`: the bundle's
own state machine with every function in its own process against local S3 and Lambda endpoints;
it passes when the logits are within 1e-4 of transformers' and the greedy tokens are identical.

    .venv/bin/python benchmarks/architectures.py [--arch qwen3_moe olmoe ...] [--targets lambda ...]
                                                 [--work build/architectures] [--json]

Reference figures: the table prints max |logit diff| per cell beside the 1e-4 tolerance; there is
no timing in this benchmark (the machine's load would make it noise).
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "examples" / "hf_tiny"))

import architectures as tiny  # noqa: E402  examples/hf_tiny/architectures.py

DATA = "\n".join([
    "Mixture-of-experts models route every token to a few experts.",
    "Expert parallelism places experts on devices and moves tokens between them.",
    "The quick brown fox jumps over the lazy dog.",
    "moeplan compiles a plan into a bundle that runs and verifies itself.",
]) + "\n"
PROMPTS = "hello experts\nids: 5 9 11 3 40 2\nplace me well\n"
K8S = ("--cpu-only", "--image", "registry.example/moe:1")  # CPU pods: the bundle runs here
COLUMNS = ("trace", "torchrun-2", "torchrun-4", "kubernetes", "lambda")


def cli(args: list) -> tuple:
    """(exit code, stdout + stderr) of one `moeplan` command (the installed console script)."""
    import subprocess

    exe = Path(sys.executable).parent / "moeplan"
    proc = subprocess.run([str(exe)] + [str(a) for a in args], capture_output=True, text=True)
    return proc.returncode, proc.stdout + "\n" + proc.stderr


def _reason(output: str) -> str:
    lines = [l for l in output.strip().splitlines() if l.strip()]
    errors = [l for l in lines if l.startswith("error:")]
    return (errors or lines or ["no output"])[-1][:160]


def verified_run(bundle: Path, ranks: int, prompts: Path) -> dict:
    """`moeplan run --verify --mode both`; {'ok', 'diff', 'reason'}."""
    code, out = cli(["run", bundle, "--verify", "--nproc", ranks, "--new-tokens", 3, "--mode", "both",
                     "--prompts", prompts, "--json"])
    try:
        modes = json.loads(next(l for l in reversed(out.splitlines()) if l.startswith("{")))["modes"]
    except (ValueError, StopIteration, KeyError):
        return {"ok": False, "diff": None, "reason": _reason(out)}
    bad = [m for m, r in modes.items() if not r.get("verified")]
    diff = max(r.get("max_abs_logit_diff", float("inf")) for r in modes.values())
    return {"ok": code == 0 and not bad, "diff": diff,
            "reason": "" if not bad else f"{','.join(bad)}: tokens_match/diff/locality failed ({diff:.2e})"}


def check_architecture(arch: str, work: Path, ranks=(2, 4), kubernetes: bool = True, lambda_: bool = True,
                       torchrun: bool = True) -> dict:
    """One row of the matrix: {column: {'ok', 'diff', 'reason'}}."""
    root = work / arch
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    model = tiny.build(arch, root / "models")
    (root / "data.txt").write_text(DATA)
    (root / "prompts.txt").write_text(PROMPTS)
    row = {}
    code, out = cli(["trace", model, "--data", root / "data.txt", "--out", root / "trace.npz", "--quiet"])
    row["trace"] = {"ok": code == 0, "diff": None, "reason": "" if code == 0 else _reason(out)}
    targets = ([(f"torchrun-{n}", "torchrun", n) for n in ranks] if torchrun else []) + \
        ([("kubernetes", "kubernetes", 2)] if kubernetes else [])
    for column, target, n in targets:
        if not row["trace"]["ok"]:
            row[column] = {"ok": False, "diff": None, "reason": "no trace"}
            continue
        bundle = root / f"bundle-{column}"
        code, out = cli(["compile", model, "--trace", root / "trace.npz", "--target", target, "--nodes", 1,
                         "--gpus-per-node", n, "--time-limit", 5, "--balance", 4, "--redundant", n, "--out", bundle, "--quiet",
                         *(K8S if target == "kubernetes" else ())])
        row[column] = verified_run(bundle, n, root / "prompts.txt") if code == 0 else \
            {"ok": False, "diff": None, "reason": "compile: " + _reason(out)}
    if lambda_:
        if not row["trace"]["ok"]:
            row["lambda"] = {"ok": False, "diff": None, "reason": "no trace"}
        else:
            code, out = cli(["compile", model, "--trace", root / "trace.npz", "--target", "lambda", "--slo", 5,
                             "--cache-dir", root / "cache", "--out", root / "bundle-lambda", "--quiet"])
            row["lambda"] = verified_run_lambda(root / "bundle-lambda", root / "prompts.txt") if code == 0 else \
                {"ok": False, "diff": None, "reason": "compile: " + _reason(out)}
    return row


def verified_run_lambda(bundle: Path, prompts: Path) -> dict:
    """`moeplan run --verify` of a Lambda bundle (the local state machine); {'ok', 'diff', 'reason'}."""
    code, out = cli(["run", bundle, "--verify", "--new-tokens", 3, "--prompts", prompts, "--json"])
    try:
        report = json.loads(next(l for l in reversed(out.splitlines()) if l.startswith("{")))
    except (ValueError, StopIteration):
        return {"ok": False, "diff": None, "reason": _reason(out)}
    diff = report.get("max_abs_logit_diff", float("inf"))
    ok = code == 0 and bool(report.get("verified")) and bool(report.get("tokens_match"))
    return {"ok": ok, "diff": diff, "invocations": report.get("invocations"),
            "reason": "" if ok else f"tokens_match={report.get('tokens_match')}, diff {diff:.2e}"}


def _cell(c: dict) -> str:
    if c is None:
        return "-"
    if c["ok"]:
        return "ok" if c["diff"] is None else f"ok ({c['diff']:.1e})"
    return "FAIL: " + c["reason"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    every = tiny.ARCHITECTURES + tuple(tiny.VARIANTS)
    ap.add_argument("--arch", nargs="*", default=list(every), choices=every)
    ap.add_argument("--ranks", nargs="*", type=int, default=[2, 4])
    ap.add_argument("--targets", nargs="*", default=["torchrun", "kubernetes", "lambda"],
                    choices=["torchrun", "kubernetes", "lambda"], help="which columns to fill (trace always runs)")
    ap.add_argument("--work", default=str(REPO / "build" / "architectures"))
    ap.add_argument("--json", action="store_true", help="print the matrix as one JSON object on the last line")
    args = ap.parse_args(argv)
    work = Path(args.work)
    matrix = {}
    for arch in args.arch:
        matrix[arch] = check_architecture(arch, work, ranks=tuple(args.ranks), torchrun="torchrun" in args.targets,
                                          kubernetes="kubernetes" in args.targets, lambda_="lambda" in args.targets)
        print(f"{arch:16s} " + " | ".join(f"{k}: {_cell(v)}" for k, v in matrix[arch].items()), flush=True)
    columns = [c for c in COLUMNS if any(c in row for row in matrix.values())]
    print()
    print("| architecture | " + " | ".join(columns) + " |")
    print("|---" * (len(columns) + 1) + "|")
    for arch, row in matrix.items():
        print(f"| {arch} | " + " | ".join(_cell(row.get(c)) for c in columns) + " |")
    passed = sum(all(row[c]["ok"] for c in columns) for row in matrix.values())
    print(f"\n{passed}/{len(matrix)} architectures pass every cell run ({', '.join(columns)}; tolerance 1e-4, fp32)")
    if args.json:
        print(json.dumps({"matrix": matrix, "columns": columns, "passed": passed, "architectures": len(matrix)},
                         sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
