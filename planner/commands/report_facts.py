"""What `moeplan report` computes from a plan and routing traces, with the project's own functions,
for the figures the plan does not record (planner/report/sections.py draws them).

Traces are told apart by the plan's `inputs.trace_sha256`: the planning trace (the figures are then
the plan's own view) and at most one held-out trace (the plan re-scored on it; the figures use it
when the planning trace is not given). Shapes: L MoE layers, E experts, D devices.
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from moeplan.core.errors import UserError

PLACED_TARGETS = ("torchrun", "kubernetes", "sglang", "vllm", "trtllm")
CURVE_POINTS = 8


def sort_traces(plan: dict, paths: list) -> tuple:
    """((path, Trace) of the planning trace or None, (path, Trace) held-out or None)."""
    from moeplan.passes.analysis.trace.format import load_trace, trace_file_sha256

    planning, held_out = None, []
    for path in paths:
        trace = load_trace(path)
        if trace_file_sha256(path) == plan.get("inputs", {}).get("trace_sha256"):
            planning = (str(path), trace)
        else:
            held_out.append((str(path), trace))
    if len(held_out) > 1:
        raise UserError(f"--trace given {len(paths)} times: at most one held-out trace besides the planning trace "
                        f"(sha256 {plan.get('inputs', {}).get('trace_sha256')}); none of {', '.join(p for p, _ in held_out)} is it")
    return planning, (held_out[0] if held_out else None)


def role_text(planning, held_out) -> str:
    if planning is not None:
        return "planning trace"
    return f"held-out trace {Path(held_out[0]).name}, not the planning trace"


SUMMARY_ROLE = "planning trace, as plan.json's trace summary keeps it"


def report_facts(plan: dict, plan_path: Path, planning, held_out, tie: float) -> dict:
    """Everything the sections draw beyond plan.json itself. Without a trace, a placed target's loads
    and affinity come from the planning trace's summary the plan keeps (`inputs.trace_summary`)."""
    facts = {"tie": tie}
    source = planning or held_out
    if source is not None:
        facts["trace_role_text"] = role_text(planning, held_out)
    target = plan.get("target")
    with_affinity = target in ("torchrun", "kubernetes")
    if target in PLACED_TARGETS and source is not None:
        facts.update(placement_facts(plan, *trace_loads(plan, source[1], with_affinity)))
    elif target in PLACED_TARGETS and isinstance(plan.get("inputs", {}).get("trace_summary"), dict):
        from moeplan.passes.analysis.trace_summary import summary_loads

        summary = plan["inputs"]["trace_summary"]
        facts["trace_role_text"] = SUMMARY_ROLE
        facts.update(placement_facts(plan, summary_loads(summary, _placed_experts(plan)),
                                     summary.get("affinity") if with_affinity else None))
    if target == "offload" and source is not None:
        facts["cache_curve"] = cache_curve(plan, plan_path, source[1], is_planning=planning is not None)
    if target == "lambda":
        facts["lambda"] = lambda_figures(plan_path)
    if held_out is not None:
        facts["rescored"] = rescore(plan, plan_path, held_out)
    return facts


# ------------------------------------------------------------------------------------- placement

def _placed_experts(plan: dict) -> int:
    from moeplan.passes.optimize.placement.schema import placement_from_dict

    return placement_from_dict(plan["placement"]).num_experts


def _placement_and_loads(plan: dict, trace):
    from moeplan.passes.optimize.placement.schema import placement_from_dict

    placement = placement_from_dict(plan["placement"])
    hosts = placement.hosts()  # bool [L, E, D]
    L, E, D = hosts.shape
    if trace.num_layers != L or trace.num_experts > E:
        raise UserError(f"the trace has {trace.num_layers} MoE layers and {trace.num_experts} experts but the plan places "
                        f"{L} x {E}; give a trace of the planned model")
    loads = np.zeros((L, E))
    loads[:, :trace.num_experts] = trace.expert_loads()
    return placement, hosts, loads


def trace_loads(plan: dict, trace, with_affinity: bool) -> tuple:
    """(loads [L, E], the heaviest crossing pair's affinity summary or None) of `trace` under the plan's
    placement: what the plan's trace summary keeps, computed from a trace given to the report."""
    from moeplan.passes.analysis.trace_summary import heaviest_crossing_pair

    _, hosts, loads = _placement_and_loads(plan, trace)
    return loads, heaviest_crossing_pair(trace, hosts) if with_affinity else None


