"""One layer's placement as a MILP with the layers around it fixed: the step of the routed local search
(`routed.py`) and of the layer-chain baseline (benchmarks/research/layer_chain.py).

Given values g[e, p] of expert e on GPU p and h[e, n] of e present in node n (the step's gains), place
the layer's replicas:
    maximise  sum_{e,p} g[e, p] m[e, p] + sum_{e,n} h[e, n] z[e, n]
    sum_p m[e, p] = r[e],  sum_e m[e, p] = slots,  sum_e (load[e] / r[e]) m[e, p] <= cap,
    z[e, n] <= sum_{p in n} m[e, p],  m, z binary.
A branch-and-bound node limit (a work limit, so the result does not depend on machine load) and a warm
start bound the work.
"""
from __future__ import annotations

import numpy as np
import scipy.sparse as sp

from moeplan.passes.optimize.milp import solve_milp
from moeplan.passes.optimize.placement.budget import WorkBudget

CHAIN_NODE_LIMIT = 200  # branch-and-bound nodes per layer MIP at effort 1


def layer_mip(g: np.ndarray, h: np.ndarray, replicas: np.ndarray, slots: int, per_copy: np.ndarray, cap: float,
              gpus_per_node: int, warm: np.ndarray = None, node_limit: int = CHAIN_NODE_LIMIT,
              budget: WorkBudget = None, solver: str = "highs") -> np.ndarray:
    """bool [E, D] maximising g.m + h.z under the layer's constraints (module docstring), or None."""
    budget = budget or WorkBudget()
    E, D = g.shape
    N = D // gpus_per_node
    nm, nz = E * D, E * N
    m_index = np.arange(nm).reshape(E, D)
    z_index = nm + np.arange(nz).reshape(E, N)
    rows, cols, vals = [], [], []
    lo, hi = [], []
    r = 0
    # sum_p m[e, p] = r_e
    rows += list(np.repeat(np.arange(E), D))
    cols += list(m_index.ravel())
    vals += [1.0] * nm
    lo += list(replicas.astype(float))
    hi += list(replicas.astype(float))
    r += E
    # sum_e m[e, p] = slots, load <= cap
    rows += list(r + np.tile(np.arange(D), E))
    cols += list(m_index.ravel())
    vals += [1.0] * nm
    lo += [float(slots)] * D
    hi += [float(slots)] * D
    r += D
    rows += list(r + np.tile(np.arange(D), E))
    cols += list(m_index.ravel())
    vals += list(np.repeat(per_copy, D))
    lo += [-np.inf] * D
    hi += [float(cap)] * D
    r += D
    # z[e, n] - sum_{p in n} m[e, p] <= 0
    node_of = np.arange(D) // gpus_per_node
    z_rows = r + np.arange(nz).reshape(E, N)
    rows += list(z_rows.ravel())
    cols += list(z_index.ravel())
    vals += [1.0] * nz
    rows += list(z_rows[:, node_of].ravel())
    cols += list(m_index.ravel())
    vals += [-1.0] * nm
    lo += [-np.inf] * nz
    hi += [0.0] * nz
    r += nz
    A = sp.csc_matrix((vals, (rows, cols)), shape=(r, nm + nz))
    cost = -np.concatenate([g.ravel(), h.ravel()])
    start = None
    if warm is not None:
        start = np.concatenate([warm.ravel(), warm.reshape(E, N, gpus_per_node).any(axis=2).ravel()]).astype(float)
    result = solve_milp(cost, A, np.asarray(lo), np.asarray(hi), np.zeros(nm + nz), np.ones(nm + nz),
                        np.ones(nm + nz, dtype=bool), time_limit=budget.seconds_left(), warm_start=start, solver=solver,
                        mip_gap=1e-4, node_limit=budget.scaled(node_limit))
    budget.record(result)
    if result.x is None:
        return None
    return np.rint(result.x[:nm]).reshape(E, D) > 0.5
