"""Dense-stage partitioning (MOPAR's HyPAD) vs one function per dense stage vs a single function.

Run:  .venv/bin/python benchmarks/partition.py [--model examples/tiny_moe] [--batch-tokens 10240] [--json]

Cost per request (one batch of `--batch-tokens` tokens through every dense stage; MoE layers are
priced by the sizing benchmark, not here), as in MOPAR's Table III, from the cost model of
`passes/optimize/serverless/partition.py` with time and memory from the profile's XGBoost predictors
(profile cached under build/cache). Rows, all in the same run:
* single (MOPAR's Unsplit): one function with every dense weight, sized for its hungriest unit;
* single @ 3,008 MB: the same function at the size the serverless planner gives its non-MoE
  functions (`dense_function_memory_mb`, the paper's LambdaML size);
* per stage: one function per dense stage (each router with its norm), each at its own minimum;
* HyPAD: merge (5%) -> DP -> parallelism search under the single function's latency.
Each for the platform's 14 memory options and for Lambda's 1-MB sizes (MOPAR sizes per MB).
Also per grid: compute_floor_usd, the least cost of ANY partition (`partition.compute_floor`), and
max_possible_ratio_vs_single = single / floor, the most any partitioner could reach (below 2.58,
the target is out of reach under Lambda billing); mopar_accounting: single, HyPAD and their ratio
when memory is the largest unit's without the runtime and time ignores memory (MOPAR's model).
`--json` prints one JSON object on the last line: rows, ratio_vs_single, ratio_vs_single_3008,
ratio_vs_per_stage, compute_floor_usd, max_possible_ratio_vs_single, mopar_accounting (per memory
grid under `ratios`; the top-level keys are for the first grid the model fits), target_ratio 2.58
and target_met (vs single).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TARGET = 2.58


def per_stage_groups(units) -> list:
    """One group per IR dense stage; a router joins the stage before it (its norm)."""
    groups = []
    for k, u in enumerate(units):
        if u.names[0].endswith(".router") and groups:
            groups[-1].append(k)
        else:
            groups.append([k])
    return groups


def main(argv=None) -> int:
    from moeplan.passes.analysis.profile.operators import profile_model
    from moeplan.passes.optimize.serverless import partition as P
    from moeplan.passes.importers import load_model
    from moeplan.core.errors import UserError
    from moeplan.core.platforms import load_platform

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=str(ROOT / "examples" / "tiny_moe"))
    ap.add_argument("--batch-tokens", type=int, default=10240)
    ap.add_argument("--platform", default=None, help="YAML platform overrides")
    ap.add_argument("--profile-budget", type=float, default=5.0)
    ap.add_argument("--cache-dir", default=str(ROOT / "build" / "cache"))
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    platform = load_platform(args.platform)
    loaded = load_model(args.model)
    prof = profile_model(loaded.ir, loaded.module if loaded.has_weights else None, budget_s=args.profile_budget,
                         cache_dir=args.cache_dir, onnx_path=loaded.onnx_path)
    tokens = args.batch_tokens
    units = P.units_from_profile(loaded.ir, prof, tokens, loaded.module if loaded.has_weights else None)
    everything = [list(range(len(units)))]
    floor = P.compute_floor(units, platform, tokens)
    rows, ratios = [], {}
    for grid, options in (("14 options", None), ("1 MB steps", P.fine_memory_options(platform))):
        try:
            single = P.evaluate(units, platform, tokens, everything, options)
            big = P.evaluate(units, platform, tokens, everything, options, memory_mb=int(platform.dense_function_memory_mb))
            per = P.evaluate(units, platform, tokens, per_stage_groups(units), options)
            ours = P.hypad(units, platform, tokens, memory_options=options)
            mopar_single = P.evaluate(units, platform, tokens, everything, options, accounting="mopar")
            mopar_ours = P.hypad(units, platform, tokens, memory_options=options, accounting="mopar")
        except UserError as exc:  # e.g. the single function does not fit the largest option
            print(f"{grid}: {exc}", file=sys.stderr)
            continue
        for name, r in (("single", single), ("single @ 3008 MB", big), ("per stage", per), ("HyPAD", ours)):
            rows.append({"memory_grid": grid, "scheme": name, "cost_per_request_usd": r.cost_per_request_usd,
                         "cost_per_request_1e-6_usd": r.cost_per_request_usd * 1e6, "latency_s": r.latency_s,
                         "functions": len(r.slices), "invocations": sum(s.invocations for s in r.slices),
                         "memory_mb": sorted({s.memory_mb for s in r.slices}),
                         "billed_gb_s": sum(s.billed_gb_s for s in r.slices), "fits": r.fits})
        ratios[grid] = {"ratio_vs_single": single.cost_per_request_usd / ours.cost_per_request_usd,
                        "ratio_vs_single_3008": big.cost_per_request_usd / ours.cost_per_request_usd,
                        "ratio_vs_per_stage": per.cost_per_request_usd / ours.cost_per_request_usd,
                        "hypad_slices": [{"units": s.names, "memory_mb": s.memory_mb, "eta": s.eta} for s in ours.slices],
                        "hypad_latency_limit_s": ours.latency_limit_s, "merged_units": ours.merged_units,
                        "units": ours.units, "compute_floor_usd": floor,
                        "max_possible_ratio_vs_single": single.cost_per_request_usd / floor,
                        "mopar_accounting": {"single_usd": mopar_single.cost_per_request_usd,
                                             "hypad_usd": mopar_ours.cost_per_request_usd,
                                             "ratio": mopar_single.cost_per_request_usd / mopar_ours.cost_per_request_usd,
                                             "hypad_slices": len(mopar_ours.slices)}}
    headline = ratios[next(iter(ratios))] if ratios else {}
    result = {"model": loaded.ir.name, "batch_tokens": tokens, "rows": rows, "ratios": ratios,
              "headline_memory_grid": next(iter(ratios), None),
              "ratio_vs_single": headline.get("ratio_vs_single"),
              "ratio_vs_single_3008": headline.get("ratio_vs_single_3008"),
              "ratio_vs_per_stage": headline.get("ratio_vs_per_stage"),
              "compute_floor_usd": floor,
              "max_possible_ratio_vs_single": headline.get("max_possible_ratio_vs_single"),
              "mopar_accounting": headline.get("mopar_accounting"),
              "target_ratio": TARGET,
              "target_met": bool(headline) and headline["ratio_vs_single"] >= TARGET,
              "profile_cached": prof.cached}
    print(f"{loaded.ir.name}: dense stages, cost per request of {tokens} tokens (1e-6 $)", file=sys.stderr)
    print(f"{'memory grid':<12} {'scheme':<17} {'cost':>9} {'latency s':>10} {'functions':>9} {'invocations':>11}  memory MB",
          file=sys.stderr)
    for r in rows:
        print(f"{r['memory_grid']:<12} {r['scheme']:<17} {r['cost_per_request_1e-6_usd']:>9.2f} {r['latency_s']:>10.3f} "
              f"{r['functions']:>9} {r['invocations']:>11}  {r['memory_mb']}"
              + ("" if r["fits"] else "  (below its memory need: would fail)"), file=sys.stderr)
    for grid, r in ratios.items():
        print(f"{grid}: HyPAD is {r['ratio_vs_single']:.2f}x cheaper than the single function, "
              f"{r['ratio_vs_single_3008']:.2f}x than it at 3,008 MB, {r['ratio_vs_per_stage']:.2f}x than per stage "
              f"(target {TARGET}x vs single)", file=sys.stderr)
        m = r["mopar_accounting"]
        print(f"{grid}: no partition can cost less than {floor * 1e6:.2f}e-6 $ (compute floor), so at most "
              f"{r['max_possible_ratio_vs_single']:.2f}x vs single; under MOPAR's accounting single "
              f"{m['single_usd'] * 1e6:.2f} vs HyPAD {m['hypad_usd'] * 1e6:.2f} = {m['ratio']:.2f}x", file=sys.stderr)
    if args.json:
        print(json.dumps(result, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
