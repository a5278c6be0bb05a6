"""Placement algorithms behind one enum and one dispatch: which GPU hosts which experts of each MoE layer.

| algorithm    | module                      | what                                                        |
| ------------ | --------------------------- | ----------------------------------------------------------- |
| `contiguous` | `contiguous.py`             | expert i on device i // (E / D) (DeepSpeed-MoE's default)    |
| `eplb`       | `eplb.py`                   | DeepSeek's EPLB, our implementation: replicate hot experts, pack balanced |
| `ilp`        | `ilp.py` (`ilp_caps.py`, `ilp_stages.py`) | ExFlow's staged affinity ILP with load caps and redundant slots, polished by `../local_search/` and bounded by `../bounds/` |

`algorithm_named` turns a `--policy` name into the enum (one error for every caller);
`place_experts` runs one and returns bool hosts [L, E, D] and the metrics it adds. The shape follows
SGLang's `python/sglang/srt/eplb/eplb_algorithms/__init__.py` (sglang 0.5.23: the `EplbAlgorithm`
enum, `compute_algorithm` choosing one, `rebalance_experts` dispatching); scoring and the
placement.json record stay with the caller (`policies.plan_placement`).
"""
from __future__ import annotations

from enum import Enum

import numpy as np

from moeplan.passes.optimize.placement.algorithms.contiguous import contiguous_placement
from moeplan.passes.optimize.placement.algorithms.eplb import eplb_placement
from moeplan.passes.optimize.placement.algorithms.ilp import ilp_placement
from moeplan.core.errors import UserError


class PlacementAlgorithm(Enum):
    ILP = "ilp"
    EPLB = "eplb"
    CONTIGUOUS = "contiguous"


ALGORITHM_NAMES = tuple(a.value for a in PlacementAlgorithm)


def algorithm_named(name: str) -> PlacementAlgorithm:
    """The algorithm a `--policy` name selects, or one error line naming the choices."""
    try:
        return PlacementAlgorithm(name)
    except ValueError:
        raise UserError(f"--policy must be one of {', '.join(ALGORITHM_NAMES)}, got {name!r}") from None


def place_experts(algorithm: PlacementAlgorithm, trace, request, start: float) -> tuple:
    """(bool [L, E, D] hosts, extra metrics) of `algorithm` for a `policies.PlacementRequest` on a trace;
    `start`: the solve's time.perf_counter() origin (the ILP's safety deadline counts from it)."""
    loads = trace.expert_loads().astype(np.float64)
    if algorithm is PlacementAlgorithm.CONTIGUOUS:
        return contiguous_placement(trace.num_layers, trace.num_experts, request.topology), {}
    if algorithm is PlacementAlgorithm.EPLB:
        return eplb_placement(loads, request.topology, request.redundant, request.expert_groups), {}
    return ilp_placement(trace, loads, request, start)
