"""`moeplan simulate plan.json --trace HELDOUT`: what a lambda plan costs on real routing.

The held-out trace is cut into batches of the plan's batch size (a trace shorter than one batch
is one batch scaled to that size); each batch's real per-expert loads run against the plan's
fixed memory and replicas (overflows invoke extra replicas, as the runtime would). Prints the
mean cost per batch, latency, throughput, SLO misses and the per-layer sizing; `--json` prints
one JSON line. `--prompt-tokens P --new-tokens N` instead prices one generation request of a lambda
plan, the figures a served response's X-Moeplan-* headers state.
"""
from __future__ import annotations

import json

import click

from moeplan.core import cli_types as T
from moeplan.core.errors import UserError
from moeplan.core.plan_sections import Predicted


def _simulate_request(plan_path, prompt_tokens: int, new_tokens: int, as_json: bool) -> None:
    """One generation request priced by the plan's request cost model (runtime/lambda_/
    request_cost.py, the code the bundle's front function runs on the same spec)."""
    from moeplan.runtime.lambda_.charges import breakdown_text
    from moeplan.runtime.lambda_.request_cost import request_cost
    from moeplan.planner.pipeline.lambda_ import read_plan

    plan = read_plan(plan_path)[0]
    spec = plan.predicted.request_cost if isinstance(plan.predicted, Predicted) else None
    if not isinstance(spec, dict):
        raise UserError(f"plan file '{plan_path}' has no request cost model (predicted.request_cost); regenerate it with this moeplan")
    if prompt_tokens < 1:
        raise UserError(f"--prompt-tokens must be at least 1 with --new-tokens, got {prompt_tokens}")
    try:
        cost = request_cost(spec, prompt_tokens, new_tokens)
        old = request_cost(spec, prompt_tokens, new_tokens, mode="recompute")
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as exc:
        raise UserError(f"plan file '{plan_path}' has a malformed request cost model ({exc.__class__.__name__}: {exc}); regenerate it") from None
    summary = {"prompt_tokens": prompt_tokens, "new_tokens": new_tokens, "billed_gb_s": cost["lambda_gb_s"],
               "request_charges_usd": cost["request_charges_usd"], "predicted_cost_usd": cost["usd"]["total"],
               "latency_s": cost["latency_s"], "detail": cost,
               "recompute": {"billed_gb_s": old["lambda_gb_s"], "predicted_cost_usd": old["usd"]["total"],
                             "latency_s": old["latency_s"]}}
    if as_json:
        click.echo(json.dumps(summary, sort_keys=True))
        return
    u = cost["usd"]
    click.echo(f"one request, {prompt_tokens} prompt + {new_tokens} new tokens, one execution reusing the prefix's K/V:")
    click.echo(f"  billed {cost['lambda_gb_s']:.6f} GB-s of Lambda ({cost['front_gb_s']:.6f} of them the front function "
               f"waiting), {cost['lambda_invocations']:.1f} invocations, {cost['s3_puts']:.1f} S3 PUTs, {cost['s3_gets']:.1f} GETs")
    click.echo(f"  ${u['total']:.8f}: {breakdown_text(u)}; latency {cost['latency_s']:.2f} s")
    click.echo(f"  recomputing the prefix for every token instead: ${old['usd']['total']:.8f} "
               f"({old['usd']['total'] / u['total']:.2f}x), {old['lambda_gb_s']:.6f} GB-s")


@click.command("simulate", short_help="Replay a lambda or offload plan on a held-out trace (cost, latency, hit ratios), or price one Lambda request.")
@click.argument("plan_path", metavar="PLAN")
@click.option("--trace", "trace_path", default=None, help="held-out routing trace (.npz) of the planned model")
@click.option("--json", "as_json", is_flag=True, help="print a JSON summary as the last line")
@click.option("--prompt-tokens", type=int, default=0, show_default=True,
              help="offload plans: the first P tokens of each sequence are one prefill step; lambda plans with "
                   "--new-tokens: the priced request's prompt")
