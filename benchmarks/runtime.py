"""Runtime benchmark: every placement x mode against contiguous + standard EP, measured beside the
cost model's prediction, and the plan `moeplan compile` emits with no mode or policy flags.

On the example model, for 2 ranks (1 node x 2) and 4 ranks (2 nodes x 2): compile one bundle per
placement policy (contiguous, eplb, ilp) from a trace of the training corpus, plus the default
plan (policy auto, mode auto, cpu-gloo profile), then run held-out prompts through every
(placement, mode) pair with `torchrun --standalone` (gloo on CPU). Each bundle runs both modes in
one launch; launches go round-robin over the bundles `--repeats` times and tokens/s is the median
(the machine may be shared: ratios to the baseline are what to read, not absolute figures).

Predictions, from the cost model (`passes/cost/cost_model.py`):
* `predicted_total_bytes_per_token`: on the routing the run recorded (must equal the measurement);
* `prior_total_bytes_per_token`: before the run, routing sampled from the plan's trace;
* `predicted_seconds_per_token`: on the run's routing, priced with the cpu-gloo profile; compare
  `predicted_ratio` (baseline's predicted seconds / this one's) with `measured_ratio` (tokens/s
  over the baseline's).

    python benchmarks/runtime.py [--model DIR|gqa|mla] [--policies contiguous ...] [--ranks 2 4]
                                 [--new-tokens 8] [--prompts 8] [--repeats 3] [--json]

`--model gqa` / `--model mla` build the seeded random-weight transformers models of
examples/hf_tiny/kv_rows.py (Qwen3-MoE with 8 query heads and 1 KV head, K + V = 16 elements
against a hidden state of 64; DeepSeek-V3 with MLA, latent 16 + rotated key 8 = 24 against 64);
models without a corpus use examples/tiny_moe's. Where coherent mode's context
exchange sends K/V instead of the hidden state for some block (`runtime/ep/context_exchange.py`),
every coherent bundle is also run with `--context hidden`: rows carry `context` ("kv" or "hidden").

With --json the last line is {"runs": [{"ranks", "placement", "mode", "bytes_per_token",
"total_bytes_per_token", "predicted_total_bytes_per_token", "tokens_per_second",
"predicted_seconds_per_token", ...}], "default": {ranks: {...same keys...}}}.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TOPOLOGIES = {2: (1, 2), 4: (2, 2)}
POLICIES = ("contiguous", "eplb", "ilp")
MODES = ("standard", "coherent")
CORPUS = REPO / "examples" / "tiny_moe"
KV_ROWS = REPO / "examples" / "hf_tiny" / "kv_rows.py"  # --model gqa | mla: its seeded models


def build_named_model(name: str, out: Path) -> Path:
    from moeplan.passes.importers.resolve import import_file

    return import_file(KV_ROWS).build(name, out)


def record(model: str, text_path: Path, max_tokens: int, out: Path) -> Path:
    from moeplan.passes.analysis.trace.record import record_trace
    from moeplan.passes.analysis.trace.format import save_trace
    from moeplan.passes.importers import load_model

    save_trace(record_trace(load_model(model), text_path.read_text(encoding="utf-8"), max_tokens=max_tokens), out)
    return out


def held_out_prompts(path: Path, count: int, length: int) -> list:
    text = " ".join(path.read_text(encoding="utf-8").split())
    step = max(1, (len(text) - length) // max(count, 1))
    return [text[i * step: i * step + length].strip() for i in range(count)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(REPO / "examples" / "tiny_moe"),
                    help="model directory, or gqa / mla (examples/hf_tiny/kv_rows.py, built here, seeded)")
    ap.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES,
                    help="placements to run (contiguous, the baseline, is always run)")
    ap.add_argument("--trace", default=None, help="placement trace; default: record one on the training corpus")
    ap.add_argument("--trace-tokens", type=int, default=4096)
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4], choices=sorted(TOPOLOGIES))
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-length", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3, help="launches per bundle (round-robin); tokens/s is the median")
    ap.add_argument("--time-limit", type=float, default=20.0, help="ilp solver time limit, seconds")
    ap.add_argument("--hardware", default="cpu-gloo", help="profile the default plan is compiled for and predictions use")
    ap.add_argument("--verify", action="store_true")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    import torch

    from moeplan.planner.pipeline.run import run_modes
    import moeplan

    runs, defaults = [], {}
    workload = f"{args.prompts}x{args.prompt_length}+{args.new_tokens}"
    with tempfile.TemporaryDirectory(prefix="moeplan-bench-") as scratch:
        scratch = Path(scratch)
        model_dir = build_named_model(args.model, scratch) if args.model in ("gqa", "mla") else Path(args.model)
        corpus = model_dir if (model_dir / "corpus_train.txt").is_file() else CORPUS
        trace = Path(args.trace) if args.trace else record(str(model_dir), corpus / "corpus_train.txt",
                                                          args.trace_tokens, scratch / "trace.npz")
        prompts_file = scratch / "prompts.txt"
        prompts_file.write_text("\n".join(held_out_prompts(corpus / "corpus_heldout.txt", args.prompts,
                                                           args.prompt_length)) + "\n")
        policies = ("contiguous",) + tuple(p for p in args.policies if p != "contiguous")
        gpus = torch.cuda.device_count()
        cost = {"hardware": args.hardware, "workload": workload}
        for ranks in args.ranks:
            nodes, per_node = TOPOLOGIES[ranks]
            bundles, priors = {}, {}
            for policy in policies + ("default",):
                out = scratch / f"bundle-{ranks}-{policy}"
                plan = moeplan.compile(model_dir, trace, out, nodes=nodes, gpus_per_node=per_node,
                                       policy="auto" if policy == "default" else policy, time_limit=args.time_limit,
                                       mode="auto" if policy == "default" else "standard", **cost).plan.to_dict()
                bundles[policy] = (out, plan)
                priors[policy] = plan["predicted"]["cost"]["modes"]
            if gpus and gpus < ranks:
                print(f"note: {ranks} ranks on {gpus} GPU(s) cannot use nccl; skipped", file=sys.stderr)
                continue
            sends_kv = any(kind == "kv" for kind, _ in bundles["contiguous"][1]["predicted"]["cost"].get("context", []))
            launches = [(policy, "auto") for policy in bundles] + [(p, "hidden") for p in bundles if sends_kv and p != "default"]
            reports = {launch: [] for launch in launches}
            for _ in range(args.repeats):
                for policy, context in launches:
                    out, plan = bundles[policy]
                    modes = (plan["communication"]["mode"],) if policy == "default" else MODES if context == "auto" else ("coherent",)
                    reports[(policy, context)].append(run_modes(str(out), ranks, str(prompts_file), args.new_tokens, modes,
                                                                args.verify, None, 900, context=context))
            for policy, context in launches:
                out, plan = bundles[policy]
                for mode in reports[(policy, context)][0]:
                    row = _row(ranks, plan["placement"]["policy"], mode, [r[mode] for r in reports[(policy, context)]],
                               priors[policy][mode] if context == "auto" else None, args.verify, gpus,
                               "kv" if sends_kv and context == "auto" else "hidden")
                    if policy == "default":
                        defaults[str(ranks)] = row | {"default_policy": plan["placement"]["policy"]}
                    else:
                        runs.append(row)
    for row in runs + list(defaults.values()):
        base = next(b for b in runs if b["ranks"] == row["ranks"] and b["placement"] == "contiguous" and b["mode"] == "standard")
        row["total_bytes_ratio"] = round(row["total_bytes_per_token"] / base["total_bytes_per_token"], 3)
        row["measured_ratio"] = round(row["tokens_per_second"] / base["tokens_per_second"], 3)
        row["predicted_ratio"] = round(base["predicted_seconds_per_token"] / row["predicted_seconds_per_token"], 3)
    _table(runs, defaults)
    if args.json:
        print(json.dumps({"runs": runs, "default": defaults, "repeats": args.repeats, "workload": workload,
                          "hardware": args.hardware, "model": args.model}, sort_keys=True))
    return 0


def _row(ranks: int, placement: str, mode: str, reports: list, prior: dict | None, verify: bool, gpus: int,
         context: str) -> dict:
    first = reports[0]
    tps = statistics.median(r["tokens_per_second"] for r in reports)
    row = {
        "ranks": ranks, "placement": placement, "mode": mode, "device": "cuda" if gpus else "cpu",
        "bytes_per_token": round(first["bytes_per_token"], 1),
        "messages_per_token": round(first["messages_per_token"], 3),
        "total_bytes_per_token": round(first["total_bytes_per_token"], 1),
        "predicted_total_bytes_per_token": round(first["predicted_total_bytes_per_token"], 1),
        "context": context if mode == "coherent" else None,
        "context_elements": first.get("context_elements", []),
        "prior_total_bytes_per_token": round(prior["total_bytes_per_token"], 1) if prior else None,
        "tokens_per_second": round(tps, 2),
        "tokens_per_second_runs": [round(r["tokens_per_second"], 2) for r in reports],
        "predicted_seconds_per_token": round(statistics.median(r["predicted_seconds_per_token"] for r in reports), 6),
        "prior_seconds_per_token": round(prior["seconds_per_token"], 6) if prior else None,
        "gpu_local_fraction": round(first["gpu_local_fraction"], 4),
        "bytes_match_prediction": all(r["bytes_match_prediction"] and r.get("context_matches_prediction", True)
                                      for r in reports),
    }
    if verify:
        row["verified"] = all(r["verified"] for r in reports)
    return row


def _table(runs: list, defaults: dict) -> None:
    print(f"{'ranks':>5} {'placement':>10} {'mode':>9} {'context':>7} {'a2a B/tok':>10} {'all B/tok':>10} {'pred B/tok':>10} "
          f"{'prior B/tok':>11} {'tok/s':>7} {'measured':>8} {'predicted':>9}")
    for label, r in [("", r) for r in runs] + [("default ", r) for r in defaults.values()]:
        prior = r["prior_total_bytes_per_token"]
        print(f"{r['ranks']:>5} {label + r['placement']:>10} {r['mode']:>9} {r['context'] or '-':>7} {r['bytes_per_token']:>10.0f} "
              f"{r['total_bytes_per_token']:>10.0f} {r['predicted_total_bytes_per_token']:>10.0f} "
              f"{'-' if prior is None else format(prior, '.0f'):>11} {r['tokens_per_second']:>7.1f} "
              f"{r['measured_ratio']:>8.2f} {r['predicted_ratio']:>9.2f}")


if __name__ == "__main__":
    sys.exit(main())
