"""Exact GPU-level layer steps (both neighbours fixed), swept over layers: the ILP's last polish.

Why: the staged ILP decides nodes first and GPUs within a node second, so its GPU split can never
move an expert across nodes, and its node split is chosen blind to GPU locality. On traces with
few experts per GPU and a binding cap (top-1 trained models, issue 15) that order loses to the
layer-chain MILP, which places each layer at GPU level directly. This pass solves, for one layer
at a time with layers l-1 and l+1 fixed, the layer-chain MIP (`layer_chain.layer_mip`) with the
look-ahead term added: the value is the ILP's even-split objective at GPU level plus node level,
    in:  g_in[e, p]  = sum_a c[l-1, a, e] * share[l-1, a, p]          (and h_in at node level)
    out: g_out[e, p] = sum_b c[l, e, b] * present[l+1, b, p] / r[e]   (and per node of p)
so each step is exact for its layer (within its node limit), starts from the current layer and is
kept only when it gains. Replica counts stay those of the placement given (`reslot` may have
changed EPLB's). Work: sweeps and branch-and-bound nodes scaled by --effort; layers whose MIP
(experts x GPUs) exceeds `MAX_VARIABLES` x effort are skipped (DeepSeek-V3 x 64 GPUs is 16k).
"""
from __future__ import annotations

import numpy as np

from moeplan.passes.optimize.placement.budget import WorkBudget
from moeplan.passes.optimize.placement.layer_chain import layer_gains, layer_mip

SWEEPS = 4  # at effort 1; a sweep that gains nothing ends the polish
MAX_VARIABLES = 4_096  # experts x GPUs per layer MIP at effort 1
NODE_LIMIT = 100  # branch-and-bound nodes per layer MIP at effort 1


def layer_value_tables(hosts: np.ndarray, counts: np.ndarray, l: int, gpus_per_node: int) -> tuple:
    """(g [E, D], h [E, N]): layer l's linear value with its neighbours fixed (module docstring)."""
    L, E, D = hosts.shape
    N = D // gpus_per_node
    node_of = np.arange(D) // gpus_per_node
    g, h = np.zeros((E, D)), np.zeros((E, N))
    if l > 0:
        g, h = layer_gains(counts[l - 1], hosts[l - 1], gpus_per_node)
    if l < L - 1:
        r = hosts[l].sum(axis=1).astype(float)
        nxt = hosts[l + 1].astype(float)
        node_present = hosts[l + 1].reshape(E, N, gpus_per_node).any(axis=2).astype(float)
        g = g + (counts[l] @ nxt) / r[:, None] + ((counts[l] @ node_present) / r[:, None])[:, node_of]
    return g, h


def layer_value(x: np.ndarray, g: np.ndarray, h: np.ndarray, gpus_per_node: int) -> float:
    E, D = x.shape
    return float((g * x).sum() + (h * x.reshape(E, D // gpus_per_node, gpus_per_node).any(axis=2)).sum())


def polish_layers(hosts: np.ndarray, counts: np.ndarray, loads: np.ndarray, caps: np.ndarray, gpus_per_node: int,
                  budget: WorkBudget = None, solver: str = "highs") -> tuple:
    """Improve bool [L, E, D] hosts by exact layer steps. Returns (hosts, total value gained)."""
    budget = budget or WorkBudget()
    hosts = hosts.copy()
    L, E, D = hosts.shape
    if E * D > budget.scaled(MAX_VARIABLES):
        return hosts, 0.0
    gained = 0.0
    for sweep in range(budget.scaled(SWEEPS)):
        made = 0.0
        for l in (range(L) if sweep % 2 == 0 else reversed(range(L))):
            if budget.expired():
                return hosts, gained + made
            x = hosts[l]
            r = x.sum(axis=1)
            per_copy = loads[l] / r
            if (per_copy @ x).max() > caps[l] * (1 + 1e-9):
                continue  # a layer over its cap is the repair's business, not this polish's
            g, h = layer_value_tables(hosts, counts, l, gpus_per_node)
            before = layer_value(x, g, h, gpus_per_node)
            new = layer_mip(g, h, r, int(x.sum(axis=0)[0]), per_copy, caps[l], gpus_per_node, x, NODE_LIMIT, budget,
                            solver)
            if new is None or (per_copy @ new).max() > caps[l] * (1 + 1e-9):
                continue
            after = layer_value(new, g, h, gpus_per_node)
            if after > before * (1 + 1e-9) + 1e-9:
                hosts[l] = new
                made += after - before
        gained += made
        if made <= 0:
            break
    return hosts, gained
