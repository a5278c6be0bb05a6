"""The placement metrics of ARCHITECTURE.md, computed by one vectorised function for everyone.

- *Current device* after MoE layer l: the device of the token's highest-weight expert at l, by the
  runtime's replica rule (`runtime/ep/expert_table.py: ExpertTable.primary`): for a
  replicated expert the replica on the previous current device if any, else the first replica
  on the same node as it, else the first listed (lowest device id). At layer 0 there is no
  previous device, so the first listed replica is taken. A token with no expert at a layer keeps
  its current device; before its first expert it has none and its choices are not counted.
- `gpu_local_fraction`: over all (token, layer l >= 1, valid choice at l), the share whose expert
  has a replica on the token's current device after l-1.
- `node_local_fraction`: the same, with a replica anywhere on that device's node.
- `max_over_mean_load`: per layer, device load = (token, choice) assignments to the experts it
  hosts, a replicated expert's split evenly over its replicas; max / mean over devices, averaged
  over layers that route any token (a loads-only trace: from its loads; it has no locality).
`cross_gpu_transitions` = transitions - gpu-local ones: the quantity the ILP minimises.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from moeplan.runtime.ep.expert_table import ExpertTable
from moeplan.passes.analysis.affinity import heaviest_choice
from moeplan.passes.analysis.trace.format import Trace
from moeplan.passes.optimize.placement.schema import Topology
from moeplan.core.errors import UserError


@dataclass(frozen=True)
class PlacementScore:
    gpu_local_fraction: float
    node_local_fraction: float
    max_over_mean_load: float
    transitions: int
    cross_gpu_transitions: int
    cross_node_transitions: int

    def as_dict(self) -> dict:
        return asdict(self)


def score_placement(trace: Trace, hosts: np.ndarray, topology: Topology) -> PlacementScore:
    """Score a bool [L, E, D] hosting array on a trace (see module docstring)."""
    L, E, D = hosts.shape
    if L != trace.num_layers:
        raise UserError(f"the placement has {L} MoE layers but the trace has {trace.num_layers}; was the trace recorded from another model?")
    if E < trace.num_experts:
        raise UserError(f"the placement has {E} experts per layer but the trace has {trace.num_experts}")
    if D != topology.devices:
        raise ValueError("hosts and topology disagree on the device count")
    if not hosts.any(axis=2).all():
        raise UserError("the placement leaves an expert without a device")
    table = ExpertTable(hosts, topology.gpus_per_node)
    experts = trace.experts.astype(np.int64)
    heaviest = heaviest_choice(trace)
    current = np.full(trace.num_tokens, -1, dtype=np.int64)
    transitions = gpu_local = node_local = 0
    ratios = []
    layer_loads = np.zeros((L, E))  # the placement may cover more experts than the trace routes to
    layer_loads[:, :trace.num_experts] = trace.expert_loads()
    for l in range(L):
        choices = experts[:, l, :]
        valid = choices >= 0
        if l >= 1:
            counted = valid & (current >= 0)[:, None]
            e = np.where(counted, choices, 0)
            d = np.where(counted, current[:, None], 0)
            transitions += int(counted.sum())
            gpu_local += int((hosts[l][e, d] & counted).sum())
            node_local += int((table.node_hosts[l][e, table.node_of[d]] & counted).sum())
        load = layer_loads[l]
        if load.sum() > 0:
            device_load = hosts[l].T.astype(np.float64) @ (load / hosts[l].sum(axis=1))
            ratios.append(device_load.max() / device_load.mean())
        current = table.primary(l, heaviest[:, l], current)
    return PlacementScore(
        gpu_local_fraction=gpu_local / transitions if transitions else 0.0,
        node_local_fraction=node_local / transitions if transitions else 0.0,
        max_over_mean_load=float(np.mean(ratios)) if ratios else 1.0,
        transitions=transitions,
        cross_gpu_transitions=transitions - gpu_local,
        cross_node_transitions=transitions - node_local,
    )


def max_gpu_loads(hosts: np.ndarray, loads: np.ndarray) -> np.ndarray:
    """float [L]: each layer's largest GPU load, every expert's load split evenly over its copies
    (the load definition above), from bool [L, E, D] hosts and float [L, E] expert loads."""
    return np.array([((loads[l] / hosts[l].sum(axis=1)) @ hosts[l]).max() for l in range(len(hosts))])


def over_cap_layers(hosts: np.ndarray, loads: np.ndarray, caps: np.ndarray) -> list:
    """Layers where some GPU carries more than the layer's cap."""
    return [int(l) for l in np.flatnonzero(max_gpu_loads(hosts, loads) > caps * (1 + 1e-9))]
