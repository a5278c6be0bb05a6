"""The placement passes: `moeplan place` is trace -> placement -> write placement.json (its pass list is
`planner/pipeline/place.py`); torchrun's placement pass is this one priced by the cost model
(`passes/cost/cost_pass.py`), the engine targets' applies the engines' defaults.

Facts: `trace_path`, `topology` {"nodes", "gpus_per_node"}, `placement_options` (PlacementRequest
fields), `out`, `timings` (keep solve_seconds in the file) -> `placement`, `written`.
"""
from __future__ import annotations

from moeplan.core.pass_manager import Pass


def _placement(facts):
    from moeplan.passes.optimize.placement.schema import Topology
    from moeplan.passes.optimize.placement.policies import PlacementRequest, plan_placement

    topo = facts["topology"]
    request = PlacementRequest(topology=Topology(topo["nodes"], topo["gpus_per_node"]), **facts["placement_options"])
    return {"placement": plan_placement(facts["trace"], request)}


def placement_is_valid(facts) -> None:
    """Postcondition of every placement pass: the structural rules of a placement (every expert
    placed, no device hosting one twice), on the topology asked for, one entry per traced layer."""
    from moeplan.passes.optimize.placement.schema import validate_placement

    placement, topology, trace = facts["placement"], facts["topology"], facts["trace"]
    validate_placement(placement)
    asked = (topology["nodes"], topology["gpus_per_node"])
    if (placement.topology.nodes, placement.topology.gpus_per_node) != asked:
        raise ValueError(f"the placement is for {placement.topology}, not the {asked[0]} x {asked[1]} asked for")
    if len(placement.layers) != trace.num_layers or placement.num_experts < trace.num_experts:
        raise ValueError(f"the placement has {len(placement.layers)} layers of {placement.num_experts} experts; the trace "
                         f"{trace.num_layers} layers of {trace.num_experts}")


def _write(facts):
    facts["placement"].save(facts["out"], timings=facts["timings"])
    return {"written": str(facts["out"])}


PLACEMENT = Pass("placement", ("trace", "topology", "placement_options"), ("placement",), _placement,
                 ensures=placement_is_valid)
WRITE = Pass("write", ("placement", "out", "timings"), ("written",), _write)
