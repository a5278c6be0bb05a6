"""`moeplan plan MODEL --trace T --target lambda --slo SECONDS --out plan.json`: size a serverless deployment.

Steps: profile the model's operators on this machine (cached by model hash), predict per-expert
loads from the trace's token ids (Bayesian key-value table), optionally refine the table by BO
against the real loads of the trace's validation batches, size every expert function (MILP +
ODS), and write a deterministic lambda plan.json atomically. Prints cost per batch, throughput
and per-layer method, memory and replicas; `--json` prints the summary as one JSON line.
"""
from __future__ import annotations

import json
import time

import click

from moeplan.planner import cli_types as T
from moeplan.planner.errors import UserError


def _methods(text: str) -> tuple:
    from moeplan.passes.optimize.serverless import cost as sc

    out = []
    for part in text.split(","):
        name = part.strip()
        if name not in sc.METHOD_IDS:
            raise UserError(f"unknown method '{name}' in --methods; use any of {', '.join(sc.METHOD_IDS)}")
        out.append(sc.METHOD_IDS[name])
    return tuple(sorted(set(out)))


def _u_table(facts, batch_tokens) -> dict:
    lf = facts.layers[0]
    tokens = max(1, batch_tokens * lf.top_k // max(lf.num_experts, 1))
    return {str(int(m)): float(f"{float(lf.u(m, tokens)):.4g}") for m in facts.platform.memory_options_mb}


@click.command("plan")
@click.argument("model")
@click.option("--trace", "trace_path", required=True, help="routing trace (.npz) with token ids, recorded from MODEL")
@click.option("--target", type=click.Choice(["lambda"]), default="lambda", show_default=True)
@click.option("--slo", type=T.POSITIVE_FLOAT, required=True, help="end-to-end latency limit per batch, seconds")
@click.option("--out", required=True, type=click.Path(dir_okay=False), help="plan.json to write")
@click.option("--platform", "platform_file", default=None, help="YAML file overriding platform constants")
@click.option("--batch-tokens", type=T.POSITIVE_INT, default=10240, show_default=True, help="tokens per served batch")
@click.option("--methods", default="pipelined_s3,s3,direct", show_default=True, help="allowed scatter-gather methods")
@click.option("--validation-fraction", type=T.FRACTION, default=0.2, show_default=True, help="share of the trace held out for validation / BO")
@click.option("--size-for", type=click.Choice(["mean", "max"]), default="mean", show_default=True,
              help="size for the mean predicted load per batch, or per expert the busiest batch's")
@click.option("--bo-iterations", type=T.NON_NEGATIVE_INT, default=0, show_default=True, help="BO refinement iterations (0 = off)")
@click.option("--bo-q", type=T.POSITIVE_INT, default=64, show_default=True, help="key-value pairs adjusted per BO trial")
@click.option("--bo-storage", default=None, help="Optuna storage URL (e.g. sqlite:///bo.db) to share the study")
@click.option("--profile-budget", type=T.NON_NEGATIVE_FLOAT, default=5.0, show_default=True, help="seconds of optional profiling")
@click.option("--cache-dir", default=None, help="profile cache directory (default $MOEPLAN_CACHE_DIR, else ~/.cache/moeplan/profiles)")
@click.option("--no-cache", is_flag=True, help="profile again and do not write the cache")
@click.option("--time-limit", type=T.POSITIVE_FLOAT, default=10.0, show_default=True, help="time limit per MILP solve, seconds")
@click.option("--solver", type=click.Choice(["highs", "gurobi"]), default="highs", show_default=True)
@click.option("--seed", type=T.SEED, default=0, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="print a JSON summary as the last line")
@click.option("--quiet", is_flag=True, help="no progress output")
def plan(model, trace_path, target, slo, out, platform_file, batch_tokens, methods, validation_fraction, size_for, bo_iterations,
         bo_q, bo_storage, profile_budget, cache_dir, no_cache, time_limit, solver, seed, as_json, quiet):
    """Size the serverless functions of MODEL for --slo and write a lambda plan."""
    from moeplan.passes.analysis.profile.operators import DEFAULT_CACHE_DIR, profile_model, profile_record
    from moeplan.passes.analysis.serverless_facts import build_facts
    from moeplan.passes.analysis.trace.format import load_trace, trace_file_sha256
    from moeplan.passes.optimize.serverless.bo_refine import BOOptions
    from moeplan.passes.optimize.serverless.plan import SizingOptions, plan_serverless
    from moeplan.planner.atomic import write_text_atomic
    from moeplan.planner.compile_pipeline import check_trace_matches
    from moeplan.planner.importers import load_model
    from moeplan.planner.lambda_plan import build_plan, plan_json
    from moeplan.planner.platforms import load_platform
    from moeplan.passes.optimize.serverless.cost import METHOD_NAMES

    if batch_tokens <= 0:
        raise UserError(f"--batch-tokens must be positive, got {batch_tokens}")
    if not 0 < validation_fraction < 1:
        raise UserError(f"--validation-fraction must be between 0 and 1, got {validation_fraction}")
    if slo <= 0:
        raise UserError(f"--slo must be a positive number of seconds, got {slo:g}")
    say = (lambda msg: None) if quiet or as_json else (lambda msg: click.echo(msg, err=True))
    allowed = _methods(methods)
    platform = load_platform(platform_file)
    trace = load_trace(trace_path)
    loaded = load_model(model)
    ir = loaded.ir
    check_trace_matches(ir, trace, f"trace '{trace_path}'")
    t0 = time.perf_counter()
    say("profiling operators...")
    prof = profile_model(ir, loaded.module if loaded.has_weights else None, budget_s=profile_budget,
                         cache_dir=None if no_cache else (cache_dir or DEFAULT_CACHE_DIR), seed=seed, onnx_path=loaded.onnx_path)
    facts = build_facts(ir, prof, platform)
    profile_s = time.perf_counter() - t0
    say(f"profile {'(cached) ' if prof.cached else ''}ready: time RMSLE {prof.time_rmsle:.3f}, memory RMSLE {prof.memory_rmsle:.3f}")
    bo = BOOptions(q=bo_q, max_iterations=bo_iterations, seed=seed, storage=bo_storage) if bo_iterations > 0 else None
    outcome = plan_serverless(facts, trace, slo, batch_tokens=batch_tokens, validation_fraction=validation_fraction,
                              sizing_options=SizingOptions(methods=allowed, time_limit_s=time_limit, solver=solver),
                              bo_options=bo, size_for_statistic=size_for,
                              progress=lambda it, best: say(f"BO iteration {it}: best cost ${best:.8f}"))
    res = outcome.result
    sim = outcome.predicted_sim
    val_cost = sum(v.moe_cost for v in outcome.validation) / len(outcome.validation)
    val_lat = sum(v.latency for v in outcome.validation) / len(outcome.validation)
    predicted = {
        "batch_tokens": batch_tokens,
        "moe_cost_per_batch_usd": sim.moe_cost,
        "dense_cost_per_batch_usd": sim.dense_cost,
        "latency_s": sim.latency,
        "throughput_tokens_per_s": sim.throughput,
        "validation": {"batches": len(outcome.validation), "moe_cost_per_batch_usd": val_cost, "latency_s": val_lat,
                       "slo_violations": sum(v.latency > slo + 1e-9 for v in outcome.validation),
                       "overflows": sum(len(v.overflows) for v in outcome.validation)},
        "predictor_error": outcome.predictor_error,  # on the validation batches (also used to select ours)
        "predictor_options": outcome.predictor_options,
        "algorithm": res.algorithm,
        "solves": [{k: v for k, v in s.items() if k != "seconds"} for s in res.solves],
        "profile": {"time_rmsle": prof.time_rmsle, "memory_rmsle": prof.memory_rmsle, "measurements": len(prof.rows),
                    # U_j: per-token expert compute time at each memory option, layer 0, mean expert load
                    "expert_u_s_per_token": _u_table(facts, batch_tokens)},
    }
    if outcome.bo:
        predicted["bo"] = {"iterations": outcome.bo["iterations"], "baseline_cost": outcome.bo["baseline_cost"],
                           "best_cost": outcome.bo["best_cost"],
                           "history": [{k: v for k, v in h.items() if k != "seconds"} for h in outcome.bo["history"]]}
    inputs = {"trace_sha256": trace_file_sha256(trace_path), "slo_s": slo, "validation_fraction": validation_fraction,
              "methods": list(methods.split(",")), "size_for": size_for, "bo_iterations": bo_iterations, "bo_q": bo_q, "seed": seed,
              "profile_hash": prof.model_hash, "profile": profile_record(prof, ir)}
    the_plan = build_plan(ir, facts, res.layers, batch_tokens=batch_tokens, predicted=predicted, inputs=inputs)
    write_text_atomic(out, plan_json(the_plan), kind="plan")
    total_s = time.perf_counter() - t0
    summary = {"out": str(out), "moe_cost_per_batch_usd": sim.moe_cost, "latency_s": sim.latency,
               "throughput_tokens_per_s": sim.throughput, "algorithm": res.algorithm,
               "methods": [METHOD_NAMES[d.method] for d in res.layers], "predictor_error": outcome.predictor_error,
               "bo_iterations": outcome.bo["iterations"] if outcome.bo else 0,
               "seconds": {"profile": round(profile_s, 3), **outcome.timings, "total": round(total_s, 3)}}
    if as_json:
        click.echo(json.dumps(summary, sort_keys=True))
        return
    from moeplan.planner.commands.simulate import print_layers

    click.echo(f"wrote {out}: {res.algorithm}, ${sim.moe_cost:.8f} per {batch_tokens}-token batch (MoE layers), "
               f"latency {sim.latency:.3f} s (SLO {slo:g} s), throughput {sim.throughput:.1f} tokens/s")
    print_layers(res.layers)
    click.echo("predictor error (tokens per expert): " + ", ".join(f"{k} {v:.1f}" for k, v in outcome.predictor_error.items()))
    click.echo(f"planning took {total_s:.1f} s (profile {profile_s:.1f} s{', cached' if prof.cached else ''})")
