"""A valid lower bound on cross-partition transitions, for any placement, at any scale.

Why: the placement ILP is solved by decomposition (stages, one layer at a time), so no single
solver run proves a bound for the whole problem. This one does. The total is a sum over layer
pairs and min(sum) >= sum(min), so bounding each pair (l, l+1) on its own is valid. For a pair,
transition a -> b can be local only if a and b share a partition (GPU or node). With Q expert
slots per partition and at most `r` replicas per expert, an expert a shares a partition with at
most Q * r experts of the next layer (row cap), b with at most Q * r of the previous (column
cap), and the co-located pairs number at most P * Q^2 in all. The most local traffic under these
caps is a fractional b-matching, an LP whose optimum bounds the local traffic from above;
cross >= total - LP. Without replicas (r = 1) it is at least as strong as counting, per source,
everything outside its Q largest successors. The LP runs per pair, in layer order, while the
pairs' LP columns fit a work budget (`LP_COLUMNS` x effort) and each within a simplex iteration
limit; pairs it does not reach use a feasible point of the LP's dual (`dual_bound`, weak duality:
also valid, and in practice within 0.1% of the LP) or the row/column counting bound, whichever is
larger. Work limits, not time, decide which pairs get the LP, so the reported bound is the same on
any machine; the time limit is only a safety net.

Per-token caps (`source_token_caps`): a token sits on one GPU, which hosts Q experts of the next
layer, so at most min(Q, its choices) of its next-layer choices are local, whatever the copies
and the routing. Co-location arguments cannot see this: with replicas they let each choice use a
different copy. Where tokens choose more experts than a GPU holds (olmoe-32x8's top-8 on 5 slots
per GPU), these caps per source, added to the counting bound and the capped LPs, take the
corpus gap with replicas from 0.825 to 0.378 (`benchmarks/placement_gap.py`).
"""
from __future__ import annotations

import numpy as np

from moeplan.passes.analysis.affinity import heaviest_choice
from moeplan.passes.analysis.trace.format import Trace
from moeplan.passes.optimize.milp import Rows, solve_milp
from moeplan.passes.optimize.placement.budget import WorkBudget
from moeplan.passes.optimize.placement.bounds.chain import chain_configuration_bound

LP_COLUMNS = 1_000_000  # observed expert pairs, summed over the layer pairs given the LP, at effort 1
CAPPED_LP_COLUMNS = 200_000  # observed pairs given the load-capped LP too, at effort 1 (all of them at 8 GPUs)
LP_ITERATIONS_PER_COLUMN = 4  # simplex iterations per LP column (at least 10,000), at effort 1


def counting_bound(counts: np.ndarray, row_cap: int, col_cap: int, token_caps: np.ndarray = None) -> float:
    """Cross transitions >= total - (largest row_cap successors per source, each source at most its
    token cap when given: `source_token_caps`), same for columns (without token caps)."""
    total = counts.sum()
    E = counts.shape[0]
    rows = np.sort(counts, axis=1)[:, max(E - row_cap, 0):].sum(axis=1)
    best_rows = (rows if token_caps is None else np.minimum(rows, token_caps)).sum()
    best_cols = np.sort(counts, axis=0)[max(E - col_cap, 0):, :].sum()
    return float(total - min(best_rows, best_cols, total))


def source_token_caps(trace: Trace, slots_per_partition: int) -> np.ndarray:
    """float [L-1, E]: per layer pair and source a, the most transitions of `transition_counts`
    ("current") from a that any placement keeps local: each token whose heaviest expert at l is a
    sits on one partition, which hosts at most Q experts of l+1, so at most min(Q, its valid
    choices at l+1) of them are local, whichever copy it sits on and however it got there. Where
    tokens choose more experts than a partition holds (top-8 on 5 slots), this caps a source's
    local traffic below what any co-location argument sees, replicas or not."""
    L, E = trace.num_layers, trace.num_experts
    sources = heaviest_choice(trace)
    valid = (trace.experts >= 0).sum(axis=2)  # [T, L]
    caps = np.zeros((max(L - 1, 0), E))
    for l in range(L - 1):
        counted = sources[:, l] >= 0
        caps[l] = np.bincount(sources[counted, l], weights=np.minimum(valid[counted, l + 1], slots_per_partition),
                              minlength=E)
    return caps


