"""`moeplan place` as passes: trace -> placement -> write placement.json; the placement pass torchrun reuses.

Facts: `trace_path`, `topology` {"nodes", "gpus_per_node"}, `placement_options` (PlacementRequest
fields), `out`, `timings` (keep solve_seconds in the file) -> `placement`, `written`.
"""
from __future__ import annotations

from moeplan.planner.pass_manager import Pass
from moeplan.planner.pipeline.common import TRACE


def _placement(facts):
    from moeplan.passes.optimize.placement.contract import Topology
    from moeplan.passes.optimize.placement.policies import PlacementRequest, plan_placement

    topo = facts["topology"]
    request = PlacementRequest(topology=Topology(topo["nodes"], topo["gpus_per_node"]), **facts["placement_options"])
    return {"placement": plan_placement(facts["trace"], request)}


def _write(facts):
    facts["placement"].save(facts["out"], timings=facts["timings"])
    return {"written": str(facts["out"])}


PLACEMENT = Pass("placement", ("trace", "topology", "placement_options"), ("placement",), _placement)
WRITE = Pass("write", ("placement", "out", "timings"), ("written",), _write)
PASSES = [TRACE, PLACEMENT, WRITE]
