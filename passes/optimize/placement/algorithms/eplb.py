"""`eplb`: our implementation of DeepSeek's Expert Parallelism Load Balancer, from its description.

Published algorithm (DeepSeek-V3 paper and the EPLB README), reimplemented here:
- replicate: give each layer's redundant slots, one at a time, to the expert whose load per
  replica is currently the highest (ties: lowest id), so hot experts get extra copies;
- pack: sort replicas by load per replica, heaviest first, and put each on the least-loaded
  device that still has a free slot (every device gets the same number of slots);
- hierarchical (when the node count divides the number of expert groups, e.g. DeepSeek-V3's 8
  groups of 32 experts): pack whole groups onto nodes balancing node load, replicate within each
  node, then pack each node's replicas onto its GPUs. Otherwise (global): replicate over all
  experts and pack onto all GPUs.
One deviation: our placement format keeps replicas of an expert on distinct devices, so packing
skips devices that already hold the expert whenever another device with a free slot exists.
"""
from __future__ import annotations

import numpy as np

from moeplan.passes.optimize.placement.schema import Topology


def replica_counts(loads: np.ndarray, slots: int, max_replicas: int) -> np.ndarray:
    """int [E]: replicas per expert (>= 1, <= max_replicas, summing to `slots`), hottest first."""
    E = len(loads)
    counts = np.ones(E, dtype=np.int64)
    for _ in range(slots - E):
        per_replica = np.where(counts < max_replicas, loads / counts, -np.inf)
        counts[int(np.argmax(per_replica))] += 1
    return counts


def balanced_packing(item_weights: np.ndarray, item_labels: np.ndarray, packs: int, per_pack: int) -> np.ndarray:
    """int [n]: pack of each item; heaviest first onto the least-loaded pack with room.

    Items sharing a label (replicas of one expert) avoid sharing a pack while that is possible.
    """
    n = len(item_weights)
    assert n == packs * per_pack, (n, packs, per_pack)
    order = np.argsort(-np.asarray(item_weights, dtype=np.float64), kind="stable")
    pack_load = np.zeros(packs)
    pack_size = np.zeros(packs, dtype=np.int64)
    labels_in = [set() for _ in range(packs)]
    out = np.empty(n, dtype=np.int64)
    for item in order:
        room = pack_size < per_pack
        clean = room & np.array([item_labels[item] not in s for s in labels_in])
        allowed = clean if clean.any() else room
        pack = int(np.argmin(np.where(allowed, pack_load, np.inf)))
        out[item] = pack
        pack_load[pack] += item_weights[item]
        pack_size[pack] += 1
        labels_in[pack].add(item_labels[item])
    return out


def eplb_layer(loads: np.ndarray, topology: Topology, redundant: int, expert_groups: int = 0) -> np.ndarray:
    """bool [E, D]: one layer's EPLB placement. `expert_groups` > 0 asks for the hierarchical policy."""
    E = len(loads)
    D, N, G = topology.devices, topology.nodes, topology.gpus_per_node
    slots_per_device = (E + redundant) // D
    hosts = np.zeros((E, D), dtype=bool)
    hierarchical = expert_groups > 0 and expert_groups % N == 0 and E % expert_groups == 0 and redundant % N == 0
    if not hierarchical:
        _replicate_and_pack(np.arange(E), loads, redundant, np.arange(D), slots_per_device, hosts)
        return hosts
    group_size = E // expert_groups
    group_load = loads.reshape(expert_groups, group_size).sum(axis=1)
    group_node = balanced_packing(group_load, np.arange(expert_groups), N, expert_groups // N)
    for node in range(N):
        experts = np.concatenate([np.arange(g * group_size, (g + 1) * group_size) for g in np.flatnonzero(group_node == node)])
        devices = np.arange(node * G, (node + 1) * G)
        _replicate_and_pack(experts, loads[experts], redundant // N, devices, slots_per_device, hosts)
    return hosts


def _replicate_and_pack(experts, loads, redundant, devices, slots_per_device, hosts):
    counts = replica_counts(loads.astype(np.float64), len(experts) + redundant, len(devices))
    replica_expert = np.repeat(np.arange(len(experts)), counts)
    replica_load = (loads / counts)[replica_expert]
    pack = balanced_packing(replica_load, replica_expert, len(devices), slots_per_device)
    hosts[experts[replica_expert], devices[pack]] = True


def eplb_placement(loads: np.ndarray, topology: Topology, redundant: int, expert_groups: int = 0) -> np.ndarray:
    """bool [L, E, D] for loads [L, E]."""
    return np.stack([eplb_layer(layer_loads, topology, redundant, expert_groups) for layer_loads in loads])