def _cross_transitions(result, weights: np.ndarray):
    """Transitions no placement keeps local: all of them (weights: float [n], one per observed pair)
    less the LP's most local ones (its objective is their negation); None if the LP stopped early."""
    if result.status != "optimal":
        return None
    return float(weights.sum() + result.objective)


def _observed_pairs(counts: np.ndarray) -> tuple:
    """(E, a [n], b [n], c [n]): the experts and the observed pairs a -> b of counts [E, E], with their counts."""
    a, b = np.nonzero(counts)
    return counts.shape[0], a, b, counts[a, b]


def matching_bound(counts: np.ndarray, row_cap: int, col_cap: int, pair_cap: float, time_limit: float,
                   iteration_limit: int = None) -> float:
    """Cross transitions >= total - max fractional b-matching (see module); None if the LP stops early."""
    E, a, b, weights = _observed_pairs(counts)
    n = len(weights)
    if n == 0:
        return 0.0
    cols = np.arange(n)
    rows = Rows()
    rows.add_block(a, cols, np.ones(n), -np.inf, float(row_cap), E)
    rows.add_block(b, cols, np.ones(n), -np.inf, float(col_cap), E)
    rows.add(cols, np.ones(n), -np.inf, float(pair_cap))
    A, lower, upper = rows.matrix(n)
    result = solve_milp(-weights, A, lower, upper, np.zeros(n), np.ones(n),
                        np.zeros(n, dtype=bool), time_limit=time_limit, iteration_limit=iteration_limit)
    return _cross_transitions(result, weights)


def dual_bound(counts: np.ndarray, row_cap: int, col_cap: int, rounds: int = 30) -> float:
    """Cross transitions >= total - (a feasible point of the b-matching LP's dual).

    Dual: min row_cap * sum(u) + col_cap * sum(v) + sum_ab max(0, c_ab - u_a - v_b), u, v >= 0;
    every (u, v) gives a valid upper bound on local traffic (weak duality). Block coordinate
    descent: the best u_a for fixed v is the row_cap-th largest of (c_ab - v_b) (or 0), and the
    same for columns; a few rounds cost a few sorts of E x E and reach close to the LP."""
    total = counts.sum()
    E = counts.shape[0]
    v = np.zeros(E)
    u = np.zeros(E)
    best = np.inf

    def kth_largest(matrix, k, axis):
        if k >= matrix.shape[axis]:
            return np.zeros(matrix.shape[1 - axis])
        return np.maximum(-np.partition(-matrix, k, axis=axis).take(k, axis=axis), 0.0)

    for _ in range(rounds):
        u = kth_largest(counts - v[None, :], row_cap, axis=1)
        v = kth_largest(counts - u[:, None], col_cap, axis=0)
        value = row_cap * u.sum() + col_cap * v.sum() + np.maximum(counts - u[:, None] - v[None, :], 0).sum()
        if value >= best - 1e-9 * max(best, 1.0):
            best = min(best, value)
            break
        best = value
    return float(total - min(best, total))