def device_loads(hosts: np.ndarray, loads: np.ndarray) -> np.ndarray:
    """float [L, D]: each GPU's token-expert assignments, a replicated expert's split evenly over
    its copies (the placement metric's load, passes/optimize/placement/metrics.py)."""
    return np.stack([(loads[l] / hosts[l].sum(axis=1)) @ hosts[l] for l in range(len(hosts))])


def max_over_mean(hosts: np.ndarray, loads: np.ndarray) -> list:
    per = device_loads(hosts, loads)
    mean = per.mean(axis=1)
    return [float(m / a) if a > 0 else 1.0 for m, a in zip(per.max(axis=1), mean)]


def placement_facts(plan: dict, loads: np.ndarray, affinity: dict | None) -> dict:
    """Device loads, per-layer balance beside contiguous and EPLB on the same loads (float [L, E]), and
    the heaviest crossing pair's affinity (`passes/analysis/trace_summary.py`) where given."""
    from moeplan.passes.optimize.placement.algorithms.eplb import eplb_placement
    from moeplan.passes.optimize.placement.algorithms.contiguous import contiguous_placement
    from moeplan.passes.optimize.placement.schema import placement_from_dict

    placement = placement_from_dict(plan["placement"])
    hosts = placement.hosts()
    L, E, D = hosts.shape
    if loads.shape != (L, E):
        raise UserError(f"the trace's loads are {loads.shape[0]} MoE layers x {loads.shape[1]} experts but the plan places "
                        f"{L} x {E}; give a trace of the planned model")
    topology = placement.topology
    per = device_loads(hosts, loads)
    mean = per.mean(axis=1, keepdims=True)
    redundant = int(hosts.sum() // L - E)
    groups = int(plan.get("inputs", {}).get("options", {}).get("expert_groups", 0) or 0)
    series = {"this plan": max_over_mean(hosts, loads),
              "contiguous": max_over_mean(contiguous_placement(L, E, topology), loads) if E % D == 0 else None,
              f"EPLB ({redundant} redundant)": max_over_mean(eplb_placement(loads, topology, redundant, groups), loads)}
    out = {"device_load": np.where(mean > 0, per / np.where(mean > 0, mean, 1), 0.0).tolist(),
           "layer_balance": {"layers": [layer["layer"] for layer in plan["placement"]["layers"]], "series": series}}
    if affinity is not None:
        out["affinity"] = affinity
    return out


# --------------------------------------------------------------------------------------- offload

def _offload_stream(plan: dict, trace, is_planning: bool):
    """(stream, popularity [L, E]): the planner's own held-out sequences of the planning trace, or a
    whole held-out trace; residents follow the plan's rule (the most popular keys of the fitting part)."""
    from moeplan.passes.analysis.activation import popularity_by_layer
    from moeplan.passes.analysis.trace.format import make_trace
    from moeplan.passes.optimize.offload.cache_plan import OffloadRequest, capped, split_by_sequence
    from moeplan.passes.optimize.offload.stream import build_stream

    inputs = plan.get("inputs", {})
    E = int(plan["model"]["ir"]["stages"][[s.get("type") for s in plan["model"]["ir"]["stages"]].index("moe")]["num_experts"])
    if trace.num_experts != E:
        trace = make_trace(trace.experts, trace.weights, num_experts=E, positions=trace.positions, sequence=trace.sequence)
    prompt = int(inputs.get("prompt_tokens", 0) or 0)
    if is_planning:
        fit_rows, val_rows = split_by_sequence(trace, float(inputs.get("validation_fraction", 0.2)))
        stream = capped(build_stream(trace.select(val_rows), prompt), OffloadRequest.max_sim_requests)
        return stream, popularity_by_layer(trace.select(fit_rows))
    popularity = np.asarray(plan["communication"]["policy_model"]["popularity"], dtype=float)
    return build_stream(trace, prompt), popularity


def cache_curve(plan: dict, plan_path: Path, trace, is_planning: bool) -> dict:
    """Hit ratio of every demand policy at CURVE_POINTS cache sizes (and the plan's)."""
    from moeplan.passes.analysis.trace.format import require_routing
    from moeplan.passes.optimize.offload.evaluate import run_demand
    from moeplan.passes.optimize.offload.cache_plan import popular_keys
    from moeplan.planner.commands.simulate_offload import load_offload_plan

    require_routing(trace, "the hit-ratio curve (per-token expert requests)")
    offload = load_offload_plan(plan_path)
    stream, popularity = _offload_stream(plan, trace, is_planning)
    total = offload["num_layers"] * offload["num_experts"]
    k = max(1, int(plan["model"]["ir"]["stages"][[s.get("type") for s in plan["model"]["ir"]["stages"]].index("moe")]["top_k"]))
    sizes = sorted({int(round(x)) for x in np.geomspace(k, max(total - 1, k), CURVE_POINTS)} | {offload["capacity"]})
    curve = {}
    expert_bytes = offload["timing"].expert_bytes
    for size in sizes:
        resident = offload["resident"] if size == offload["capacity"] and is_planning else popular_keys(popularity, size)
        for name, r in run_demand(stream, size, resident, offload["model"], expert_bytes=expert_bytes).items():
            curve.setdefault(name, []).append(r["hit_ratio"])
    return {"sizes": sizes, "hit_ratio": curve, "tokens": stream.num_tokens, "requests": stream.num_requests}


# ---------------------------------------------------------------------------------------- lambda

def lambda_figures(plan_path: Path) -> dict:
    """Per expert function (planned memory, replicas, predicted tokens) its replica time and cost; per
    stage of one batch (dense functions, MoE layers) its latency and billed cost."""
    from moeplan.passes.optimize.serverless import billing as sc
    from moeplan.passes.optimize.serverless.sizing import layer_cost_latency
    from moeplan.runtime.lambda_.charges import invocation_usd
    from moeplan.planner.pipeline.lambda_ import read_plan

    _, facts, layers, batch_tokens = read_plan(plan_path)
    p = facts.platform
    functions = []
    for l, dec in enumerate(layers):
        lf = facts.layers[l]
        for e, ch in enumerate(dec.experts):
            if ch.tokens <= 0:
                continue
            r = math.ceil(ch.tokens / ch.replicas)
            t = float(sc.replica_time(p, lf, dec.method, ch.memory_mb, r, dec.beta))
            functions.append({"layer": l, "expert": e, "memory_mb": ch.memory_mb, "replicas": ch.replicas, "tokens": ch.tokens,
                              "latency_s": t, "cost_usd": float(sc.expert_cost(p, ch.memory_mb, ch.replicas, t))})
    dense = sc.dense_times(facts, batch_tokens)

    def dense_cost(seconds):
        return invocation_usd(seconds, p.dense_function_memory_mb, p.billing_granularity_s, p.price_per_gb_s,
                              p.price_per_request)

    stages = [{"stage": "head (embedding)", "latency_s": dense["head"], "cost_usd": dense_cost(dense["head"])}]
    for l, dec in enumerate(layers):
        seconds = dense["non_moe"][l]
        stages.append({"stage": f"dense {l}", "latency_s": seconds,
                       "cost_usd": dense_cost(sc.head_time(p, facts.layers[l].dense_param_bytes) + seconds)})
        cost, latency = layer_cost_latency(facts, l, dec, [ch.tokens for ch in dec.experts])
        stages.append({"stage": f"MoE {l} ({sc.METHOD_NAMES[dec.method]})", "latency_s": float(latency), "cost_usd": float(cost)})
    stages.append({"stage": "tail (norm, head)", "latency_s": dense["tail"], "cost_usd": dense_cost(dense["tail"])})
    return {"functions": functions, "stages": stages}


# --------------------------------------------------------------------------------------- re-score

def rescore(plan: dict, plan_path: Path, held_out) -> dict:
    """The plan's predicted figures beside the same figures on held-out traffic."""
    from moeplan.planner.report.page import Num

    path, trace = held_out
    target = plan.get("target")
    rows, notes = [], []

    def row(name, plan_path_, value, scale=1.0, unit=""):
        from moeplan.planner.report.summary import at

        rows.append([name, Num(at(plan, plan_path_), plan_path_, scale, unit=unit), Num(value, None, scale, unit=unit)])

    if target in PLACED_TARGETS:
        from moeplan.passes.optimize.placement.policies import evaluate_placement

        placement, hosts, _ = _placement_and_loads(plan, trace)
        got = evaluate_placement(placement, trace)
        for k in ("gpu_local_fraction", "node_local_fraction", "max_over_mean_load"):
            if k in got and k in plan.get("predicted", {}):
                row(k, f"predicted.{k}", got[k])
        cost = plan.get("predicted", {}).get("cost")
        if cost and not trace.loads_only:
            predicted = _cost_on(plan, hosts, placement.topology.gpus_per_node, trace, notes)
            if predicted:
                base = f"predicted.cost.modes.{cost['mode']}"
                row(f"time per token ({cost['mode']})", f"{base}.seconds_per_token", predicted["seconds_per_token"], 1e3, "ms")
                row(f"bytes per token ({cost['mode']})", f"{base}.total_bytes_per_token", predicted["total_bytes_per_token"], unit="B")
    elif target == "offload":
        from moeplan.passes.optimize.offload.evaluate import run_demand, run_prefetch
        from moeplan.planner.commands.simulate_offload import load_offload_plan

        o = load_offload_plan(plan_path)
        stream, _ = _offload_stream(plan, trace, is_planning=False)
        demand = run_demand(stream, o["capacity"], o["resident"], o["model"], expert_bytes=o["timing"].expert_bytes)
        prefetch = run_prefetch(stream, o["capacity"], o["resident"], o["model"], o["eamc"], o["timing"])
        row(f"hit ratio ({o['eviction']})", "predicted.hit_ratio", demand[o["eviction"]]["hit_ratio"])
        for name in sorted(demand):
            row(f"hit ratio, {name}", f"predicted.policies.{name}.hit_ratio", demand[name]["hit_ratio"])
        row(f"time per token (prefetch {o['prefetch']})", "predicted.seconds_per_token", prefetch[o["prefetch"]]["seconds_per_token"], 1e3, "ms")
    elif target == "lambda":
        from moeplan.passes.optimize.serverless.sizing_pipeline import real_batches
        from moeplan.passes.optimize.serverless.sim import simulate
        from moeplan.planner.pipeline.lambda_ import read_plan

        _, facts, layers, batch_tokens = read_plan(plan_path)
        if trace.num_layers != len(layers):
            raise UserError(f"trace '{path}' has {trace.num_layers} MoE layers but the plan has {len(layers)}; give a trace of the planned model")
        sims = [simulate(facts, layers, loads, batch_tokens) for _, loads in real_batches(trace, np.arange(trace.num_tokens), batch_tokens)]
        if sims:
            row("MoE cost per batch", "predicted.moe_cost_per_batch_usd", float(np.mean([s.moe_cost for s in sims])), unit="$")
            row("latency per batch", "predicted.latency_s", float(np.mean([s.latency for s in sims])), unit="s")
            row("throughput", "predicted.throughput_tokens_per_s", float(np.mean([s.throughput for s in sims])), unit="tokens/s")
            slo = plan.get("inputs", {}).get("slo_s")
            notes.append(f"{len(sims)} batch(es) of {batch_tokens} tokens; {sum(s.latency > (slo or math.inf) + 1e-9 for s in sims)} "
                         f"over the SLO; {sum(len(s.overflows) for s in sims)} expert overflow(s) invoked extra replicas.")
    return {"rows": rows, "notes": notes,
            "caption": f"The plan's predictions (planning trace) beside the same figures on {Path(path).name} ({trace.num_tokens:,} tokens)"}


def _cost_on(plan: dict, hosts, gpus_per_node: int, trace, notes: list):
    """The cost model's prediction for the plan's mode with routing sampled from `trace` instead."""
    from moeplan.passes.cost.cost_model import expected
    from moeplan.core.hardware import BUILTIN, load_hardware
    from moeplan.passes.cost.context import shape_of_plan
    from moeplan.passes.cost.options import parse_workload

    cost = plan["predicted"]["cost"]
    from moeplan.planner.report.summary import hardware_name

    name = hardware_name(plan)
    if name not in BUILTIN and not Path(str(name)).is_file():
        notes.append(f"time not re-scored: the plan's hardware profile '{name}' is not a built-in profile or a file here")
        return None
    shape = shape_of_plan(plan, cost.get("context") or [])
    return expected(hosts, gpus_per_node, shape, cost["mode"], parse_workload(cost["workload"]), trace.experts, load_hardware(name))
