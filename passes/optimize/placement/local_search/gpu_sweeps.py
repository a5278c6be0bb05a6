"""GPU-level exchange sweeps: the placement search at DeepSeek-V3 scale (64 GPUs, replicas).

Why: at this scale the staged search (`algorithms/ilp.py`: nodes first, then each node's GPUs) cannot run
its step MIPs, so each step is a priced transportation LP plus exchanges, and a node split found
under the node cap (8 x the GPU cap) often does not pack onto the node's GPUs under a tight GPU
cap: the stage loop retried up to 8 times, and at a cap of 1.03 x mean (what a held-out max/mean
of 1.10 needs, `held_out.py`) it spent 84 CPU s for 0.039 GPU-local held-out on the DeepSeek
drift trace and 0.087 on the planted one. Exchanges between GPUs directly, valued with the GPU
and the node terms of the stages' even-split objective (equally weighted, as `reslot.py` does),
found 0.042 and 0.186 in about 15 CPU s from EPLB's balanced packing.

Each sweep visits the layers (alternating direction) and improves one layer with all others
fixed: its gain table g[e, p] = in_g[e, p] + out_g[e, p] / r[e] + in_n[e, node(p)] +
out_n[e, node(p)] / r[e] (`even_split.layer_gain_table`; the node terms charged per copy, exact for
an expert with one copy per node), a layer over its cap first takes the exchanges that cut its
overload most (`moves.repair_exchanges`), then steepest exchanges under the cap
(`moves.steepest_exchanges`). Replica counts stay as given. Sweeps stop when one gains nothing.
Deterministic: work limits (sweeps, moves per layer) scaled by --effort.
"""
from __future__ import annotations

import numpy as np

from moeplan.passes.optimize.placement.budget import WorkBudget
from moeplan.passes.optimize.placement.even_split import layer_gain_table, placement_value
from moeplan.passes.optimize.placement.local_search.moves import repair_exchanges, steepest_exchanges

SWEEPS = 12  # at effort 1; the drift and planted DeepSeek-V3 traces stop gaining (< 0.1% a sweep) by about 10
WALK_SWEEPS = 3  # at effort 1, per held-out round over the layers whose caps were lowered (`algorithms/ilp.staged_placement`)
MOVES_PER_LAYER = 400  # exchanges per layer step at effort 1


def gpu_sweeps(hosts: np.ndarray, counts: np.ndarray, loads: np.ndarray, caps: np.ndarray, gpus_per_node: int,
               budget: WorkBudget = None, layers=None, sweeps: int = SWEEPS) -> tuple:
    """Improve bool [L, E, D] hosts (a copy is returned) under float [L] caps; `layers`: the layers
    to visit (default all); `sweeps`: at most this many at effort 1. Returns (hosts, sweeps run)."""
    budget = budget or WorkBudget()
    hosts = hosts.copy()
    L, E, D = hosts.shape
    visit = np.arange(L) if layers is None else np.asarray(sorted(layers), dtype=np.int64)
    moves = budget.scaled(MOVES_PER_LAYER)
    one = np.ones(E, dtype=np.int64)
    previous = None
    limit, sweeps = budget.scaled(sweeps), 0
    for sweep in range(limit):
        for l in (visit if sweep % 2 == 0 else visit[::-1]):
            if budget.expired():
                return hosts, sweeps
            gain = layer_gain_table(hosts, counts, int(l), gpus_per_node)
            per_copy = loads[l] / hosts[l].sum(axis=1)
            x = hosts[l].astype(np.int64)
            if (per_copy @ x).max() > caps[l] * (1 + 1e-9):
                x = repair_exchanges(gain, x, one, per_copy, caps[l], moves)
            if (per_copy @ x).max() <= caps[l] * (1 + 1e-9):
                x = steepest_exchanges(gain, x, one, per_copy, caps[l], moves)
            hosts[l] = x > 0
        sweeps += 1
        value = placement_value(counts, hosts)
        if previous is not None and value <= previous * (1 + 1e-9):
            break
        previous = value
    return hosts, sweeps