def capped_matching_bound(counts: np.ndarray, weight_from: np.ndarray, weight_to: np.ndarray, cap_from: float,
                          cap_to: float, slots_per_partition: int, partitions: int, max_replicas: int,
                          iteration_limit: int = None, time_limit: float = 10.0, token_caps: np.ndarray = None) -> float:
    """Cross transitions of one layer pair >= total - an LP that keeps the load cap; None if the LP stops early.

    y[a, b] in [0, 1] is the share of the a -> b transitions that stay on their GPU; r[a] and
    s[b] are the (relaxed) copy counts of a at l and b at l+1, in [1, max_replicas], summing to
    the slots per layer. Every local a -> b transition needs b on a GPU holding a copy of a, so:
      sum_b y[a, b] <= Q r[a]                     (a's copies hold Q experts of l+1 each)
      sum_b weight_to[b] y[a, b] <= cap_to r[a]   (and those experts' loads fit under the cap)
    and the same per b over the copies of b at l+1 (with weight_from, cap_from); sum y <= P Q^2.
    weight_*: float [E], a lower bound on each expert's load per copy (its load / max_replicas,
    or its load when it has one copy). Without replicas the knapsack rows say that the experts
    sharing a's GPU at the next layer cannot carry more than the cap: where the cap binds (a hot
    expert's successors are hot too), the matching bound without them can keep a hot successor
    local for every predecessor at once. With `token_caps` (float [E], `source_token_caps`), also
    sum_b c[a, b] y[a, b] <= token_caps[a]."""
    E, a, b, c = _observed_pairs(counts)
    n = len(c)
    if n == 0:
        return 0.0
    Q = slots_per_partition
    cols = np.arange(n)
    ra = n + np.arange(E)  # r[a] columns
    sb = n + E + np.arange(E)  # s[b] columns
    ones, experts = np.ones(n), np.arange(E)
    rows = Rows()
    # per a over its copies at l (its successors' loads), then per b over its copies at l+1
    for of_pair, own, weights, cap in ((a, ra, weight_to[b], cap_to), (b, sb, weight_from[a], cap_from)):
        rows.add_block(np.concatenate([of_pair, experts]), np.concatenate([cols, own]),
                       np.concatenate([ones, np.full(E, -Q)]), -np.inf, 0.0, E)
        rows.add_block(np.concatenate([of_pair, experts]), np.concatenate([cols, own]),
                       np.concatenate([weights, np.full(E, -cap)]), -np.inf, 0.0, E)
    slots = float(Q * partitions)
    rows.add(cols, ones, -np.inf, float(partitions * Q * Q))
    rows.add(ra, np.ones(E), slots, slots)
    rows.add(sb, np.ones(E), slots, slots)
    if token_caps is not None:
        rows.add_block(a, cols, c, -np.inf, token_caps, E)
    A, lo, hi = rows.matrix(n + 2 * E)
    lower = np.concatenate([np.zeros(n), np.ones(2 * E)])
    upper = np.concatenate([np.ones(n), np.full(2 * E, float(max_replicas))])
    cost = np.concatenate([-c, np.zeros(2 * E)])
    result = solve_milp(cost, A, lo, hi, lower, upper, np.zeros(n + 2 * E, dtype=bool), time_limit=time_limit,
                        iteration_limit=iteration_limit)
    return _cross_transitions(result, c)


