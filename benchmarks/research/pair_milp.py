"""One layer pair's placement without replicas, solved as a compact MILP: a bound and its limit.

Why: the reported bound (`passes/optimize/placement/bounds/pairwise.py`) is a sum over layer pairs of LP relaxations. Solving each
pair's own placement problem exactly (GPU-indexed binaries, branch and bound) gives the strongest
bound any pair-by-pair argument can give, and the pair's best placement found caps it: the sum
over pairs of those best values is an upper limit on every bound that treats the pairs one at a
time. `benchmarks/placement_gap.py --pair-milp` prints both; the planner does not run this (a
pair of 64 experts on 8 GPUs takes about a minute to 1,000 nodes).

Model (no replicas): x[e, p] = 1 when expert e of layer l is on GPU p, y[e, p] the same at l+1,
each expert on one GPU, Q experts per GPU and layer, loads within the caps; w[ab, p] <= x[a, p],
y[b, p]; maximise sum c_ab w[ab, p]. GPUs are interchangeable, so expert e < P of layer l is kept
on a GPU numbered at most e (symmetry breaking, valid for every placement up to renumbering).
"""
from __future__ import annotations

import numpy as np

from moeplan.passes.optimize.milp import Rows, solve_milp
from moeplan.passes.optimize.placement.local_search.joint import assignment_rows


def pair_cross_milp(counts: np.ndarray, load_from: np.ndarray, load_to: np.ndarray, cap_from: float, cap_to: float,
                    gpus: int, slots_per_gpu: int, node_limit: int, time_limit: float = 600.0,
                    start: np.ndarray = None) -> tuple[float, float]:
    """(lower bound on the pair's cross-GPU transitions, cross transitions of the best pair placement found).

    counts: float [E, E] (a at l -> b at l+1); load_*: float [E]; start: optional bool [2, E, P], a
    placement of the two layers to start from. No placement within the caps: (total, inf)."""
    E, P, Q = counts.shape[0], gpus, slots_per_gpu
    a, b = np.nonzero(counts)
    c = counts[a, b].astype(np.float64)
    total = float(c.sum())
    n, nx = len(c), E * P
    ncols = 2 * nx + n * P
    x = lambda layer, e, p: layer * nx + e * P + p
    rows = Rows()
    for layer, loads, cap in ((0, load_from, cap_from), (1, load_to, cap_to)):
        assignment_rows(rows, layer * nx, loads, np.full(P, float(Q)), cap * (1 + 1e-9))
    w = 2 * nx + np.arange(n * P).reshape(n, P)
    for p in range(P):
        for layer, ends in ((0, a), (1, b)):
            for k in range(n):
                rows.add([w[k, p], x(layer, ends[k], p)], [1.0, -1.0], -np.inf, 0.0)
    A, lo, hi = rows.matrix(ncols)
    upper = np.ones(ncols)
    for e in range(min(E, P)):
        upper[x(0, e, np.arange(e + 1, P))] = 0.0  # symmetry breaking
    cost = np.zeros(ncols)
    cost[w.ravel()] = -np.repeat(c, P)
    integer = np.zeros(ncols, dtype=bool)
    integer[:2 * nx] = True
    warm = None
    if start is not None:
        order = _renumbered(start[0], P)
        warm = np.zeros(ncols)
        warm[:nx] = start[0][:, order].ravel()
        warm[nx:2 * nx] = start[1][:, order].ravel()
        warm[w.ravel()] = (start[0][a][:, order] & start[1][b][:, order]).ravel()
    result = solve_milp(cost, A, lo, hi, np.zeros(ncols), upper, integer,
                        time_limit=time_limit, node_limit=node_limit, warm_start=warm)
    if result.status == "infeasible":
        return total, float("inf")
    bound = total + result.bound if np.isfinite(result.bound) else 0.0
    best = total + result.objective if np.isfinite(result.objective) else float("inf")
    return max(0.0, bound), best


def _renumbered(hosts_from: np.ndarray, P: int) -> np.ndarray:
    """int [P]: a GPU order under which expert e < P of the first layer sits on a GPU numbered at most e
    (GPUs by the lowest expert they hold at the first layer). hosts_from: bool [E, P]."""
    first = np.array([np.flatnonzero(hosts_from[:, p])[0] if hosts_from[:, p].any() else hosts_from.shape[0]
                      for p in range(P)])
    return np.argsort(first, kind="stable")
