"""The engine targets' SLO search as a pass: `--slo tpot=35ms[,ttft=2s]` without `--nodes` chooses the
deployment (`passes/cost/engine/slo_search.py`) and writes what the flags give the other engine passes:
facts `topology`, `placement_options` (the chosen redundant slots) and `engine_deployment` (the record,
`chosen_by="slo_search"`), plus `slo_search` (plan.json `predicted.slo_search`: the choice, why, the
frontier and every priced candidate). It replaces the flags' DEPLOYMENT pass in that mode
(`planner/pipeline/engine_targets.py: passes_for`). Every GPU is one EP rank (the placement's ranks).

Facts read: `search_options` {"slo" (text), "max_gpus", "gpus_per_node", "fixed" (the dimensions the
command fixed: `slo_search.Fixed`)}, `placement_flags` (the command's placement flags), `serving_options`
(hardware, workload), `model_spec`, `engine_model`, `trace`, `target`.

`placement_route` is the real placement the plan would write (the engine defaults: eplb, the config's
expert groups; the command's placement flags where given) for a finalist's nodes, GPUs per node and
redundant slots, as a `Routing` for the engine pricing; placed once per (nodes, GPUs per node, slots).
"""
from __future__ import annotations

from moeplan.core.pass_manager import Pass
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


def _slo_search(facts):
    from moeplan.core.engine_layout import engine_deployment
    from moeplan.core.slo import parse_slo
    from moeplan.passes.cost.engine.model_shape import engine_model
    from moeplan.passes.cost.engine.serving_pass import engine_profile
    from moeplan.passes.cost.engine.slo_search import Fixed, search
    from moeplan.passes.engine_targets.passes import read_config

    options, serving, target = facts["search_options"], facts["serving_options"], facts["target"]
    name = target["name"]
    nodes = max(options["max_gpus"] // options["gpus_per_node"], 1)
    profile = engine_profile(serving["hardware"], nodes, name).profile
    model = engine_model(read_config(facts["model_spec"]), facts["engine_model"]["name"])
    route = placement_route(facts["trace"], facts["engine_model"], facts["placement_flags"])
    result = search(model, name, profile.name, profile, serving["workload"], parse_slo(options["slo"]),
                    gpus_per_node=options["gpus_per_node"], max_gpus=options["max_gpus"], route=route,
                    fixed=Fixed(**options["fixed"]), kv_cache_dtype=target.get("kv_cache_dtype"),
                    progress=facts["progress"])
    c = result.chosen.candidate
    record = engine_deployment(name, c.nodes, c.gpus_per_node, attention_dp=c.attention_dp, moe_ep=c.moe_ep,
                               redundant_experts=c.redundant_experts, max_running_requests=c.max_running_requests,
                               hardware=profile.name, chosen_by="slo_search")
    return {"topology": {"nodes": c.nodes, "gpus_per_node": c.gpus_per_node},
            "placement_options": {**facts["placement_flags"], "redundant": c.redundant_experts},
            "engine_deployment": record, "slo_search": result.to_json()}


SLO_SEARCH = Pass("slo_search", ("model_spec", "engine_model", "trace", "search_options", "placement_flags",
                                 "serving_options", "target", "progress"),
                  ("topology", "placement_options", "engine_deployment", "slo_search"), _slo_search)