def replica_capped_matching_bound(counts: np.ndarray, load_from: np.ndarray, load_to: np.ndarray, cap_from: float,
                                  cap_to: float, slots_per_partition: int, partitions: int, max_replicas: int,
                                  iteration_limit: int = None, time_limit: float = 10.0,
                                  token_caps: np.ndarray = None) -> float:
    """`capped_matching_bound` with each expert's copy count chosen in the LP; None if the LP stops early.

    Why: with replicas, `capped_matching_bound` must charge every copy the load of an expert with
    the most copies (load / max_replicas), so a hot expert looks light and the load rows bind no
    more (on the corpus the bound said every transition could be local, gap 0.999). Here the copy
    count is a choice: z_to[b, k] = 1 when b has k copies at l+1 (relaxed to [0, 1], one k per
    expert, copies summing to the slots per layer), and the share y[a, b] of a -> b transitions
    kept local is split by that choice, y[a, b] = sum_k y[a, b, k] with y[a, b, k] <= z_to[b, k];
    a copy of b then weighs load_to[b] / k. The same split by a's copy count j (x[a, b, j] <=
    z_from[a, j], weight load_from[a] / j) serves the column rows. Rows, per a and per b:
      sum_b y[a, b] <= Q r[a],  sum_{b, k} (load_to[b] / k) y[a, b, k] <= cap_to r[a],  r[a] = sum_j j z_from[a, j]
    (a's r[a] copies share their GPUs with Q experts of l+1 each, whose loads fit under the cap;
    every local successor shares a GPU with one of them), the same per b, and sum y <= P Q^2.
    An integral placement is a point of this LP (z from its copy counts, y its local shares), so
    the LP's optimum bounds its local transitions from above. Columns: (2 max_replicas + 1) per
    observed pair. With `token_caps` (`source_token_caps`), also sum_{b, k} c[a, b] y[a, b, k] <=
    token_caps[a]: a's tokens keep at most that many choices local, whichever copies they use."""
    E, a, b, c = _observed_pairs(counts)
    n = len(c)
    if n == 0:
        return 0.0
    K = max(1, int(max_replicas))
    Q = slots_per_partition
    ks = np.arange(1, K + 1, dtype=np.float64)
    # columns: y[i, k] (n K), x[i, j] (n K), z_to[b, k] (E K), z_from[a, j] (E K)
    y0, x0 = 0, n * K
    zt0, zf0 = 2 * n * K, 2 * n * K + E * K
    ncols = 2 * n * K + 2 * E * K
    pair = np.repeat(np.arange(n), K)  # pair of each y / x column
    k_of = np.tile(np.arange(K), n)
    y_cols = y0 + np.arange(n * K)
    x_cols = x0 + np.arange(n * K)
    rows = Rows()
    # y[i, k] - z_to[b_i, k] <= 0 ; x[i, j] - z_from[a_i, j] <= 0
    idx = np.arange(n * K)
    rows.add_block(np.concatenate([idx, idx]), np.concatenate([y_cols, zt0 + b[pair] * K + k_of]),
        np.concatenate([np.ones(n * K), -np.ones(n * K)]), -np.inf, 0.0, n * K)
    rows.add_block(np.concatenate([idx, idx]), np.concatenate([x_cols, zf0 + a[pair] * K + k_of]),
        np.concatenate([np.ones(n * K), -np.ones(n * K)]), -np.inf, 0.0, n * K)
    # sum_k y[i, k] - sum_j x[i, j] = 0 ; sum_k y[i, k] <= 1
    rows.add_block(np.concatenate([pair, pair]), np.concatenate([y_cols, x_cols]), np.concatenate([np.ones(n * K), -np.ones(n * K)]),
        0.0, 0.0, n)
    rows.add_block(pair, y_cols, np.ones(n * K), -np.inf, 1.0, n)
    # one copy count per expert, copies summing to the slots
    experts_k = np.repeat(np.arange(E), K)
    for z0 in (zt0, zf0):
        rows.add_block(experts_k, z0 + np.arange(E * K), np.ones(E * K), 1.0, 1.0, E)
        rows.add_block(np.zeros(E * K, dtype=int), z0 + np.arange(E * K), np.tile(ks, E), float(Q * partitions), float(Q * partitions), 1)
    # per a: successors and their loads under a's copies
    rows.add_block(np.concatenate([a[pair], experts_k]), np.concatenate([y_cols, zf0 + np.arange(E * K)]),
        np.concatenate([np.ones(n * K), -Q * np.tile(ks, E)]), -np.inf, 0.0, E)
    rows.add_block(np.concatenate([a[pair], experts_k]), np.concatenate([y_cols, zf0 + np.arange(E * K)]),
        np.concatenate([load_to[b[pair]] / ks[k_of], -cap_to * np.tile(ks, E)]), -np.inf, 0.0, E)
    # per b: predecessors and their loads under b's copies
    rows.add_block(np.concatenate([b[pair], experts_k]), np.concatenate([x_cols, zt0 + np.arange(E * K)]),
        np.concatenate([np.ones(n * K), -Q * np.tile(ks, E)]), -np.inf, 0.0, E)
    rows.add_block(np.concatenate([b[pair], experts_k]), np.concatenate([x_cols, zt0 + np.arange(E * K)]),
        np.concatenate([load_from[a[pair]] / ks[k_of], -cap_from * np.tile(ks, E)]), -np.inf, 0.0, E)
    # co-located pairs
    rows.add_block(np.zeros(n * K, dtype=int), y_cols, np.ones(n * K), -np.inf, float(partitions * Q * Q), 1)
    if token_caps is not None:
        rows.add_block(a[pair], y_cols, c[pair], -np.inf, token_caps, E)
    A, lo, hi = rows.matrix(ncols)
    cost = np.zeros(ncols)
    cost[y_cols] = -c[pair]
    result = solve_milp(cost, A, lo, hi, np.zeros(ncols), np.ones(ncols),
                        np.zeros(ncols, dtype=bool), time_limit=time_limit, iteration_limit=iteration_limit)
    return _cross_transitions(result, c)