@click.option("--new-tokens", type=T.POSITIVE_INT, default=None,
              help="lambda plans: price one generation request (--prompt-tokens P, N new tokens) as each served "
                   "response's X-Moeplan-* headers do; no trace needed")
def simulate(plan_path, trace_path, as_json, prompt_tokens, new_tokens):
    """Billed cost and latency of a lambda PLAN on the real loads of a held-out trace, or of one
    generation request (--new-tokens); for an offload PLAN, every cache policy's hit ratio and the
    prefetch results on the trace."""
    from moeplan.planner.commands.simulate_offload import is_offload_plan, simulate_offload

    if new_tokens is not None:
        return _simulate_request(plan_path, prompt_tokens, new_tokens, as_json)
    if trace_path is None:
        raise UserError("give --trace HELDOUT.npz (or, for a lambda plan, --prompt-tokens P --new-tokens N)")
    if is_offload_plan(plan_path):
        return simulate_offload(plan_path, trace_path, as_json, prompt_tokens)
    from moeplan.passes.analysis.trace.format import load_trace
    from moeplan.passes.optimize.serverless.sizing_pipeline import real_batches
    from moeplan.passes.optimize.serverless.sim import simulate as run
    from moeplan.passes.optimize.serverless.billing import METHOD_NAMES
    from moeplan.planner.pipeline.lambda_ import layer_lines, read_plan

    import numpy as np

    plan, facts, layers, batch_tokens = read_plan(plan_path)
    trace = load_trace(trace_path)
    if trace.num_layers != len(layers):
        raise UserError(f"trace '{trace_path}' has {trace.num_layers} MoE layers but the plan has {len(layers)}; was it traced from another model?")
    experts = len(layers[0].experts) if layers else 0
    if trace.num_experts > experts:
        raise UserError(f"trace '{trace_path}' has {trace.num_experts} experts per layer but the plan sizes {experts}")
    batches = real_batches(trace, np.arange(trace.num_tokens), batch_tokens)
    if not batches:
        raise UserError(f"trace '{trace_path}' has no tokens")
    sims = [run(facts, layers, loads, batch_tokens) for _, loads in batches]
    slo = plan.inputs.get("slo_s")
    if slo is not None and (isinstance(slo, bool) or not isinstance(slo, (int, float)) or not 0 < slo < float("inf")):
        raise UserError(f"plan file '{plan_path}': inputs.slo_s must be a positive number of seconds, got {slo!r}; regenerate it")
    summary = {
        "batches": len(sims),
        "batch_tokens": batch_tokens,
        "scaled_partial_batch": trace.num_tokens < batch_tokens,
        "moe_cost_per_batch_usd": float(np.mean([s.moe_cost for s in sims])),
        "total_cost_per_batch_usd": float(np.mean([s.total_cost for s in sims])),
        "latency_s": float(np.mean([s.latency for s in sims])),
        "max_latency_s": float(max(s.latency for s in sims)),
        "throughput_tokens_per_s": float(np.mean([s.throughput for s in sims])),
        "slo_s": slo,
        "slo_violations": int(sum(s.latency > slo + 1e-9 for s in sims)) if slo else 0,
        "overflows": int(sum(len(s.overflows) for s in sims)),
        "methods": [METHOD_NAMES[d.method] for d in layers],
    }
    if as_json:
        click.echo(json.dumps(summary, sort_keys=True))
        return
    note = " (trace shorter than one batch: loads scaled)" if summary["scaled_partial_batch"] else ""
    click.echo(f"{len(sims)} batch(es) of {batch_tokens} tokens{note}")
    click.echo(f"cost per batch: ${summary['moe_cost_per_batch_usd']:.8f} MoE layers, "
               f"${summary['total_cost_per_batch_usd']:.8f} with non-MoE functions")
    click.echo(f"latency {summary['latency_s']:.3f} s (max {summary['max_latency_s']:.3f} s, SLO {slo} s, "
               f"{summary['slo_violations']} miss(es)), throughput {summary['throughput_tokens_per_s']:.1f} tokens/s, "
               f"{summary['overflows']} overflow invocation(s)")
    for line in layer_lines(layers):
        click.echo(line)
