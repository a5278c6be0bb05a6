"""The placement metrics of ARCHITECTURE.md, computed by one vectorised function for everyone.

- *Current device* after MoE layer l: the device of the token's highest-weight expert at l. For a
  replicated expert: the replica on the previous current device if any, else the first replica
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

from moeplan.passes.analysis.affinity import heaviest_choice
from moeplan.passes.analysis.trace.format import Trace
from moeplan.passes.optimize.placement.decision import Topology
from moeplan.planner.errors import UserError


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
    G = topology.gpus_per_node
    node_of = np.arange(D) // G
    node_hosts, first_device, first_on_node = routing_tables(hosts, G)
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
            node_local += int((node_hosts[l][e, node_of[d]] & counted).sum())
        load = layer_loads[l]
        if load.sum() > 0:
            device_load = hosts[l].T.astype(np.float64) @ (load / hosts[l].sum(axis=1))
            ratios.append(device_load.max() / device_load.mean())
        current = next_devices(current, heaviest[:, l], hosts[l], first_device[l], first_on_node[l], node_of)
    return PlacementScore(
        gpu_local_fraction=gpu_local / transitions if transitions else 0.0,
        node_local_fraction=node_local / transitions if transitions else 0.0,
        max_over_mean_load=float(np.mean(ratios)) if ratios else 1.0,
        transitions=transitions,
        cross_gpu_transitions=transitions - gpu_local,
        cross_node_transitions=transitions - node_local,
    )


def routing_tables(hosts: np.ndarray, gpus_per_node: int) -> tuple:
    """From bool [L, E, D] hosts: (node_hosts bool [L, E, N], first device int [L, E], first device of
    each expert on each node int [L, E, N], -1 where the node has none): what `next_devices` needs."""
    L, E, D = hosts.shape
    N = D // gpus_per_node
    by_node = hosts.reshape(L, E, N, gpus_per_node)
    node_hosts = by_node.any(axis=3)
    first_device = np.argmax(hosts, axis=2)
    first_on_node = np.where(node_hosts, np.argmax(by_node, axis=3) + np.arange(N) * gpus_per_node, -1)
    return node_hosts, first_device, first_on_node


def next_devices(current: np.ndarray, heaviest: np.ndarray, hosts_l: np.ndarray, first_device_l: np.ndarray,
                 first_on_node_l: np.ndarray, node_of: np.ndarray) -> np.ndarray:
    """int [T]: each token's current device after a layer (module docstring), from its current device
    before it (-1: none yet) and its heaviest expert there (-1: none; the token stays put)."""
    has = heaviest >= 0
    hh = np.where(has, heaviest, 0)
    known = current >= 0
    c = np.where(known, current, 0)
    stay = known & hosts_l[hh, c]
    same_node = np.where(known, first_on_node_l[hh, node_of[c]], -1)
    moved = np.where(stay, c, np.where(same_node >= 0, same_node, first_device_l[hh]))
    return np.where(has, moved, current)


def max_gpu_loads(hosts: np.ndarray, loads: np.ndarray) -> np.ndarray:
    """float [L]: each layer's largest GPU load, every expert's load split evenly over its copies
    (the load definition above), from bool [L, E, D] hosts and float [L, E] expert loads."""
    return np.array([((loads[l] / hosts[l].sum(axis=1)) @ hosts[l]).max() for l in range(len(hosts))])


def over_cap_layers(hosts: np.ndarray, loads: np.ndarray, caps: np.ndarray) -> list:
    """Layers where some GPU carries more than the layer's cap."""
    return [int(l) for l in np.flatnonzero(max_gpu_loads(hosts, loads) > caps * (1 + 1e-9))]
