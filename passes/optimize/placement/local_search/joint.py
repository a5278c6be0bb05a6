"""ExFlow's joint placement ILP (Eqs. 8-12) on aggregated counts, over windows of layers.

Why: the per-layer sweeps of the staged ILP (`algorithms/ilp_stages.py`) fix all other layers at each step; the joint model
optimises several consecutive layers at once, so it can move a whole chain of affine experts
together. It follows ExFlow with one cross indicator per *observed* expert pair (not per token):
    minimise  sum_l sum_(a,b) c[l,a,b] * y[l,a,b]  -  boundary gains
    y[l,a,b] >= x[l,a,p] - x[l+1,b,p]     for every partition p
    sum_p x[l,e,p] = 1,  sum_e x[l,e,p] = slots_p,  sum_e load[l,e] x[l,e,p] <= cap[l]
Layers outside the window stay fixed and enter as linear gains at its edges; a window covering
every layer is the monolithic model, where one expert is pinned to partition 0 (partitions are
interchangeable, so this removes symmetric copies of every solution). Used without replicas
(each expert on exactly one partition of the level being solved), warm-started from the sweeps'
result and accepted only when it improves it. Every window is solved (their number follows from
the model size), each with a branch-and-bound node limit scaled by --effort: a work limit, so the
result does not depend on machine load (the time limit only guards against runaway solves). The
polish runs from --effort 2: its root LP work is not bounded by the node limit and costs seconds
per window.
"""
from __future__ import annotations

import numpy as np

from moeplan.passes.optimize.milp import Rows, solve_milp

MAX_MODEL_NONZEROS = 3_000  # per window at effort 1: bigger joint models take tens of seconds whatever the node limit
JOINT_MIN_EFFORT = 2.0  # HiGHS's root work on these models (cuts, heuristics) is not bounded by a node
# limit: ~10 s per window even on the example model, so the polish runs only when asked for work
JOINT_NODE_LIMIT = 20  # per window at effort 1: each node re-solves an LP with a row per pair and partition


def polish_windows(problem, assign: np.ndarray, to_place: np.ndarray, slots: np.ndarray, caps: np.ndarray) -> dict:
    """Improve assign (int [L, E, P], 0/1, updated in place) window by window."""
    L, E, P = assign.shape
    if problem.budget.effort < JOINT_MIN_EFFORT or np.any(to_place > 1) or np.any(problem.replicas > 1):
        return {"windows": 0, "gained": 0.0}
    pairs = [int(np.count_nonzero(problem.counts[l][np.ix_(to_place[l] > 0, to_place[l + 1] > 0)])) for l in range(L - 1)]
    windows = []
    first = 0
    while first < L:
        last, size = first, 0
        while last + 1 < L and size + pairs[last] * (2 * P + 1) <= problem.budget.scaled(MAX_MODEL_NONZEROS):
            size += pairs[last] * (2 * P + 1)
            last += 1
        if last == first:  # even one layer pair is too big for a joint model: the sweeps handle it
            first += 1
            continue
        windows.append((first, last))
        if last == L - 1:
            break
        first = last  # windows overlap by one layer so chains can move across their edges
    gained = 0.0
    solved = 0
    for first, last in windows:
        if problem.budget.expired():
            break
        gained += _solve_window(problem, assign, to_place, slots, caps, first, last)
        solved += 1
    return {"windows": solved, "of": len(windows), "gained": gained}


def assignment_rows(rows: Rows, base: int, loads: np.ndarray, slots: np.ndarray, cap: float) -> None:
    """One layer's rows of a GPU-indexed model, x[j, p] at column base + j P + p for its experts j
    (loads float [n]) on GPUs p (slots float [P]): each expert on one GPU, each GPU full, its load
    within the cap. Shared with benchmarks/research/pair_milp.py."""
    P, n = len(slots), len(loads)
    for j in range(n):
        rows.add(base + j * P + np.arange(P), np.ones(P), 1.0, 1.0)
    for p in range(P):
        members = base + p + np.arange(n) * P
        rows.add(members, np.ones(n), float(slots[p]), float(slots[p]))
        rows.add(members, loads, -np.inf, float(cap))


