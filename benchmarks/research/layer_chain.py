"""The layer-chain placement: one exact MILP per layer, in layer order, with no look-ahead (a baseline).

Why: it is the plain baseline that beat the staged ILP on traces the ILP was not tuned on
(issue 15), and a start the ILP can polish. Layer 0 is EPLB's packing; layer l (l >= 1) is placed
with layer l-1 fixed, maximising the transitions from l-1 that stay on their GPU plus those that
stay in their node (the staged ILP's two levels, equally weighted), under the same constraints as
the ILP: replica counts water-filled as EPLB does (`eplb.replica_counts`), a fixed slot count per
GPU, replicas on distinct GPUs, and every GPU's load (a replicated expert's load split evenly over
its copies) under the layer's cap. With layer l-1 fixed the value is linear:
    maximise  sum_{e,p} g[e, p] m[e, p] + sum_{e,n} h[e, n] z[e, n]
    g[e, p] = sum_a c[l-1, a, e] * share[l-1, a, p]   (share = hosts / replicas: the even split)
    h[e, n] = the same with share summed over node n's GPUs
    sum_p m[e, p] = r[e],  sum_e m[e, p] = slots,  sum_e (load[e] / r[e]) m[e, p] <= cap,
    z[e, n] <= sum_{p in n} m[e, p],  m, z binary.
Each layer MIP gets a branch-and-bound node limit (a work limit, so the result does not depend on
machine load), warm-started from the transportation optimum repaired to the cap.
"""
from __future__ import annotations

import numpy as np

from moeplan.passes.optimize.placement.algorithms.eplb import balanced_packing, replica_counts
from moeplan.passes.optimize.placement.budget import WorkBudget
from moeplan.passes.optimize.placement.local_search.layer_mip import layer_mip
from moeplan.core.errors import UserError


def layer_gains(counts_prev: np.ndarray, hosts_prev: np.ndarray, gpus_per_node: int) -> tuple:
    """(g [E, D], h [E, N]): transitions into each expert of the next layer that stay local if it
    sits on GPU p (node n), from bool [E, D] hosts of the previous layer and its counts [E, E]."""
    E, D = hosts_prev.shape
    share = hosts_prev / hosts_prev.sum(axis=1, keepdims=True)
    g = counts_prev.T @ share
    h = g.reshape(E, D // gpus_per_node, gpus_per_node).sum(axis=2)
    return g, h


def packed_layer(loads: np.ndarray, replicas: np.ndarray, devices: int, slots: int) -> np.ndarray:
    """bool [E, D]: EPLB's packing of one layer's replicas."""
    E = len(loads)
    replica_expert = np.repeat(np.arange(E), replicas)
    pack = balanced_packing((loads / replicas)[replica_expert], replica_expert, devices, slots)
    hosts = np.zeros((E, devices), dtype=bool)
    hosts[replica_expert, pack] = True
    return hosts


def layer_chain_placement(counts: np.ndarray, loads: np.ndarray, gpus_per_node: int, devices: int, redundant: int,
                          caps: np.ndarray, budget: WorkBudget = None, solver: str = "highs") -> np.ndarray:
    """bool [L, E, D]: the layer-chain placement of float [L, E] loads with counts [L-1, E, E]."""
    budget = budget or WorkBudget()
    L, E = loads.shape
    slots = (E + redundant) // devices
    hosts = np.zeros((L, E, devices), dtype=bool)
    for l in range(L):
        replicas = replica_counts(loads[l], E + redundant, devices)
        packed = packed_layer(loads[l], replicas, devices, slots)
        hosts[l] = packed
        if l == 0 and (loads[l] / replicas @ packed).max() > caps[l] * (1 + 1e-9):
            raise UserError(f"EPLB's packing of MoE layer 0 exceeds its load cap {caps[l]:.0f}; raise --balance or use "
                            f"--balance-base eplb")
        if l == 0 or budget.expired():
            continue
        per_copy = loads[l] / replicas
        g, h = layer_gains(counts[l - 1], hosts[l - 1], gpus_per_node)
        warm = packed if (per_copy @ packed).max() <= caps[l] * (1 + 1e-9) else None
        chosen = layer_mip(g, h, replicas, slots, per_copy, caps[l], gpus_per_node, warm, budget=budget, solver=solver)
        if chosen is not None and (per_copy @ chosen).max() <= caps[l] * (1 + 1e-6):
            hosts[l] = chosen
        elif warm is None:
            raise UserError(f"the layer chain found no placement of MoE layer {l} under its load cap {caps[l]:.0f}; "
                            f"raise --balance or use --balance-base eplb")
    return hosts
