"""A lower bound on cross-GPU transitions that sees whole GPU columns, not one layer pair at a time.

Why: on the trained corpus traces each expert sends its tokens to very few successors (21-101
observed pairs per layer pair, against P Q^2 = 72-648 co-located pairs), so every bound over one
layer pair at a time (`bound.py`, and even its configuration LP with exact pricing) finds a
fractional way to keep every transition local, and the reported gap is 1.0 with replicas. What
such a bound cannot see is that the Q experts GPU p hosts at layer l are at once the successors
of its layer l-1 experts and the predecessors of its layer l+1 experts. Here a GPU's whole
column, (A_0, ..., A_{L-1}) with |A_l| = Q, is one configuration.

The bound (Lagrangian, valid for every multiplier; no LP optimality is needed for validity).
Take any placement with Q experts per GPU per layer, every expert hosted, at most K copies per
expert and GPU loads within caps[l] (a copy of e carries load[l, e] / copies >= load[l, e] / K,
so every GPU's column is in the enumerated set: subsets whose loads / K fit the cap). Let
n[l, a, b] be the number of GPUs hosting a at l and b at l+1. Whatever the routing (the metric's
or any other), a transition a -> b is local only if some GPU hosts both, so
    local <= sum_lab c[l, a, b] min(1, n[l, a, b]).
For pi >= 0, min(1, n) <= (1 - pi)^+ + pi n (n = 0: right side >= 0; n >= 1: >= 1). For mu >= 0,
0 <= sum_le mu[l, e] (copies[l, e] - 1) because every expert is hosted. Adding both and writing
n and copies as sums over GPUs:
    local <= sum c (1 - pi)^+ - sum mu + sum_p value(column_p)
          <= sum c (1 - pi)^+ - sum mu + P max_column value(column),
    value(A_0..A_{L-1}) = sum_l mu[l](A_l) + sum_l sum_{a in A_l, b in A_l+1} pi[l, a, b] c[l, a, b].
The max is exact: a dynamic program over layers whose states are the feasible Q-subsets, so it
runs only where C(E, Q)^2 (L - 1) fits the work budget (`CHAIN_WORK` x effort): the 16-expert
cases, not 64 experts on 8 GPUs (C(64, 9) ~ 3e10) nor DeepSeek-V3. Good multipliers come from
column generation on the configuration LP (the Dantzig-Wolfe master; its duals are pi and mu),
a fixed number of rounds (`CHAIN_ROUNDS` x effort): deterministic, and any round's multipliers
give a valid bound, so the best one is kept.
"""
from __future__ import annotations

import itertools
import math

import numpy as np
import scipy.sparse as sp
from scipy.optimize import linprog

from moeplan.passes.optimize.placement.budget import WorkBudget

CHAIN_WORK = 20_000_000  # (Q-subsets per layer)^2 x layer pairs, at effort 1: above it the bound is skipped
CHAIN_ROUNDS = 60  # column-generation rounds at effort 1
COLUMNS_PER_ROUND = 10  # best columns (by their first layer's state) added per round


def chain_work(experts: int, slots_per_gpu: int, layers: int) -> float:
    """(Q-subsets per layer)^2 x layer pairs: the cost of one exact pricing."""
    return float(math.comb(experts, slots_per_gpu)) ** 2 * max(layers - 1, 0)


def chain_bound_applies(experts: int, slots_per_gpu: int, layers: int, budget: WorkBudget) -> bool:
    return 0 < slots_per_gpu <= experts and chain_work(experts, slots_per_gpu, layers) <= budget.scaled(CHAIN_WORK)


def _subsets(experts: int, size: int) -> np.ndarray:
    """float [N, E]: the indicator rows of every `size`-subset of the experts, in lexicographic order."""
    combos = np.array(list(itertools.combinations(range(experts), size)), dtype=np.int64)
    rows = np.zeros((len(combos), experts))
    rows[np.repeat(np.arange(len(combos)), size), combos.ravel()] = 1.0
    return rows


def best_columns(subsets: np.ndarray, feasible: np.ndarray, weights: np.ndarray, mu: np.ndarray, count: int = 1):
    """(value of the best GPU column, up to `count` columns int [L] of subset indices, best first).

    subsets: float [N, E]; feasible: bool [L, N]; weights: float [L-1, E, E] (pi x c); mu: float
    [L, E]. Exact dynamic program from the last layer back; the columns returned are the best
    one from each of the `count` best first-layer states."""
    L = len(mu)
    value = np.where(feasible[-1], subsets @ mu[-1], -np.inf)
    choice = []
    for l in range(L - 2, -1, -1):
        gain = (subsets @ weights[l]) @ subsets.T + value[None, :]  # [N, N]
        nxt = np.argmax(gain, axis=1)
        value = np.where(feasible[l], subsets @ mu[l] + gain[np.arange(len(nxt)), nxt], -np.inf)
        choice.append(nxt)
    choice.reverse()
    order = np.argsort(-value, kind="stable")[:count]
    order = order[np.isfinite(value[order])]
    columns = []
    for start in order:
        column = [int(start)]
        for l in range(L - 1):
            column.append(int(choice[l][column[-1]]))
        columns.append(column)
    return float(value.max()), columns


