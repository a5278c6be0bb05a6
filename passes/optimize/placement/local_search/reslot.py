"""GPU-level local search that also moves redundant slots from one expert to another.

Why: the staged ILP fixes each expert's replica count before it places anything (EPLB's rule:
redundant slots go to the highest load per replica). Under a tight load cap that choice binds: a
copy splits its expert's load evenly over the copies, so *which* expert holds a redundant slot
decides what fractions of load can move between GPUs, and the copy also makes the expert local
to a second GPU's tokens. This pass improves a placement layer by layer (all other layers fixed)
with two moves (`moves.py`):
  * exchange: a copy of e on GPU p and a copy of f on GPU q trade places;
  * re-slot: a redundant copy of a on p (a has >= 2 copies) is dropped and b, absent from p,
    gets a copy there: replica counts become r_a - 1 and r_b + 1, so every GPU hosting a or b
    sees its load change.
Value: the ILP's even-split model, local transitions at GPU level plus at node level (ExFlow's
two stages, equally weighted). Per layer it is a sum of per-expert terms, so a move's gain is
the change of two experts' rows. Moves must keep every GPU under its layer's cap; a layer that
starts over its cap first takes the moves that cut its overload most (ties: most value), so a
placement found under a looser cap can be repaired to a tighter one.
Deterministic: steepest moves, ties to the lowest index, a move budget scaled by --effort.
"""
from __future__ import annotations

import numpy as np

from moeplan.passes.optimize.placement.budget import WorkBudget
from moeplan.passes.optimize.placement.even_split import layer_gain_tables
from moeplan.passes.optimize.placement.local_search.moves import exchange, exchange_units, reslot_copy
from moeplan.passes.optimize.placement.metrics import max_gpu_loads, over_cap_layers

MOVES_PER_LAYER = 400  # at effort 1
MAX_SWEEPS = 6  # at effort 1; sweeps stop early once a whole sweep gains nothing
OVERLOAD_WEIGHT = 1e6  # one token of overload outweighs any locality gain


def reslot_search(hosts: np.ndarray, counts: np.ndarray, loads: np.ndarray, caps: np.ndarray, gpus_per_node: int,
                  budget: WorkBudget = None, max_replicas: int = None, exchanges: bool = True,
                  moves_per_layer: int = MOVES_PER_LAYER, sweeps: int = MAX_SWEEPS) -> tuple:
    """Improve bool [L, E, D] hosts (a copy is returned). Returns (hosts, moves made).

    exchanges=False takes re-slot moves only (at 64-GPU scale, where `gpu_sweeps.py` does the exchanges);
    moves_per_layer and sweeps are per-layer and whole-pass limits at effort 1."""
    budget = budget or WorkBudget()
    hosts = hosts.copy()
    L, E, D = hosts.shape
    max_replicas = D if max_replicas is None else max_replicas
    moves = 0
    for sweep in range(budget.scaled(sweeps)):
        made = 0
        order = range(L) if sweep % 2 == 0 else reversed(range(L))
        for l in order:
            if budget.expired():
                return hosts, moves
            gains = layer_gain_tables(hosts, counts, l, gpus_per_node)
            made += _improve_layer(hosts[l], gains, loads[l], caps[l], gpus_per_node, max_replicas,
                                   budget.scaled(moves_per_layer), exchanges)
        moves += made
        if made == 0:
            break
    return hosts, moves