def _solve_window(problem, assign, to_place, slots, caps, first, last) -> float:
    L, E, P = assign.shape
    counts = problem.counts
    members = [np.flatnonzero(to_place[l] > 0) for l in range(first, last + 1)]
    offsets = np.cumsum([0] + [len(m) * P for m in members])
    n_x = int(offsets[-1])
    column_of = {}
    for i, m in enumerate(members):
        for j, e in enumerate(m):
            column_of[(first + i, int(e))] = offsets[i] + j * P
    cost = [np.zeros(n_x)]
    # boundary gains from the fixed neighbours
    if first > 0:
        share = assign[first - 1] / problem.replicas[first - 1][:, None]
        gain = counts[first - 1][:, members[0]].T @ share
        cost[0][offsets[0]:offsets[1]] -= gain.ravel()
    if last < L - 1:
        present = (assign[last + 1] > 0).astype(float)
        gain = counts[last][members[-1]] @ present
        cost[0][offsets[-2]:offsets[-1]] -= gain.ravel()
    rows = Rows()
    for i, m in enumerate(members):
        l = first + i
        assignment_rows(rows, offsets[i], problem.loads[l][m] / problem.replicas[l][m], slots, caps[l])
    y_cost = []
    y_pairs = []
    n_y = 0
    for i in range(len(members) - 1):
        l = first + i
        sub = counts[l][np.ix_(members[i], members[i + 1])]
        a_idx, b_idx = np.nonzero(sub)
        for a_j, b_j, c in zip(a_idx, b_idx, sub[a_idx, b_idx]):
            y = n_x + n_y
            xa = offsets[i] + a_j * P
            xb = offsets[i + 1] + b_j * P
            for p in range(P):  # y - x[a,p] + x[b,p] >= 0
                rows.add([y, xa + p, xb + p], [1.0, -1.0, 1.0], 0.0, np.inf)
            y_cost.append(c)
            y_pairs.append((xa, xb))
            n_y += 1
    n = n_x + n_y
    c_vec = np.concatenate([cost[0], np.asarray(y_cost, dtype=float)])
    A, lo, hi = rows.matrix(n)
    lower = np.zeros(n)
    upper = np.ones(n)
    integer = np.concatenate([np.ones(n_x, dtype=bool), np.zeros(n_y, dtype=bool)])
    # warm start from the current assignment
    x0 = np.concatenate([assign[first + i][m].ravel() for i, m in enumerate(members)]).astype(float)
    whole = first == 0 and last == L - 1
    if whole and len(members[0]):
        # symmetry breaking: relabel partitions so the first expert of the first layer sits on 0, then pin it
        p0 = int(np.argmax(x0[0:P]))
        if p0 != 0 and np.all(slots == slots[0]):
            x0 = x0.reshape(-1, P)
            x0[:, [0, p0]] = x0[:, [p0, 0]]
            x0 = x0.ravel()
        if x0[0] == 1.0:
            lower[0] = 1.0
    y0 = np.array([max(0.0, float((x0[xa:xa + P] - x0[xb:xb + P]).max())) for xa, xb in y_pairs])
    start = np.concatenate([x0, y0])
    before = float(c_vec @ start)
    result = solve_milp(c_vec, A, lo, hi, lower, upper, integer,
                        time_limit=problem.budget.seconds_left(), warm_start=start, solver=problem.solver, mip_gap=1e-4,
                        node_limit=problem.budget.scaled(JOINT_NODE_LIMIT))
    problem.budget.record(result)
    if result.x is None or result.objective >= before - 1e-6:
        return 0.0
    x = np.rint(result.x[:n_x])
    for i, m in enumerate(members):
        assign[first + i][m] = x[offsets[i]:offsets[i + 1]].reshape(len(m), P).astype(np.int64)
    return before - result.objective
