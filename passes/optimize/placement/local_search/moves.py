"""Steepest-ascent exchanges of a layer step, with the pair tables kept up to date move by move.

Why: `ilp.improve_by_swaps` is the layer step's local search (and the routed step's at DeepSeek-V3
scale). Each move picks the best exchange of two units (a unit: an expert's copies on one
partition) over all U x U pairs. Recomputing every pair's gain and feasibility for each move
(several U x U gathers) took 41 of the 90 CPU s of a DeepSeek-V3 x 64 GPU solve. An exchange
moves two units to each other's partition; only their rows and columns of the gain table change,
and the feasibility table changes only for units of the two experts involved. So the tables are
kept and patched; only the load test (two partitions' loads changed) is redone per move, as two
broadcast comparisons.

Same moves and ties as recomputing everything (`pair_tables`): the same float expressions
(so bit-identical gains), and units kept in (expert, partition) order, the order np.nonzero
gives, so argmax breaks ties alike. When an exchange changes which (expert, partition) cells are
occupied in another way than moving two single copies (an expert with several copies on one
partition), the tables are rebuilt from scratch.
"""
from __future__ import annotations

import numpy as np


def pair_tables(gain, assign, limit, loads):
    """Every exchange of two units (i = e_i on p_i, j = e_j on p_j): (e, p, gain [i, j], load shift
    on p_i [i, j], allowed [i, j] by distinct partitions/experts and the per-partition limit)."""
    e, p = np.nonzero(assign)  # one unit per (expert, partition) holding it
    delta = gain[e[:, None], p[None, :]] - gain[e, p][:, None] + gain[e[None, :], p[:, None]] - gain[e, p][None, :]
    ok = (p[:, None] != p[None, :]) & (e[:, None] != e[None, :])
    ok &= assign[e[:, None], p[None, :]] < limit[e][:, None]
    ok &= assign[e[None, :], p[:, None]] < limit[e][None, :]
    shift = loads[e][None, :] - loads[e][:, None]
    return e, p, delta, shift, ok


class ExchangeTables:
    """Units and pair tables of one layer step; `assign` (int [n, P]) is updated in place by `apply`."""

    def __init__(self, gain, assign, limit, loads):
        self.gain, self.assign, self.limit, self.loads = gain, assign, limit, loads
        self.partition_load = loads @ assign
        self.rebuild()

    def rebuild(self) -> None:
        self.e, self.p, self.delta, self.shift, self.ok = pair_tables(self.gain, self.assign, self.limit, self.loads)

    def best(self, cap):
        """(i, j, gain) of the best exchange keeping both partitions under `cap` (gain -inf if none)."""
        load = self.partition_load[self.p]
        limit = cap * (1 + 1e-9)
        ok = self.ok & (load[:, None] + self.shift <= limit) & (load[None, :] - self.shift <= limit)
        merit = np.where(ok, self.delta, -np.inf)
        i, j = divmod(int(np.argmax(merit)), len(self.e))
        return i, j, merit[i, j]

    def apply(self, i: int, j: int) -> None:
        """Exchange unit i's copy (expert e_i on p_i) with unit j's (e_j on p_j) and patch the tables."""
        e, p, assign = self.e, self.p, self.assign
        ei, ej, pi, pj = e[i], e[j], p[i], p[j]
        single = assign[ei, pi] == 1 and assign[ei, pj] == 0 and assign[ej, pj] == 1 and assign[ej, pi] == 0
        assign[ei, pi] -= 1; assign[ei, pj] += 1
        assign[ej, pj] -= 1; assign[ej, pi] += 1
        self.partition_load[pi] += self.loads[ej] - self.loads[ei]
        self.partition_load[pj] += self.loads[ei] - self.loads[ej]
        if not single:
            self.rebuild()
            return
        p[i], p[j] = pj, pi
        self._patch_gains(np.array([i, j]))
        self._patch_feasible(np.flatnonzero((e == ei) | (e == ej)))
        for expert in (ei, ej):
            self._keep_order(np.flatnonzero(e == expert))

    def _patch_gains(self, moved) -> None:
        """Rows and columns of the moved units, by `pair_tables`' expression (bit-identical)."""
        gain, e, p = self.gain, self.e, self.p
        own = gain[e, p]
        self.delta[moved, :] = gain[e[moved][:, None], p[None, :]] - own[moved][:, None] + gain[e[None, :], p[moved][:, None]] - own[None, :]
        self.delta[:, moved] = gain[e[:, None], p[moved][None, :]] - own[:, None] + gain[e[moved][None, :], p[:, None]] - own[moved][None, :]

    def _patch_feasible(self, rows) -> None:
        """Rows (and, by symmetry, columns) of the units whose expert's cells changed."""
        e, p, assign, limit = self.e, self.p, self.assign, self.limit
        ok = (p[rows][:, None] != p[None, :]) & (e[rows][:, None] != e[None, :])
        ok &= assign[e[rows][:, None], p[None, :]] < limit[e[rows]][:, None]
        ok &= assign[e[None, :], p[rows][:, None]] < limit[e][None, :]
        self.ok[rows, :] = ok
        self.ok[:, rows] = ok.T

    def _keep_order(self, block) -> None:
        """One expert's units (contiguous) back into partition order, rows and columns alike."""
        order = np.argsort(self.p[block], kind="stable")
        if np.all(order == np.arange(len(block))):
            return
        source = block[order]
        self.p[block] = self.p[source]
        for table in (self.delta, self.ok):
            table[block, :] = table[source, :]
            table[:, block] = table[:, source]  # shift rows are equal within an expert's block


def steepest_exchanges(gain, assign, limit, loads, cap, max_rounds: int) -> np.ndarray:
    """`ilp.improve_by_swaps` (same moves, same result) on incrementally kept tables."""
    assign = assign.copy()
    tables = ExchangeTables(gain, assign, limit, loads)
    for _ in range(max_rounds):
        if len(tables.e) < 2:
            break
        i, j, value = tables.best(cap)
        if not value > 1e-9:
            break
        tables.apply(i, j)
    return assign


def repair_exchanges(gain, assign, limit, loads, cap, max_rounds: int) -> np.ndarray:
    """`ilp.repair_by_swaps` on incrementally kept tables: each move the exchange that cuts the load
    over the cap most (ties: most gain), until the layer fits or no exchange cuts its overload."""
    assign = assign.copy()
    tables = ExchangeTables(gain, assign, limit, loads)
    for _ in range(max_rounds):
        partition_load = tables.partition_load
        over = np.clip(partition_load - cap, 0, None)
        if over.sum() <= 0 or len(tables.e) < 2:
            break
        p, delta, shift, ok = tables.p, tables.delta, tables.shift, tables.ok
        new_i = np.clip(partition_load[p][:, None] + shift - cap, 0, None)
        new_j = np.clip(partition_load[p][None, :] - shift - cap, 0, None)
        cut = over[p][:, None] + over[p][None, :] - new_i - new_j
        scale = max(float(np.abs(delta[ok]).max(initial=0.0)), 1.0)
        merit = np.where(ok & (cut > 1e-9 * cap), cut * (4.0 * scale / max(float(cut.max()), 1e-12)) + delta, -np.inf)
        i, j = divmod(int(np.argmax(merit)), len(tables.e))
        if not np.isfinite(merit[i, j]):
            break
        tables.apply(i, j)
    return assign
