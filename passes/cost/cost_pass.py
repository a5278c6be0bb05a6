"""The cost model wired to plans and traces: the torchrun and Kubernetes targets' placement and cost passes.

* `PLACEMENT` (`placement_or_auto`): the placement pass of `moeplan place`
  (passes/optimize/placement/passes.py), or with --policy auto every policy priced by the cost model
  and the fastest taken; it also checks that the trace was recorded from this model.
* `COST` (`cost_fact`): both modes priced on the chosen placement (routing sampled from the plan's
  trace), the mode --mode auto picks, and the policy candidates' table; facts `cost_options`
  {"hardware", "workload"} -> `cost` {"mode", "doc": plan.json `predicted.cost`}.
"""
from __future__ import annotations

import dataclasses

from moeplan.core.pass_manager import Pass
from moeplan.passes.analysis.trace.passes import trace_matches_model
from moeplan.passes.cost.context import attention_record, context_plan_of, priced_shape
from moeplan.passes.cost.options import cost_profile, default_cost_options, parse_workload
from moeplan.passes.cost.runtime_ops import captures_decode_graphs, runtime_ops
from moeplan.passes.optimize.placement import passes as place_passes


def cost_fact(ir, trace, placement, mode: str, cost_options: dict, context: list | None = None, module=None) -> dict:
    """What compile records under plan.json `predicted.cost` and the mode the bundle runs (`module`: the library
    model, whose attention at context is priced, `attention_context.py`, at the KV dtype held on the profile)."""
    from moeplan.passes.cost.by_predicted_time import MODES, choose_mode, predict_modes

    given = cost_profile(cost_options, placement.topology.nodes)
    profile = given.profile
    workload = parse_workload(cost_options["workload"])
    shape = priced_shape(ir, module, profile, context)
    attention = shape.attention_context
    alternatives = placement.metrics.get("auto_predictions", [])
    # --policy auto priced the chosen placement already (under both modes unless --mode named one)
    preds = next((row["modes"] for row in alternatives if row["chosen"] and set(row["modes"]) == set(MODES)), None)
    if preds is None:
        preds = predict_modes(placement.hosts(), placement.topology.gpus_per_node, shape, workload, trace.experts, profile)
    chosen = choose_mode(preds) if mode == "auto" else mode
    stop = placement.metrics.get("auto_stop")
    ops = runtime_ops(profile, shape.architecture, shape.held_dtype)
    # priced with its decode steps replayed as CUDA graphs (a service's GPU ranks, runtime_ops.py)
    graphs = captures_decode_graphs(profile, placement.topology.devices, chosen, shape, ops)
    return {
        "mode": chosen,
        "doc": {"hardware": profile.name, "workload": cost_options["workload"], "mode_requested": mode,
                "mode": chosen, "modes": preds, "context": context or [], "alternatives": alternatives,
                **({"auto_stop": stop} if stop is not None else {}),
                **({"attention_context": attention_record(attention)} if attention is not None else {}),
                **({"runtime_ops": ops.record()} if ops.counted else {}),
                **({"decode_steps": "cuda graphs", "gathered_wire_bytes": shape.wire_bytes} if graphs else {}),
                **given.plan_record(figures=True)},
    }


def auto_placement(ir, trace, request, mode: str, cost_options: dict, context: list | None = None, module=None):
    """--policy auto: the candidate policies priced by the cost model; the fastest, with the table
    of candidates under its metrics (`auto_candidates`) and where the search stopped (`auto_stop`)."""
    from moeplan.passes.cost.by_predicted_time import choose_placement

    profile = cost_profile(cost_options, request.topology.nodes).profile
    shape = priced_shape(ir, module, profile, context)
    placement, rows, stop = choose_placement(trace, request, shape, profile, parse_workload(cost_options["workload"]), mode)
    placement.metrics["auto_candidates"] = [{k: v for k, v in r.items() if k != "modes"} for r in rows]
    placement.metrics["auto_predictions"] = rows
    placement.metrics["auto_stop"] = stop
    return placement


def placement_or_auto(facts):
    """The placement pass: `moeplan place`'s, or with --policy auto the fastest by predicted time."""
    options = facts["placement_options"]
    if options.get("policy") != "auto":
        return place_passes._placement(facts)
    from moeplan.passes.optimize.placement.schema import Topology
    from moeplan.passes.optimize.placement.policies import PlacementRequest

    topo = facts["topology"]
    request = PlacementRequest(topology=Topology(topo["nodes"], topo["gpus_per_node"]),
                               **{k: v for k, v in options.items() if k != "policy"})
    model = facts["model"]
    return {"placement": auto_placement(model.ir, facts["trace"], request, facts["mode"],
                                        default_cost_options(facts.get("cost_options")), context_plan_of(model.module),
                                        model.module)}


def _cost(facts):
    model = facts["model"]
    return {"cost": cost_fact(model.ir, facts["trace"], facts["placement"], facts["mode"],
                              default_cost_options(facts.get("cost_options")), context_plan_of(model.module),
                              model.module)}


COST = Pass("cost", ("model", "trace", "placement", "mode", "cost_options"), ("cost",), _cost)
# the placement pass of `moeplan place`, here also checking that the trace was recorded from this model;
# --policy auto prices every policy with the cost model
PLACEMENT = dataclasses.replace(place_passes.PLACEMENT, reads=place_passes.PLACEMENT.reads + ("model", "mode", "cost_options"),
                                run=placement_or_auto, check=trace_matches_model)
