"""The engine targets' SLO search as a pass: `--slo tpot=35ms[,ttft=2s]` without `--nodes` chooses the
deployment (`passes/cost/engine/slo_search.py`) and writes what the flags' deployment pass would.

`placement_route` is the real placement the plan would write (the engine defaults: eplb, the config's
expert groups; the command's placement flags where given) for a finalist's nodes, GPUs per node and
redundant slots, as a `Routing` for the engine pricing; placed once per (nodes, GPUs per node, slots).
"""
from __future__ import annotations

from moeplan.passes.cost.engine.prediction import Routing
from moeplan.passes.engine_targets.passes import engine_placement_options, with_model_experts


def placement_route(trace, engine_model: dict, placement_options: dict):
    """candidate -> Routing of the trace under the placement the plan would write for it."""
    from moeplan.passes.optimize.placement.policies import PlacementRequest, plan_placement
    from moeplan.passes.optimize.placement.schema import Topology

    trace = with_model_experts(trace, engine_model["num_experts"])
    options = engine_placement_options(placement_options, engine_model)
    cache = {}

    def route(candidate) -> Routing:
        key = (candidate.nodes, candidate.gpus_per_node, candidate.redundant_experts)
        if key not in cache:
            request = PlacementRequest(topology=Topology(candidate.nodes, candidate.gpus_per_node),
                                       **{**options, "redundant": candidate.redundant_experts})
            cache[key] = Routing.placed(trace, plan_placement(trace, request))
        return cache[key]

    return route
