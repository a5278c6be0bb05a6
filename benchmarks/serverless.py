"""Serverless MoE planning on the example model: our plan vs LambdaML vs a CPU cluster vs the oracle.

Run:  .venv/bin/python benchmarks/serverless.py [--trace build/demo/trace.npz] [--train-trace T] [--json]

Data. The routing trace of the example model's held-out text is cut by sequence into validation
batches (the first `--validation-fraction`, used by BO) and test batches of `--batch-tokens`
tokens (the rest). The key-value table comes from `--train-trace` when given (a trace of the
training text), otherwise from the first half of the held-out trace (then validation and test
share the second half). Every cost below is the mean over the test batches, simulated with the
*real* per-expert loads of each batch (Eqs. 3-11, `serverless/sim.py`).

Baselines (measured in the same run, same profile, same platform constants):
* LambdaML: every expert function at 3,008 MB, one replica, no prediction, non-pipelined S3
  scatter-gather (LambdaML's communication goes through storage); a "LambdaML (direct)" row
  shows the same sizing with direct invocation where the payload allows.
* oracle: our sizing (ODS) with the test batches' true mean loads instead of predictions.
* CPU cluster: the paper's 2 x 64-core machine priced like an AWS m6a.48xlarge
  (`cpu_cluster_price_per_hour` in the platform file), billed for the MoE layers' wall time at
  100% utilisation; the experts of a layer run concurrently, each on cores / E cores with
  perfect scaling of its one-thread time (both assumptions favour the cluster).
The SLO: by default the latency at which throughput is 18.76% below LambdaML's on the test
batches (the paper's largest throughput loss), i.e. LambdaML latency / (1 - 0.1876); `--slo`
overrides it. Our plan is sized for the mean predicted load of the test batches' token ids
(known before inference, as in the paper), after BO on the validation batches.

Generation (issue 30): the deployed bundle generates a request's tokens in one Step Functions
execution, reusing the prefix's K/V; the former way ran one execution per token over the whole
sequence. Both are priced by the plan's request cost model (runtime/lambda_/
request_cost.py, the figure each served response states) for a `--prompt-tokens` prompt and 8 and
64 new tokens, per generated token, under the deployment's accounting (warm containers keep their
weights and K/V) and the paper's (every invocation downloads its weights; K/V read from S3 every
step). `--measure-local` also runs a compiled bundle both ways on the local cloud, each request
measured the second time it runs (warm containers, as the deployment's accounting assumes; billed
GB-s from the handlers' measured seconds on this machine; dollars with the Lambda request fees, the
functions' S3 requests and the EXPRESS executions' measured lengths, by the one billing rule of
runtime/lambda_/charges.py; no front function).

`--json` prints one JSON object on the last line with cost_reduction_vs_lambdaml,
throughput_change_vs_lambdaml, cost_over_oracle, cost_reduction_vs_cpu_cluster,
predictor_error {ours, lina, marginal} and more. Profiling timings on a shared CPU are noisy
(see passes/analysis/profile/operators.py); the profile is cached by model hash, so reruns reuse it.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
PAPER_THROUGHPUT_LOSS = 0.1876


def concat_traces(a, b):
    """One trace holding a's tokens then b's (sequence ids of b shifted past a's)."""
    from moeplan.passes.analysis.trace.format import make_trace

    def cat(x, y):
        return None if x is None or y is None else np.concatenate([x, y])

    seq_b = None if b.sequence is None else b.sequence + (0 if a.sequence is None else int(a.sequence.max()) + 1)
    return make_trace(np.concatenate([a.experts, b.experts]), np.concatenate([a.weights, b.weights]),
                      num_experts=max(a.num_experts, b.num_experts), token_ids=cat(a.token_ids, b.token_ids),
                      positions=cat(a.positions, b.positions), sequence=cat(a.sequence, seq_b),
                      attention_ids=cat(a.attention_ids, b.attention_ids))


def uniform_layers(facts, memory_mb, method, loads_like):
    from moeplan.passes.optimize.serverless.sizing import ExpertChoice, LayerDecision

    return [LayerDecision(method, 0, tuple(ExpertChoice(int(memory_mb), 1, 0) for _ in range(loads_like.shape[1])))
            for _ in facts.layers]


def mean_sim(facts, layers, batches, batch_tokens):
    from moeplan.passes.optimize.serverless.sim import simulate

    sims = [simulate(facts, layers, real, batch_tokens) for _, real in batches]
    return {"moe_cost": float(np.mean([s.moe_cost for s in sims])),
            "total_cost": float(np.mean([s.total_cost for s in sims])),
            "latency": float(np.mean([s.latency for s in sims])),
            "max_latency": float(max(s.latency for s in sims)),
            "throughput": float(np.mean([s.throughput for s in sims])),
            "overflows": int(sum(len(s.overflows) for s in sims))}


def cpu_cluster(facts, batches, batch_tokens):
    """MoE-layer cost and end-to-end throughput on the CPU cluster (see module docstring)."""
    from moeplan.passes.optimize.serverless import billing as sc

    p = facts.platform
    costs, tputs = [], []
    for _, real in batches:
        moe_s = 0.0
        for e, lf in enumerate(facts.layers):
            cores = p.cpu_cluster_cores / max(lf.num_experts, 1)
            one = np.array([float(lf.u(p.mb_per_vcpu, max(d, 1))) * d for d in real[e]])  # one vCPU
            moe_s += float(one.max()) / cores
        dense = sc.dense_times(facts, batch_tokens)
        dense_s = (sum(dense["non_moe"]) + facts.head_s_per_token * batch_tokens + dense["tail"]) \
            * (p.dense_function_memory_mb / p.mb_per_vcpu) / p.cpu_cluster_cores
        costs.append(p.cpu_cluster_price_per_hour / 3600 * moe_s)
        tputs.append(batch_tokens / (moe_s + dense_s))
    return {"moe_cost": float(np.mean(costs)), "throughput": float(np.mean(tputs))}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=str(ROOT / "examples" / "tiny_moe"))
    ap.add_argument("--trace", default=str(ROOT / "build" / "demo" / "trace.npz"), help="held-out routing trace")
    ap.add_argument("--train-trace", default=None, help="trace of other text for the key-value table")
    ap.add_argument("--batch-tokens", type=int, default=10240)
    ap.add_argument("--validation-fraction", type=float, default=0.25)
    ap.add_argument("--slo", type=float, default=None, help="latency limit, s (default: see docstring)")
    ap.add_argument("--platform", default=None, help="YAML platform overrides")
    ap.add_argument("--bo-iterations", type=int, default=6)
    ap.add_argument("--bo-q", type=int, default=64)
    ap.add_argument("--profile-budget", type=float, default=5.0)
    ap.add_argument("--cache-dir", default=str(ROOT / "build" / "cache"))
    ap.add_argument("--monolithic-time-limit", type=float, default=30.0)
    ap.add_argument("--tight-factor", type=float, default=1.15,
                    help="second scenario: SLO = this x the fastest latency of the slowest test batch (0 = skip)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompt-tokens", type=int, default=32, help="generation: prompt length of the priced requests")
    ap.add_argument("--new-tokens", type=int, nargs="+", default=[8, 64], help="generation: tokens generated per request")
    ap.add_argument("--measure-local", action="store_true",
                    help="generation: also run a compiled bundle both ways on the local cloud (minutes)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    from moeplan.passes.analysis import popularity as pop
    from moeplan.passes.analysis.profile.operators import profile_model
    from moeplan.passes.analysis.serverless_facts import build_facts
    from moeplan.passes.analysis.trace.format import load_trace
    from moeplan.passes.optimize.serverless import billing as sc
    from moeplan.passes.optimize.serverless import sizing
    from moeplan.passes.optimize.serverless.bo_refine import BOOptions
    from moeplan.passes.optimize.serverless.sizing_pipeline import (SizingOptions, plan_serverless, predicted_loads,
                                                         real_batches, size_for, split_by_sequence)
    from moeplan.core.errors import UserError
    from moeplan.passes.importers import load_model
    from moeplan.core.platforms import load_platform

    log = (lambda *a: None) if args.json else (lambda *a: print(*a, file=sys.stderr))
    B = args.batch_tokens
    held = load_trace(args.trace)
    if args.train_trace:
        train = load_trace(args.train_trace)
        trace = concat_traces(train, held)
        n_train = train.num_tokens
        h_val, h_test = split_by_sequence(held, 1 - args.validation_fraction)
        table_rows, val_rows, test_rows = np.arange(n_train), n_train + h_val, n_train + h_test
    else:
        trace = held
        first, second = split_by_sequence(held, 0.5)
        sub = held.select(second)
        v, t = split_by_sequence(sub, 1 - args.validation_fraction)
        table_rows, val_rows, test_rows = first, second[v], second[t]
    test = real_batches(trace, test_rows, B)
    if not test:
        raise SystemExit("no test tokens: trace more text")
    log(f"table {len(table_rows)} tokens, validation {len(val_rows)}, test {len(test_rows)} "
        f"({len(test)} batch(es) of {B}{', scaled' if len(test_rows) < B else ''})")

    t0 = time.perf_counter()
    loaded = load_model(args.model)
    prof = profile_model(loaded.ir, loaded.module, budget_s=args.profile_budget, cache_dir=args.cache_dir, seed=args.seed)
    facts = build_facts(loaded.ir, prof, load_platform(args.platform))
    profile_wall = time.perf_counter() - t0
    log(f"profile: {'cached, ' if prof.cached else ''}measured in {prof.seconds_spent:.1f} s, "
        f"time RMSLE {prof.time_rmsle:.3f}, memory RMSLE {prof.memory_rmsle:.3f}")
    real_mean = np.rint(np.mean([l for _, l in test], axis=0)).astype(np.int64)

    # baselines that need no planning
    lambdaml = mean_sim(facts, uniform_layers(facts, 3008, sc.S3, real_mean), test, B)
    direct_ok = all(bool(sc.payload_ok(facts.platform, lf, int(l[e].max()))) for _, l in test for e, lf in enumerate(facts.layers))
    lambdaml_direct = mean_sim(facts, uniform_layers(facts, 3008, sc.DIRECT, real_mean), test, B) if direct_ok else None
    cpu = cpu_cluster(facts, test, B)
    slo = args.slo or lambdaml["latency"] / (1 - PAPER_THROUGHPUT_LOSS)
    log(f"SLO {slo:.3f} s (LambdaML latency {lambdaml['latency']:.3f} s)")

    opts = SizingOptions()
    bo = BOOptions(q=args.bo_q, max_iterations=args.bo_iterations, seed=args.seed) if args.bo_iterations > 0 else None
    request_rows = [r for r, _ in test]
    rows = {}
    try:
        t1 = time.perf_counter()
        ours = plan_serverless(facts, trace, slo, batch_tokens=B, bo_options=bo, table_rows=table_rows,
                               validation_rows=val_rows, request_batches=request_rows)
        plan_wall = time.perf_counter() - t1
        rows["ours"] = mean_sim(facts, ours.result.layers, test, B)
        noBO = plan_serverless(facts, trace, slo, batch_tokens=B, table_rows=table_rows, validation_rows=val_rows,
                               request_batches=request_rows) if bo else ours
        rows["ours_no_bo"] = mean_sim(facts, noBO.result.layers, test, B)
        oracle = size_for(facts, real_mean, slo, B, opts)
        rows["oracle"] = mean_sim(facts, oracle.layers, test, B)
    except UserError as exc:
        raise SystemExit(f"error: {exc}") from None

    # predictor comparison on the test batches (errors) and what each predictor's plan costs
    table = pop.CountTable.from_trace(trace.select(table_rows))
    predictors = {"ours": ours.predictor, "lina": pop.make_predictor("lina", table, assignment="expected"),
                  "lina_map": pop.make_predictor("lina", table, assignment="map"),
                  "ours_map": pop.make_predictor("bayes", table, assignment="map", **ours.predictor_options),
                  "ours_paper_weighting": pop.make_predictor("bayes", table, attention_weighting=True, **ours.predictor_options),
                  "marginal": pop.make_predictor("marginal", table)}
    pred_err, pred_cost = {}, {}
    for name, pr in predictors.items():
        preds = [pr.predict_loads(trace.token_ids[r], trace.positions[r]) * (B / len(r)) for r, _ in test]
        pred_err[name] = pop.load_error(preds, [l for _, l in test])
        if name in ("lina", "marginal"):
            pl = predicted_loads(pr, trace, test, B)
            pred_cost[name] = mean_sim(facts, size_for(facts, pl, slo, B, opts).layers, test, B)["moe_cost"]

    # ODS vs one monolithic MILP on the same predicted loads
    t2 = time.perf_counter()
    ods_res = size_for(facts, ours.sizing_loads, slo, B, opts)
    ods_s = time.perf_counter() - t2
    t3 = time.perf_counter()
    mono = sizing.solve_monolithic(facts, ours.sizing_loads, slo, batch_tokens=B, time_limit_s=args.monolithic_time_limit)
    mono_s = time.perf_counter() - t3
    exact = sizing.solve_monolithic(facts, ours.sizing_loads, slo, batch_tokens=B, formulation="frontier")

    # a tight-SLO scenario, where the predicted loads decide memory and replicas
    tight = None
    if args.tight_factor > 0:
        fastest = max(sizing.fastest_latency(facts, real, opts.methods, opts.betas, B) for _, real in test)
        tslo = fastest * args.tight_factor
        tight = {"slo_s": tslo}
        sized = {"oracle": real_mean, "ours": predicted_loads(ours.predictor, trace, test, B),
                 "ours_busiest_batch": predicted_loads(ours.predictor, trace, test, B, statistic="max"),
                 "oracle_busiest_batch": np.max([l for _, l in test], axis=0),
                 "lina": predicted_loads(predictors["lina"], trace, test, B),
                 "marginal": predicted_loads(predictors["marginal"], trace, test, B)}
        for name, loads in sized.items():
            try:
                sim = mean_sim(facts, size_for(facts, loads, tslo, B, opts).layers, test, B)
                tight[name] = {"moe_cost": sim["moe_cost"], "max_latency": sim["max_latency"],
                               "slo_met": sim["max_latency"] <= tslo + 1e-9, "overflows": sim["overflows"]}
            except UserError as exc:
                tight[name] = {"error": str(exc)}

    o, ml = rows["ours"], lambdaml
    result = {
        "cost_reduction_vs_lambdaml": 1 - o["moe_cost"] / ml["moe_cost"],
        "throughput_change_vs_lambdaml": o["throughput"] / ml["throughput"] - 1,
        "cost_over_oracle": o["moe_cost"] / rows["oracle"]["moe_cost"],
        "cost_reduction_vs_cpu_cluster": 1 - o["moe_cost"] / cpu["moe_cost"],
        "predictor_error": {"ours": pred_err["ours"], "lina": pred_err["lina"], "marginal": pred_err["marginal"],
                            "ours_map": pred_err["ours_map"], "lina_map": pred_err["lina_map"],
                            "ours_paper_attention_weighting": pred_err["ours_paper_weighting"]},
        "cost_per_batch_usd": {"ours": o["moe_cost"], "ours_no_bo": rows["ours_no_bo"]["moe_cost"],
                               "oracle": rows["oracle"]["moe_cost"], "lambdaml": ml["moe_cost"],
                               "lambdaml_direct": lambdaml_direct["moe_cost"] if lambdaml_direct else None,
                               "cpu_cluster": cpu["moe_cost"], "sized_with_lina": pred_cost["lina"],
                               "sized_with_marginal": pred_cost["marginal"]},
        "throughput_tokens_per_s": {"ours": o["throughput"], "oracle": rows["oracle"]["throughput"],
                                    "lambdaml": ml["throughput"], "cpu_cluster": cpu["throughput"]},
        "slo_s": slo, "ours_max_latency_s": o["max_latency"], "ours_overflow_invocations": o["overflows"],
        "methods": [sc.METHOD_NAMES[d.method] for d in ours.result.layers],
        "predictor_options": ours.predictor_options,
        "predictor_selection_validation_error": [[o, e] for o, e in ours.predictor_selection],
        "ods_vs_monolithic": {"ods_cost": ods_res.cost, "ods_seconds": ods_s, "monolithic_cost": mono.cost,
                              "monolithic_status": mono.solves[-1]["status"], "monolithic_gap": mono.solves[-1]["gap"],
                              "monolithic_seconds": mono_s, "exact_optimum": exact.cost},
        "bo": {"iterations": ours.bo["iterations"], "baseline_cost": ours.bo["baseline_cost"],
               "best_cost": ours.bo["best_cost"], "seconds": ours.bo["seconds"]} if ours.bo else None,
        "seconds": {"profile_measure": prof.seconds_spent, "profile_cached": prof.cached, "load_and_profile": profile_wall,
                    "prediction": ours.timings.get("prediction_s"), "sizing": ours.timings.get("sizing_s"),
                    "bo": ours.timings.get("bo_s"), "plan_total_with_bo": plan_wall,
                    "profile_prediction_sizing": prof.seconds_spent + ours.timings.get("prediction_s", 0) + ours.timings.get("sizing_s", 0)},
        "test_batches": len(test), "batch_tokens": B, "tight_slo": tight,
        "profile_rmsle": {"time": prof.time_rmsle, "memory": prof.memory_rmsle,
                          "time_by_threads": {str(k): v for k, v in prof.time_rmsle_by_threads.items()},
                          "load_average_when_profiled": prof.load_average},
    }
    result["generation"] = generation(args, slo, log)
    print_table(result, lambdaml, lambdaml_direct, rows, cpu)
    print_generation(result["generation"])
    if args.json:
        print(json.dumps(_finite(result), sort_keys=True))


def lambda_plan(args, slo: float, out=None):
    """The lambda target's plan (and bundle, with `out`) for the benchmark's model, trace and SLO."""
    from moeplan.planner.pipeline import flags
    from moeplan.planner.pipeline.targets import compile_target, plan_target
    from moeplan.core.plan import Plan

    values = flags.resolve({"slo": slo, "platform": args.platform, "batch_tokens": args.batch_tokens, "bo_q": args.bo_q,
                            "profile_budget": args.profile_budget, "cache_dir": args.cache_dir, "seed": args.seed,
                            "time_limit": 60.0})
    if out is None:
        outcome = plan_target("lambda", args.model, args.trace, None, values, quiet=True)
    else:
        outcome = compile_target("lambda", args.model, args.trace, str(out), values, quiet=True)
    return Plan.from_json(outcome.plan.to_json())  # as plan.json holds it (8 significant digits)


def generation(args, slo: float, log) -> dict:
    """Per generated token: K/V reuse (one execution) vs recomputation (one execution per token)."""
    from moeplan.runtime.lambda_.request_cost import request_cost

    plan = lambda_plan(args, slo)
    spec, P = plan.predicted["request_cost"], args.prompt_tokens
    out = {"prompt_tokens": P, "methods": plan.communication["methods"], "predicted": [], "measured": []}
    for n in args.new_tokens:
        for accounting, kw in (("warm", {}), ("paper", {"weights_per_invocation": True})):
            kv = request_cost(spec, P, n, mode="kv", **kw)
            cold = request_cost(spec, P, n, mode="kv", cold_kv=True, **kw)
            old = request_cost(spec, P, n, mode="recompute", **kw)
            out["predicted"].append({
                "new_tokens": n, "accounting": accounting,
                "usd_per_token": {"recompute": old["usd"]["total"] / n, "kv": kv["usd"]["total"] / n,
                                  "kv_cold": cold["usd"]["total"] / n},
                "gb_s_per_token": {"recompute": old["lambda_gb_s"] / n, "kv": kv["lambda_gb_s"] / n,
                                   "kv_cold": cold["lambda_gb_s"] / n},
                "functions_gb_s_per_token": {"recompute": (old["lambda_gb_s"] - old["front_gb_s"]) / n,
                                             "kv": (kv["lambda_gb_s"] - kv["front_gb_s"]) / n},
                "request_charges_usd_per_token": {"recompute": old["request_charges_usd"] / n,
                                                  "kv": kv["request_charges_usd"] / n},
                "latency_s": {"recompute": old["latency_s"], "kv": kv["latency_s"], "kv_cold": cold["latency_s"]},
                "ratio_recompute_over_kv": old["usd"]["total"] / kv["usd"]["total"],
                "ratio_gb_s_recompute_over_kv": old["lambda_gb_s"] / kv["lambda_gb_s"]})
    if args.measure_local:
        out["measured"] = measure_local(args, slo, log)
    return out


def measure_local(args, slo: float, log) -> list:
    """A compiled bundle on the local cloud, both ways: measured billed GB-s and requests per token."""
    import tempfile

    from moeplan.planner.launch.lambda_run import run_lambda_bundle

    text = Path(args.model, "corpus_heldout.txt")
    prompt = (text.read_text()[:args.prompt_tokens] if text.is_file() else "x" * args.prompt_tokens)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        bundle = Path(tmp) / "bundle"
        lambda_plan(args, slo, out=bundle)
        for n in args.new_tokens:
            row = {"new_tokens": n}
            for mode in ("recompute", "kv"):
                log(f"local cloud: {n} tokens, {mode}")
                r = run_lambda_bundle(str(bundle), [prompt], n, verify=False, recompute=mode == "recompute", warm=True)
                req, usd = r["storage_requests"], r["billed_usd"]  # Lambda, S3 requests, EXPRESS executions
                row[mode] = {"billed_gb_s_per_token": r["billed_gb_s"] / n, "invocations_per_token": r["invocations"] / n,
                             "s3_requests_per_token": (req["functions_put"] + req["functions_get"]) / n,
                             "usd_per_token": usd / n, "wall_s": r["wall_s"], "texts": r["texts"]}
            row["same_text"] = row["kv"]["texts"] == row["recompute"]["texts"]
            row["ratio_gb_s_recompute_over_kv"] = row["recompute"]["billed_gb_s_per_token"] / row["kv"]["billed_gb_s_per_token"]
            row["ratio_usd_recompute_over_kv"] = row["recompute"]["usd_per_token"] / row["kv"]["usd_per_token"]
            rows.append(row)
    return rows


def print_generation(g: dict) -> None:
    print(f"generation, {g['prompt_tokens']}-token prompt, one sequence (methods {','.join(sorted(set(g['methods'])))}): "
          "predicted cost per generated token")
    print(f"{'new':>4} {'accounting':<10}{'recompute $':>14}{'kv $':>13}{'kv cold $':>13}{'ratio':>8}"
          f"{'GB-s rec.':>11}{'GB-s kv':>10}{'GB-s ratio':>11}{'latency rec./kv s':>20}")
    for r in g["predicted"]:
        u, b, lat = r["usd_per_token"], r["gb_s_per_token"], r["latency_s"]
        print(f"{r['new_tokens']:>4} {r['accounting']:<10}{u['recompute']:>14.3e}{u['kv']:>13.3e}{u['kv_cold']:>13.3e}"
              f"{r['ratio_recompute_over_kv']:>7.2f}x{b['recompute']:>11.4f}{b['kv']:>10.4f}"
              f"{r['ratio_gb_s_recompute_over_kv']:>10.2f}x{lat['recompute']:>10.2f}/{lat['kv']:.2f}")
    for r in g["predicted"]:
        if r["accounting"] == "warm":
            f = r["functions_gb_s_per_token"]
            print(f"predicted, {r['new_tokens']} tokens, without the front function: GB-s per token {f['recompute']:.4f} "
                  f"(recompute) vs {f['kv']:.4f} (kv), {f['recompute'] / f['kv']:.2f}x")
    for r in g["measured"]:
        rc, kv = r["recompute"], r["kv"]
        print(f"measured on the local cloud, {r['new_tokens']} tokens: billed GB-s per token {rc['billed_gb_s_per_token']:.4f} "
              f"(recompute) vs {kv['billed_gb_s_per_token']:.4f} (kv), {r['ratio_gb_s_recompute_over_kv']:.2f}x; $ per token "
              f"{rc['usd_per_token']:.3e} vs {kv['usd_per_token']:.3e}, {r['ratio_usd_recompute_over_kv']:.2f}x; invocations "
              f"{rc['invocations_per_token']:.1f} vs {kv['invocations_per_token']:.1f}; same text: {r['same_text']}")


def _finite(v):
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, dict):
        return {k: _finite(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_finite(x) for x in v]
    return v


def print_table(r, lambdaml, lambdaml_direct, rows, cpu):
    ml = lambdaml["moe_cost"]
    print(f"serverless MoE planning, {r['test_batches']} test batch(es) of {r['batch_tokens']} tokens, SLO {r['slo_s']:.3f} s")
    print(f"{'deployment':<28}{'MoE cost/batch $':>18}{'vs LambdaML':>13}{'tokens/s':>11}")
    table = [("ours (pred + BO + ODS)", rows["ours"]), ("ours without BO", rows["ours_no_bo"]),
             ("oracle (true loads)", rows["oracle"]), ("LambdaML (3008 MB, S3)", lambdaml)]
    if lambdaml_direct:
        table.append(("LambdaML (3008 MB, direct)", lambdaml_direct))
    table.append(("CPU cluster", cpu))
    for name, row in table:
        print(f"{name:<28}{row['moe_cost']:>18.8f}{row['moe_cost'] / ml:>12.3f}x{row['throughput']:>11.1f}")
    print(f"cost reduction vs LambdaML {r['cost_reduction_vs_lambdaml']:.2%} (target >= 43.41%), throughput change "
          f"{r['throughput_change_vs_lambdaml']:+.2%} (target >= -18.76%), cost over oracle {r['cost_over_oracle']:.3f} "
          f"(target <= 1.10), vs CPU cluster {r['cost_reduction_vs_cpu_cluster']:.2%}")
    pe = r["predictor_error"]
    print("predictor error (mean |predicted - real| tokens per expert per batch): "
          + ", ".join(f"{k} {v:.1f}" for k, v in pe.items()) + f"; ours = {r['predictor_options']} (chosen on validation)")
    m = r["ods_vs_monolithic"]
    print(f"ODS ${m['ods_cost']:.8f} in {m['ods_seconds']:.1f} s; monolithic per-pair MILP ${m['monolithic_cost']:.8f} "
          f"({m['monolithic_status']}, gap {m['monolithic_gap']:.2%}) in {m['monolithic_seconds']:.1f} s; exact optimum ${m['exact_optimum']:.8f}")
    if r["bo"]:
        print(f"BO: {r['bo']['iterations']} iterations in {r['bo']['seconds']:.1f} s, validation cost "
              f"${r['bo']['baseline_cost']:.8f} -> ${r['bo']['best_cost']:.8f}")
    t = r.get("tight_slo")
    if t:
        print(f"tight SLO {t['slo_s']:.3f} s (fastest plan of the slowest test batch x factor): " + "; ".join(
            f"{k} " + (f"${v['moe_cost']:.8f}, max latency {v['max_latency']:.3f} s{'' if v['slo_met'] else ' (SLO MISSED)'}"
                       if "moe_cost" in v else v["error"]) for k, v in t.items() if k != "slo_s"))
    pr = r["profile_rmsle"]
    print(f"profile RMSLE: time {pr['time']:.3f} (by threads {pr['time_by_threads']}), memory {pr['memory']:.4f}; "
          f"load average {pr['load_average_when_profiled']} when profiled")
    s = r["seconds"]
    print(f"profile (measurement) {s['profile_measure']:.1f} s{' (cached)' if s['profile_cached'] else ''} + prediction "
          f"{s['prediction']:.1f} s + sizing {s['sizing']:.1f} s = {s['profile_prediction_sizing']:.1f} s (target < 60 s)")


if __name__ == "__main__":
    main()
