"""A lower bound on cross-GPU transitions that sees whole GPU columns, not one layer pair at a time.

Why: a bound over one layer pair at a time (`pairwise.py`) cannot see that the Q experts GPU p hosts
at layer l are at once the successors of its layer l-1 experts and the predecessors of its layer
l+1 experts. On the trained corpus traces each expert sends its tokens to few successors (21-101
observed pairs per layer pair, against P Q^2 = 72-648 co-located pairs), so each pair alone can
be made nearly all-local. Here a GPU's whole column, (A_0, ..., A_{L-1}) with |A_l| = Q, is one
configuration (mixtral-16x2-s1 without replicas: gap 0.202 -> 0.054). With replicas this LP is
all-local too where it fits (a copy can only be charged load / K), so `pairwise.py` uses it without
replicas only; benchmarks/research/relaxed_routing.py says why no bound of this kind can do much better there.

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

from moeplan.passes.optimize.milp import quiet_highs
from moeplan.passes.optimize.placement.budget import WorkBudget

CHAIN_WORK = 20_000_000  # (Q-subsets per layer)^2 x layer pairs, at effort 1: above it the bound is skipped
CHAIN_ROUNDS = 150  # column-generation rounds at effort 1
COLUMNS_PER_ROUND = 40  # best columns (by their first layer's state) added per round
SMOOTHING = 0.85  # weight of the best multipliers so far in the pricing point


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
                              slots_per_gpu: int, max_replicas: int = 1, budget: WorkBudget = None):
    """Lower bound on the cross-GPU transitions of any placement within the caps (module
    docstring), or None where the exact pricing does not fit the work budget.

    counts: float [L-1, E, E]; loads: float [L, E]; caps: float [L]."""
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
    layer, a, b = np.nonzero(counts)
    c = counts[layer, a, b]
    total = float(counts.sum())
    master = (np.ones_like(counts), np.zeros((L, E)))  # the master LP's latest duals (pi, mu)
    center, best = None, math.inf  # the multipliers of the best bound so far, and that bound
    lp = _Master(layer, a, b, c, L, E, P, total)
    seen = set()
    for _ in range(budget.scaled(CHAIN_ROUNDS)):
        fresh = []
        # price at a point between the best multipliers and the master's (Wentges smoothing: the
        # master's duals jump about, the bound converges in far fewer rounds); if that finds no new
        # column, price at the master's own duals, which settles whether the LP is solved
        for pi, mu in ([] if center is None else [_between(center, master, SMOOTHING)]) + [master]:
            top, found = best_columns(subsets, feasible, pi * counts, mu, COLUMNS_PER_ROUND)
            value = float((counts * np.maximum(0.0, 1.0 - pi)).sum()) - mu.sum() + P * top
            if value < best:
                center, best = (pi, mu), value
            fresh = [col for col in found if tuple(col) not in seen]
            if fresh:
                break
        if not fresh or budget.expired():
            break
        seen.update(tuple(col) for col in fresh)
        lp.add(fresh, subsets)
        duals = lp.duals()
        if duals is None:
            break
        pi_full = np.zeros_like(counts)
        pi_full[layer, a, b] = duals[0]
        master = (pi_full, duals[1])
    return max(0.0, total - min(best, total))


def _between(center, master, weight):
    """The multipliers weight x center + (1 - weight) x master (still >= 0, so still valid)."""
    return tuple(weight * x + (1.0 - weight) * y for x, y in zip(center, master))


class _Master:
    """The configuration LP over the columns found so far, kept in one HiGHS model so each round
    adds columns and re-solves from the last basis: max sum c y, y[lab] <= GPUs whose column holds
    a at l and b at l+1, y <= 1, every expert hosted (a slack at `penalty` per unit keeps it
    feasible), P columns in all. Its row duals are the multipliers (pi, mu) of the bound."""

    def __init__(self, layer, a, b, c, L, E, P, penalty):
        import highspy

        self.layer, self.a, self.b, self.c, self.L, self.E = layer, a, b, c, L, E
        n, cover = len(c), L * E
        self.count_row = cover + n
        h = self.h = quiet_highs()
        h.setOptionValue("threads", 1)
        h.setOptionValue("random_seed", 0)
        h.setOptionValue("presolve", "off")  # each round starts from the last basis
        h.setOptionValue("solver", "simplex")
        lower = np.concatenate([np.ones(cover), np.full(n, -highspy.kHighsInf), [float(P)]])
        upper = np.concatenate([np.full(cover, highspy.kHighsInf), np.zeros(n), [float(P)]])
        h.addRows(len(lower), lower, upper, 0, np.zeros(0, dtype=np.int32), np.zeros(0, dtype=np.int32), np.zeros(0))
        h.addCols(n, -c, np.zeros(n), np.ones(n), n, np.arange(n, dtype=np.int32),
                  (cover + np.arange(n)).astype(np.int32), np.ones(n))  # y
        h.addCols(cover, np.full(cover, float(penalty)), np.zeros(cover), np.full(cover, highspy.kHighsInf), cover,
                  np.arange(cover, dtype=np.int32), np.arange(cover, dtype=np.int32), np.ones(cover))  # slacks

    def add(self, columns, subsets):
        """Add GPU columns (int [L] subset indices each)."""
        starts, rows, values = [], [], []
        for column in columns:
            member = subsets[column]  # [L, E]
            covered = np.flatnonzero(member.ravel())
            held = np.flatnonzero(member[self.layer, self.a] * member[self.layer + 1, self.b])
            starts.append(len(rows))
            rows += covered.tolist() + (self.L * self.E + held).tolist() + [self.count_row]
            values += [1.0] * len(covered) + [-1.0] * len(held) + [1.0]
        m = len(columns)
        self.h.addCols(m, np.zeros(m), np.zeros(m), np.full(m, np.inf), len(rows), np.array(starts, dtype=np.int32),
                       np.array(rows, dtype=np.int32), np.array(values))

    def duals(self):
        """(pi float [n], mu float [L, E]) at the LP optimum, or None if HiGHS did not reach it."""
        import highspy

        self.h.run()
        if self.h.getModelStatus() != highspy.HighsModelStatus.kOptimal:
            return None
        dual = np.asarray(self.h.getSolution().row_dual)
        cover = self.L * self.E
        mu = np.clip(dual[:cover], 0.0, None).reshape(self.L, self.E)
        pi = np.clip(-dual[cover:cover + len(self.c)], 0.0, None) / self.c
        return pi, mu