def chain_configuration_bound(counts: np.ndarray, loads: np.ndarray, caps: np.ndarray, gpus: int,
                              slots_per_gpu: int, max_replicas: int = 1, budget: WorkBudget = None,
                              start_hosts: np.ndarray = None):
    """Lower bound on the cross-GPU transitions of any placement within the caps (module
    docstring), or None where the exact pricing does not fit the work budget.

    counts: float [L-1, E, E]; loads: float [L, E]; caps: float [L]; start_hosts: bool [L, E, D],
    a placement whose GPU columns seed the column generation (optional)."""
    budget = budget or WorkBudget()
    L, E = loads.shape
    Q, P, K = slots_per_gpu, gpus, max(1, int(max_replicas))
    if L < 2:
        return 0.0
    if not chain_bound_applies(E, Q, L, budget):
        return None
    subsets = _subsets(E, Q)
    feasible = (subsets @ (loads / K).T).T <= caps[:, None] * (1 + 1e-9)  # [L, N]
    if not feasible.any(axis=1).all():
        return float(counts.sum())  # no GPU column fits the caps: no placement does, every bound holds
    index = {tuple(np.flatnonzero(row)): i for i, row in enumerate(subsets)}
    columns = []
    if start_hosts is not None:
        for p in range(start_hosts.shape[2]):
            column = [index.get(tuple(np.flatnonzero(start_hosts[l, :, p]))) for l in range(L)]
            if None not in column and all(feasible[l, s] for l, s in enumerate(column)) and column not in columns:
                columns.append(column)
    layer, a, b = np.nonzero(counts)
    c = counts[layer, a, b]
    total = float(counts.sum())
    pi = np.ones_like(counts)
    mu = np.zeros((L, E))
    best = math.inf
    for _ in range(budget.scaled(CHAIN_ROUNDS)):
        top, found = best_columns(subsets, feasible, pi * counts, mu, COLUMNS_PER_ROUND)
        best = min(best, float((counts * np.maximum(0.0, 1.0 - pi)).sum()) - mu.sum() + P * top)
        fresh = [col for col in found if col not in columns]
        if not fresh or budget.expired():
            break
        columns += fresh
        pi, mu = _master_duals(columns, subsets, layer, a, b, c, L, E, P, total)
        if pi is None:
            break
        pi_full = np.zeros_like(counts)
        pi_full[layer, a, b] = pi
        pi = pi_full
    return max(0.0, total - min(best, total))


def _master_duals(columns, subsets, layer, a, b, c, L, E, P, penalty):
    """Duals (pi per observed pair float [n], mu float [L, E]) of the configuration LP over
    `columns`: max sum c y, y[lab] <= GPUs whose column holds a at l and b at l+1, y <= 1, every
    expert hosted (a slack at `penalty` per unit keeps it feasible), P columns in all."""
    m, n = len(columns), len(c)
    member = np.stack([subsets[col] for col in columns])  # [m, L, E]
    holds_pair = member[:, layer, a] * member[:, layer + 1, b]  # [m, n]
    cover = member.reshape(m, L * E).T  # [L E, m]
    A_ub = sp.vstack([
        sp.hstack([-sp.csr_matrix(cover), sp.csr_matrix((L * E, n)), -sp.eye(L * E)]),
        sp.hstack([-sp.csr_matrix(holds_pair.T), sp.eye(n), sp.csr_matrix((n, L * E))]),
    ]).tocsr()
    b_ub = np.concatenate([-np.ones(L * E), np.zeros(n)])
    A_eq = sp.csr_matrix(np.concatenate([np.ones(m), np.zeros(n + L * E)])[None, :])
    cost = np.concatenate([np.zeros(m), -c, np.full(L * E, penalty)])
    bounds = np.array([(0, None)] * m + [(0, 1)] * n + [(0, None)] * (L * E), dtype=float)
    result = linprog(cost, A_ub=A_ub, b_ub=b_ub, A_eq=A_eq, b_eq=[float(P)], bounds=bounds, method="highs")
    if result.status != 0:
        return None, None
    duals = -result.ineqlin.marginals
    mu = np.clip(duals[:L * E], 0.0, None).reshape(L, E)
    pi = np.clip(duals[L * E:], 0.0, None) / c
    return pi, mu
