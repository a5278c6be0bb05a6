"""`moeplan place` as a pass list: trace -> placement -> write placement.json.

Facts: `trace_path`, `topology` {"nodes", "gpus_per_node"}, `placement_options` (PlacementRequest
fields), `out`, `timings` (keep solve_seconds in the file) -> `placement`, `written`.
"""
from __future__ import annotations

from moeplan.passes.analysis.trace.passes import TRACE
from moeplan.passes.optimize.placement.passes import PLACEMENT, WRITE

PASSES = [TRACE, PLACEMENT, WRITE]
