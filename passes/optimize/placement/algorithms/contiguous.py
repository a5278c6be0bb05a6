"""`contiguous`: expert i on device i // (E / D) at every layer (DeepSpeed-MoE's default), no replicas."""
from __future__ import annotations

import numpy as np

from moeplan.passes.optimize.placement.schema import Topology


def contiguous_placement(num_layers: int, num_experts: int, topology: Topology) -> np.ndarray:
    """bool [L, E, D]: expert i on device i // (E / D) at every layer."""
    D = topology.devices
    hosts = np.zeros((num_layers, num_experts, D), dtype=bool)
    hosts[:, np.arange(num_experts), np.arange(num_experts) // (num_experts // D)] = True
    return hosts