def _row_values(rows, experts, gains, G):
    """Value of candidate rows (bool [M, D]) for experts [M] under the layer's gain tables."""
    in_g, out_g, in_n, out_n = gains
    M, D = rows.shape
    f = rows.astype(float)
    r = np.maximum(f.sum(axis=1), 1.0)
    copies = f.reshape(M, D // G, G).sum(axis=2)
    value = (f * in_g[experts]).sum(axis=1) + (f * out_g[experts]).sum(axis=1) / r
    value += ((copies > 0) * in_n[experts]).sum(axis=1) + (copies * out_n[experts]).sum(axis=1) / r
    return value


def _overload(device_load, cap):
    return np.clip(device_load - cap, 0.0, None).sum(axis=-1)


def _improve_layer(x, gains, load, cap, G, max_replicas, max_moves, exchanges: bool = True) -> int:
    """Steepest exchanges / re-slots on one layer's bool [E, D] (in place). Returns moves made."""
    E, D = x.shape
    experts = np.arange(E)
    made = 0
    for _ in range(max_moves):
        r = x.sum(axis=1)
        per_copy = load / r
        device_load = per_copy @ x
        over = _overload(device_load, cap)
        base = _row_values(x, experts, gains, G)
        best = (1e-9, None)
        if exchanges:
            best = _best_exchange(x, gains, base, per_copy, device_load, cap, over, G, best)
        best = _best_reslot(x, gains, base, load, r, device_load, cap, over, G, max_replicas, best)
        if best[1] is None:
            break
        best[1]()
        made += 1
    return made


def _best_exchange(x, gains, base, per_copy, device_load, cap, over, G, best):
    E, D = x.shape
    e, p, allowed = exchange_units(x)  # one unit per copy, and the pairs that may trade
    U = len(e)
    # moved[i, q]: value change of expert e_i when its copy on p_i goes to q
    rows = np.repeat(x[e], D, axis=0).reshape(U, D, D)
    rows[np.arange(U), :, p] = False
    rows[:, np.arange(D), np.arange(D)] = True
    moved = _row_values(rows.reshape(U * D, D), np.repeat(e, D), gains, G).reshape(U, D) - base[e][:, None]
    delta = np.where(allowed, moved[:, p] + moved[:, p].T, -np.inf)  # [i, j]: e_i -> p_j and e_j -> p_i
    shift = per_copy[e][None, :] - per_copy[e][:, None]  # load change on p_i
    new_p = device_load[p][:, None] + shift
    new_q = device_load[p][None, :] - shift
    old = np.clip(device_load[p] - cap, 0, None)
    new_over = over - old[:, None] - old[None, :] + np.clip(new_p - cap, 0, None) + np.clip(new_q - cap, 0, None)
    merit = _merit(delta, new_over, over)
    i, j = np.unravel_index(int(np.argmax(merit)), merit.shape)
    if merit[i, j] > best[0]:
        def apply(i=i, j=j):
            exchange(x, e[i], p[i], e[j], p[j])
        return (float(merit[i, j]), apply)
    return best


def _best_reslot(x, gains, base, load, r, device_load, cap, over, G, max_replicas, best):
    E, D = x.shape
    a, p = np.nonzero(x & (r >= 2)[:, None])  # droppable copies
    if len(a) == 0:
        return best
    # value change of dropping each droppable copy, and of adding a copy of b on q
    drop_rows = x[a].copy()
    drop_rows[np.arange(len(a)), p] = False
    drop_gain = _row_values(drop_rows, a, gains, G) - base[a]
    add_rows = np.repeat(x, D, axis=0).reshape(E, D, D)
    add_rows[:, np.arange(D), np.arange(D)] = True
    add_gain = _row_values(add_rows.reshape(E * D, D), np.repeat(np.arange(E), D), gains, G).reshape(E, D) - base[:, None]
    can_add = ~x & (r < max_replicas)[:, None]
    # load change vectors [., D]: dropping a's copy on p; adding b's copy on q
    drop_load = x[a] * (load[a] / (r[a] - 1) - load[a] / r[a])[:, None]
    drop_load[np.arange(len(a)), p] = -load[a] / r[a]
    add_load = x * (load / (r + 1) - load / r)[:, None]  # [E, D] change on b's other hosts, per q below
    delta = drop_gain[:, None] + np.where(can_add[:, p].T, add_gain[:, p].T, -np.inf)  # [i, b]
    delta = np.where(a[:, None] == np.arange(E)[None, :], -np.inf, delta)
    new_load = device_load[None, None, :] + drop_load[:, None, :] + add_load[None, :, :]
    new_load[np.arange(len(a)), :, p] += (load / (r + 1))[None, :]
    new_over = _overload(new_load, cap)
    merit = _merit(delta, new_over, over)
    i, b = np.unravel_index(int(np.argmax(merit)), merit.shape)
    if merit[i, b] > best[0]:
        def apply(i=i, b=b):
            reslot_copy(x, a[i], b, p[i])
        return (float(merit[i, b]), apply)
    return best


def _merit(delta, new_over, over):
    """Value gain minus weighted overload change; moves that add overload are never taken."""
    tol = 1e-9 * max(1.0, float(over))
    merit = delta - OVERLOAD_WEIGHT * (new_over - over)
    return np.where((new_over <= over + tol) & np.isfinite(delta), merit, -np.inf)


TIGHTEN_STEPS = 12  # caps on the way from the start's loads to the target, finer near the target


def tighten(hosts: np.ndarray, counts: np.ndarray, loads: np.ndarray, caps: np.ndarray, gpus_per_node: int,
            budget: WorkBudget = None, max_replicas: int = None, steps: int = TIGHTEN_STEPS) -> tuple:
    """Walk a placement found under a loose cap (or none) down to `caps`, re-slotting at each step.

    Why: repairing straight to a tight cap takes whatever moves cut the overload, often giving up
    the affinity structure; lowering the cap a little at a time lets each step keep most of it
    (measured: 0.47 -> 0.51 GPU-local on the planted 8-GPU trace at EPLB's balance). Caps per layer
    go from the start's max GPU load to the target as (1 - k / steps)^2. Returns (hosts, moves,
    layers still over their cap, which the caller must replace)."""
    budget = budget or WorkBudget()
    excess = np.maximum(max_gpu_loads(hosts, loads) - caps, 0.0)
    moves = 0
    for k in range(1, steps + 1):
        step_caps = caps + excess * (1.0 - k / steps) ** 2
        hosts, made = reslot_search(hosts, counts, loads, step_caps, gpus_per_node, budget, max_replicas)
        moves += made
    return hosts, moves, over_cap_layers(hosts, loads, caps)
