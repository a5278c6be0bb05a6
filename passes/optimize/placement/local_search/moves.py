"""The local-search moves, in one place: what an exchange and a re-slot are, which are allowed, and
applying them; and the steepest exchange searches every layer step uses.

A layer's placement is `assign` [n, P]: copies of expert e on partition p (bool hosts [E, D] at GPU
level, or int counts of a node split). A *unit* is an (expert, partition) cell holding copies, in
np.nonzero order. Moves:
* exchange: unit i's copy (e_i on p_i) and unit j's copy (e_j on p_j) trade partitions; allowed when
  the partitions and experts differ and each target stays within the expert's per-partition limit
  (1 for bool hosts: the target does not hold the expert yet) (`exchange_units`, `exchange`);
* re-slot (`reslot.py`): a redundant copy of a on p is dropped and b, absent from p, gets one there
  (`reslot_copy`): replica counts become r_a - 1 and r_b + 1.
Who evaluates them: the staged ILP's steps and GPU sweeps (`steepest_exchanges`, `repair_exchanges`
on even-split gain tables), the routed steps at scale (`routed.routed_swaps`), the re-slot search
(`reslot.py`) and the held-out repair (`held_out_repair.py`), each with its own value.

Steepest exchanges keep their pair tables up to date move by move. Why: each move picks the best
exchange of two units over all U x U pairs. Recomputing every pair's gain and feasibility for each
move (several U x U gathers) took 41 of the 90 CPU s of a DeepSeek-V3 x 64 GPU solve. An exchange
moves two units to each other's partition; only their rows and columns of the gain table change,
and the feasibility table changes only for units of the two experts involved. So the tables are
kept and patched; only the load test (two partitions' loads changed) is redone per move, as two
broadcast comparisons. Same moves and ties as recomputing everything (`pair_tables`): the same
float expressions (so bit-identical gains), and units kept in (expert, partition) order, the order
np.nonzero gives, so argmax breaks ties alike. When an exchange changes which (expert, partition)
cells are occupied in another way than moving two single copies (an expert with several copies on
one partition), the tables are rebuilt from scratch.
"""
from __future__ import annotations

import numpy as np


def exchange_allowed(assign, limit, e_a, p_a, e_b, p_b) -> np.ndarray:
    """bool [len(e_a), len(e_b)]: may unit (e_a, p_a) exchange with unit (e_b, p_b)? Distinct partitions and
    experts, and each expert within its per-partition limit (int [n]) on the other's partition."""
    ok = (p_a[:, None] != p_b[None, :]) & (e_a[:, None] != e_b[None, :])
    ok &= assign[e_a[:, None], p_b[None, :]] < limit[e_a][:, None]
    ok &= assign[e_b[None, :], p_a[:, None]] < limit[e_b][None, :]
    return ok


def exchange_units(assign, limit=None) -> tuple:
    """(e [U], p [U], allowed bool [U, U]): the units of a layer and which pairs may exchange; limit
    None: one copy per partition (bool hosts)."""
    limit = np.ones(assign.shape[0], dtype=np.int64) if limit is None else limit
    e, p = np.nonzero(assign)  # one unit per (expert, partition) holding it
    return e, p, exchange_allowed(assign, limit, e, p, e, p)


def exchange(assign, e, p, f, q) -> None:
    """In place: e's copy on p and f's copy on q trade partitions (bool hosts or int counts)."""
    _move_copy(assign, e, p, q)
    _move_copy(assign, f, q, p)


def reslot_copy(assign, a, b, p) -> None:
    """In place: drop a's copy on partition p, give b a copy there (bool hosts)."""
    assign[a, p] = False
    assign[b, p] = True


def _move_copy(assign, expert, source, target) -> None:
    if assign.dtype == bool:
        assign[expert, source], assign[expert, target] = False, True
    else:
        assign[expert, source] -= 1
        assign[expert, target] += 1


def pair_tables(gain, assign, limit, loads):
    """Every exchange of two units (i = e_i on p_i, j = e_j on p_j): (e, p, gain [i, j], load shift
    on p_i [i, j], allowed [i, j]: `exchange_allowed`)."""
    e, p, ok = exchange_units(assign, limit)
    delta = gain[e[:, None], p[None, :]] - gain[e, p][:, None] + gain[e[None, :], p[:, None]] - gain[e, p][None, :]
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
        exchange(assign, ei, pi, ej, pj)
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
        e, p = self.e, self.p
        ok = exchange_allowed(self.assign, self.limit, e[rows], p[rows], e, p)
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
    """Steepest-ascent exchanges: move one copy of e from p to q and one of f from q to p while that
    gains (gain float [n, P]: the value of each expert on each partition) and keeps both partitions
    under the cap (loads float [n]: per copy) and within the per-partition limit (int [n]); at most
    `max_rounds` moves. Deterministic (ties: lowest index); returns the new int [n, P] assign."""
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
    """Exchanges that cut the load over the cap most (ties: most gain), until the layer fits or no
    exchange cuts its overload (arguments as `steepest_exchanges`).

    Why: at 64-GPU scale a node's replicas, packed onto its GPUs, often miss the per-GPU cap by a
    little; finding a fitting start by exchanges takes milliseconds where the step MIP spends
    seconds at its root."""
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
