"""`moeplan simulate plan.json --trace HELDOUT` for an offload plan: every cache policy on the
held-out request stream from the plan's initial residents (demand mode), then the timed prefetch
modes under the plan's hardware timing, with host compute on a miss ("<mode>+host") where the
plan's clock has the host's rates, and the speculative prefetcher on a trace recorded with --speculate. `--json`: {"policies": {...}, "prefetch": {...}, ...}.
"""
from __future__ import annotations

import json
from pathlib import Path

import click

from moeplan.core.errors import UserError


def is_offload_plan(path) -> bool:
    """True when PLAN is a readable JSON object whose target is "offload"."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False  # the lambda reader reports unreadable plans
    return isinstance(data, dict) and data.get("target") == "offload"


def load_offload_plan(path) -> dict:
    """The offload plan's parts the simulator needs (capacity, residents, models, timing)."""
    import numpy as np

    from moeplan.runtime.offload.next_use import NextUseModel
    from moeplan.passes.optimize.offload.simulator import Timing

    data = json.loads(Path(path).read_text(encoding="utf-8"))
    try:
        c = data["communication"]
        E = int(data["model"]["ir"]["stages"][[s.get("type") for s in data["model"]["ir"]["stages"]].index("moe")]["num_experts"])
        return {
            "capacity": int(c["expert_cache"]), "eviction": c["eviction"], "prefetch": c["prefetch"],
            "resident": [int(l) * E + int(e) for l, e in data["placement"]["resident"]],
            "model": NextUseModel.from_dict(c["policy_model"]),
            "eamc": np.asarray(c["eamc"], dtype=np.int64).reshape(-1, len(c["policy_model"]["popularity"]), E),
            "timing": Timing.from_dict(c["timing"], c.get("host_resident")),
            "num_layers": len(c["policy_model"]["popularity"]), "num_experts": E,
            "speculation": data.get("inputs", {}).get("speculation"),
        }
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise UserError(f"offload plan '{path}' is incomplete ({type(exc).__name__}: {exc}); re-run 'moeplan plan --target offload'") from None


def simulate_offload(plan_path, trace_path, as_json: bool, prompt_tokens: int) -> None:
    from moeplan.passes.analysis.trace.format import load_trace, require_routing
    from dataclasses import replace

    from moeplan.passes.optimize.offload.evaluate import gap_to_belady, run_demand, run_variants
    from moeplan.passes.optimize.offload.stream import build_stream

    if prompt_tokens < 0:
        raise UserError(f"--prompt-tokens must be 0 or more, got {prompt_tokens}")
    plan = load_offload_plan(plan_path)
    trace = load_trace(trace_path)
    require_routing(trace, "simulating an expert cache (per-token expert requests)")
    if trace.num_layers != plan["num_layers"]:
        raise UserError(f"trace '{trace_path}' has {trace.num_layers} MoE layers but the plan has {plan['num_layers']}; "
                        "was it traced from another model?")
    if trace.num_experts > plan["num_experts"]:
        raise UserError(f"trace '{trace_path}' has {trace.num_experts} experts per layer but the plan's model has {plan['num_experts']}")
    if trace.num_tokens == 0:
        raise UserError(f"trace '{trace_path}' has no tokens")
    from moeplan.passes.analysis.trace.format import make_trace

    if trace.num_experts != plan["num_experts"]:  # keys are layer * E + expert with the model's E
        trace = make_trace(trace.experts, trace.weights, num_experts=plan["num_experts"], positions=trace.positions,
                           sequence=trace.sequence, speculation=trace.speculation, speculation_source=trace.speculation_source)
    stream = build_stream(trace, prompt_tokens)
    t = plan["timing"]
    demand = run_demand(stream, plan["capacity"], plan["resident"], plan["model"], expert_bytes=t.expert_bytes)
    # every prefetcher, and with host compute where the plan's clock has the host's rates; the
    # speculative one on a held-out trace recorded with --speculate (weighed by the plan's recall)
    timings = {False: replace(t, host_expert_s=0.0, host_row_s=0.0, host_overhead_s=0.0)}
    if t.host_compute:
        timings[True] = t
    speculation = plan["speculation"] if trace.speculation is not None else None
    if speculation is None and trace.speculation is not None:
        from moeplan.passes.optimize.offload.evaluate import speculation_settings

        speculation = speculation_settings(trace)
    prefetch = run_variants(stream, plan["capacity"], plan["resident"], plan["model"], plan["eamc"], timings, speculation)
    summary = {"policies": demand, "prefetch": prefetch, "expert_cache": plan["capacity"], "eviction": plan["eviction"],
               "planned_prefetch": plan["prefetch"], "requests": stream.num_requests, "forwards": stream.num_tokens,
               "belady_gap_points": gap_to_belady(demand)}
    if as_json:
        click.echo(json.dumps(summary, sort_keys=True))
        return
    click.echo(f"{stream.num_requests} expert requests over {stream.num_tokens} forward steps; cache {plan['capacity']} entries "
               f"(plan: eviction {plan['eviction']}, prefetch {plan['prefetch']})")
    click.echo("policy         hit ratio  loads      bytes moved")
    for name, r in demand.items():
        click.echo(f"{name:<13}  {r['hit_ratio']:>9.4f}  {r['loads']:>9}  {r['bytes_moved']:>14}")
    click.echo(f"moeplan is {summary['belady_gap_points']:.1f} points below Belady")
    click.echo("prefetch            resident at layer start  hit ratio  ms/token  bytes moved  on host")
    for name, r in prefetch.items():
        click.echo(f"{name:<18}  {r['resident_at_layer_start']:>23.4f}  {r['hit_ratio']:>9.4f}  "
                   f"{r['seconds_per_token'] * 1e3:>8.3f}  {r['bytes_moved']:>11}  {r.get('host_computed', 0):>8}")