def capped_transition_lower_bound(counts: np.ndarray, loads: np.ndarray, caps: np.ndarray, partitions: int,
                                  slots_per_partition: int, max_replicas: int = 1,
                                  budget: WorkBudget = None, token_caps: np.ndarray = None) -> tuple[float, str]:
    """(lower bound on cross-GPU transitions of any placement meeting the per-layer caps, method).

    Per layer pair the largest of the counting and dual bounds, the matching LP without the cap
    (within `LP_COLUMNS` observed pairs) and `capped_matching_bound` (within
    `CAPPED_LP_COLUMNS`: every pair at 8-GPU scale, the first few at DeepSeek-V3's); without
    replicas and where its exact pricing fits the work budget (16 experts on 8 GPUs, not 64), the
    whole-column bound of `chain.py` too, which sees that a GPU's experts at l serve both
    pairs (l-1, l) and (l, l+1). token_caps: optional float [L-1, E] (`source_token_caps`), used
    by the counting bound and the capped LPs."""
    budget = budget or WorkBudget()
    Q = slots_per_partition
    row_cap = min(counts.shape[1], Q * max(1, max_replicas))
    pair_cap = partitions * Q ** 2
    pair_token_caps = [None] * len(counts) if token_caps is None else token_caps
    bounds = [max(counting_bound(c, row_cap, row_cap, pair_token_caps[i]), dual_bound(c, row_cap, row_cap))
              for i, c in enumerate(counts)]
    per_copy = loads / max(1, max_replicas)
    columns_left = budget.scaled(LP_COLUMNS)
    capped_left = budget.scaled(CAPPED_LP_COLUMNS)
    capped = 0
    for i, c in enumerate(counts):
        n = int(np.count_nonzero(c))
        columns_left -= n
        if columns_left < 0 or budget.expired():
            break
        iterations = budget.scaled(max(10_000, LP_ITERATIONS_PER_COLUMN * n))
        values = [matching_bound(c, row_cap, row_cap, pair_cap, budget.seconds_left(), iterations)]
        capped_left -= n
        if max_replicas > 1:  # the copy counts chosen in the LP: (2 max_replicas + 1) columns per pair
            capped_left -= 2 * max_replicas * n
        if capped_left >= 0:
            values.append(capped_matching_bound(c, per_copy[i], per_copy[i + 1], caps[i], caps[i + 1], Q, partitions,
                                                max(1, max_replicas), iterations, budget.seconds_left(), pair_token_caps[i]))
            if max_replicas > 1:
                values.append(replica_capped_matching_bound(c, loads[i], loads[i + 1], caps[i], caps[i + 1], Q,
                                                            partitions, max_replicas,
                                                            budget.scaled(max(10_000, LP_ITERATIONS_PER_COLUMN * 2 * max_replicas * n)),
                                                            budget.seconds_left(), pair_token_caps[i]))
            capped += values[-1] is not None
        for value in values:
            if value is not None:
                bounds[i] = max(bounds[i], value)
    method = ("b-matching LP with load caps" if capped == len(counts)
              else f"b-matching LP with load caps on {capped}/{len(counts)} layer pairs, without elsewhere")
    if token_caps is not None and np.any(token_caps < counts.sum(axis=2) - 1e-9):
        method += ", per-token caps"
    pairwise = float(sum(bounds))
    # without replicas only: with them, the column LP (a copy weighs at least load / max_replicas)
    # found every transition local on the corpus case it fits (mixtral-16x2-s1: 4 of 163,840)
    chain = chain_configuration_bound(counts, loads, caps, partitions, Q, 1, budget) if max_replicas <= 1 else None
    if chain is not None and chain > pairwise:  # both are valid: the larger holds
        # the label placement.json records; it keeps the module's former name so that plans keep their bytes
        return chain, "whole-GPU-column configuration bound (chain_bound.py)"
    return pairwise, method
