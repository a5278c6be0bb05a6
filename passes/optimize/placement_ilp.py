"""`ilp`: ExFlow's staged placement (nodes first, then GPUs within each node), extended with a
per-layer load cap and redundant slots, solved by exact per-layer MIPs in block-coordinate sweeps.

Objective (ExFlow Eqs. 8-12 on aggregated counts): maximise the transitions that stay local,
where c[l, a, b] counts tokens whose heaviest expert at l is a and that choose b at l+1
(`affinity.transition_counts`, mode "current": exactly what the metrics count). With replicas a
token of expert a is taken to sit on each of a's replicas with equal share (the same even split
the load metric uses), so with share[l, a, p] = hosts[l, a, p] / r[l, a]:
    local = sum_l sum_{a, b, p} c[l, a, b] * share[l, a, p] * present[l+1, b, p].
Constraints per layer: replicas per expert r[l, e] (chosen like EPLB: redundant slots go to the
highest load per replica), every partition gets its fixed slot count, replicas on distinct
devices, and load <= cap[l] per GPU (G * cap[l] per node in stage 1).

Why coordinate sweeps: fixing every layer but l makes the objective linear in layer l's
variables (one MIP with E x P variables, plus a presence indicator per replicated expert), so
each step is solved exactly and the sweeps never get worse; the joint pair-variable model of
ExFlow (see `placement_joint.py`) then polishes small instances. A valid bound for the whole
problem comes from `placement_bound.py`.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import scipy.sparse as sp

from moeplan.passes.optimize.milp import solve_milp
from moeplan.passes.optimize.placement_eplb import balanced_packing
from moeplan.planner.errors import UserError


MIP_NODE_LIMIT = 200  # branch-and-bound nodes per layer step: a deterministic work limit
MAX_SWEEPS = 8


@dataclass
class LayerProblem:
    """Inputs shared by every per-layer step."""

    counts: np.ndarray  # float [L-1, E, E]
    loads: np.ndarray  # float [L, E] token assignments per expert
    replicas: np.ndarray  # int [L, E]
    caps: np.ndarray  # float [L] per-GPU load cap
    solver: str = "highs"
    notes: list = field(default_factory=list)


def assignment_mip(in_gain, out_gain, replicas, max_per_partition, slots, loads, cap, warm, time_limit, solver, notes):
    """Place one layer's replicas on P partitions maximising in_gain*present + out_gain*count.

    in_gain, out_gain: float [n, P]; replicas: int [n]; slots: int [P] (exact fill);
    loads: float [n] load per replica; cap: float load cap per partition; warm: int [n, P] or None.
    Returns int [n, P] replica counts, or None when the layer is infeasible.
    """
    n, P = in_gain.shape
    if np.all(replicas == 1):
        quick = _assignment_with_penalties(in_gain + out_gain, slots, loads, cap)
        if quick is not None and quick[1]:
            return quick[0], "optimal"  # the uncapped optimum already meets the cap
        if quick is not None and warm is not None:
            gain = in_gain + out_gain
            if (gain * quick[0]).sum() > (gain * warm).sum() and _fits(quick[0], loads, cap):
                warm = quick[0]
    replicated = np.flatnonzero(np.minimum(replicas, max_per_partition) > 1)
    nm = n * P
    nw = len(replicated) * P
    # columns: m[e, p] (row-major), then w[j, p] for replicated experts j
    needs_indicator = np.zeros(n, dtype=bool)
    needs_indicator[replicated] = True
    cost = -(out_gain + np.where(needs_indicator[:, None], 0.0, in_gain)).ravel()
    if nw:
        cost = np.concatenate([cost, -in_gain[replicated].ravel()])
    upper = np.concatenate([np.minimum(replicas, max_per_partition)[:, None].repeat(P, axis=1).ravel(), np.ones(nw)])
    m_index = np.arange(nm).reshape(n, P)
    rows = []
    # sum_p m[e, p] = r_e
    rows.append(sp.csr_matrix((np.ones(nm), (np.repeat(np.arange(n), P), m_index.ravel())), shape=(n, nm + nw)))
    # sum_e m[e, p] = slots_p
    rows.append(sp.csr_matrix((np.ones(nm), (np.tile(np.arange(P), n), m_index.ravel())), shape=(P, nm + nw)))
    # sum_e load_e m[e, p] <= cap
    rows.append(sp.csr_matrix((np.repeat(loads, P), (np.tile(np.arange(P), n), m_index.ravel())), shape=(P, nm + nw)))
    lo = [replicas.astype(float), slots.astype(float), np.full(P, -np.inf)]
    hi = [replicas.astype(float), slots.astype(float), np.full(P, cap)]
    if nw:
        # w[j, p] - m[e_j, p] <= 0
        k = np.arange(nw)
        data = np.concatenate([np.ones(nw), -np.ones(nw)])
        r_idx = np.concatenate([k, k])
        c_idx = np.concatenate([nm + k, m_index[replicated].ravel()])
        rows.append(sp.csr_matrix((data, (r_idx, c_idx)), shape=(nw, nm + nw)))
        lo.append(np.full(nw, -np.inf))
        hi.append(np.zeros(nw))
    A = sp.vstack(rows).tocsc()
    start = None
    if warm is not None:
        w_part = (warm[replicated] > 0).astype(float).ravel() if nw else np.zeros(0)
        start = np.concatenate([warm.astype(float).ravel(), w_part])
    result = solve_milp(cost, A, np.concatenate(lo), np.concatenate(hi), np.zeros(nm + nw), upper,
                        np.ones(nm + nw, dtype=bool), time_limit=time_limit, warm_start=start, solver=solver,
                        mip_gap=1e-2, node_limit=MIP_NODE_LIMIT)
    for note in result.notes:
        if note not in notes:
            notes.append(note)
    if result.x is None:
        return None, result.status
    return np.rint(result.x[:nm]).reshape(n, P).astype(np.int64), result.status


def _fits(assign, loads, cap) -> bool:
    return bool(np.all(loads @ assign <= cap * (1 + 1e-9)))


def _assignment_with_penalties(gain, slots, loads, cap, rounds: int = 30):
    """One replica per expert: a linear assignment of experts to partition slots.

    Without the load cap the layer step is exactly this assignment (an integral transportation
    problem), so if its optimum meets the cap it is the MIP's optimum: returns (assign, True).
    Otherwise the load of overloaded partitions is priced (a Lagrangian penalty raised round by
    round) to find a good assignment that fits, returned as (assign, False) for a warm start;
    None if none fits."""
    from scipy.optimize import linear_sum_assignment

    n, P = gain.shape
    columns = np.repeat(np.arange(P), slots)
    price = np.zeros(P)
    scale = max(float(np.abs(gain).max()), 1e-9) / max(float(loads.max()), 1e-9)
    for round_ in range(rounds):
        value = gain - loads[:, None] * price[None, :]
        rows, cols = linear_sum_assignment(-value[:, columns])
        assign = np.zeros((n, P), dtype=np.int64)
        assign[rows, columns[cols]] = 1
        partition_load = loads @ assign
        if np.all(partition_load <= cap * (1 + 1e-9)):
            return assign, round_ == 0
        over = partition_load > cap
        price = price + scale * 0.25 * (round_ + 1) * over * (partition_load / cap - 1 + 0.05)
    return None


def _objective(counts, share, present):
    """Local transitions under the even-split model, summed over layer pairs."""
    return float(sum(np.einsum("ab,ap,bp->", counts[l], share[l], present[l + 1]) for l in range(len(counts))))


class StageInfeasible(Exception):
    """A per-layer MIP at some level has no solution (the layer index is the argument)."""


def solve_stage(problem: LayerProblem, assign: np.ndarray, to_place: np.ndarray, partition_slots: np.ndarray,
                max_per_partition: int, partition_caps: np.ndarray, deadline: float, per_mip_limit: float):
    """Coordinate sweeps over layers on one level (nodes, or the GPUs of one node).

    assign: int [L, E, P] replica counts per partition (updated in place); to_place: int [L, E],
    the replicas of each expert this level distributes (0 = not this level's). Raises
    `StageInfeasible(l)` when layer l cannot meet its cap. Returns the number of sweeps run.
    """
    L = assign.shape[0]
    replicas = problem.replicas
    counts = problem.counts
    sweeps = 0
    previous = None
    while time.perf_counter() < deadline and sweeps < MAX_SWEEPS:
        order = range(L) if sweeps % 2 == 0 else reversed(range(L))
        for l in order:
            if time.perf_counter() >= deadline:
                break
            experts = np.flatnonzero(to_place[l] > 0)
            if len(experts) == 0:
                continue
            in_gain = np.zeros((len(experts), assign.shape[2]))
            out_gain = np.zeros_like(in_gain)
            if l > 0:
                share_prev = assign[l - 1] / problem.replicas[l - 1][:, None]
                in_gain = counts[l - 1][:, experts].T @ share_prev
            if l < L - 1:
                present_next = (assign[l + 1] > 0).astype(float)
                out_gain = (counts[l][experts] @ present_next) / replicas[l][experts][:, None]
            left = max(deadline - time.perf_counter(), 0.05)
            result, status = assignment_mip(
                in_gain, out_gain, to_place[l][experts], max_per_partition, partition_slots,
                problem.loads[l][experts] / replicas[l][experts], partition_caps[l],
                assign[l][experts], min(per_mip_limit, left), problem.solver, problem.notes)
            if result is None:
                if status == "infeasible":
                    raise StageInfeasible(l)
                continue  # time ran out without an incumbent better than the warm start: keep it
            assign[l][experts] = result
        sweeps += 1
        share = assign / problem.replicas[:, :, None]
        value = _objective(counts, share, (assign > 0).astype(float))
        if previous is not None and value <= previous * (1 + 1e-9):
            break
        previous = value
    return sweeps


def infeasible_layer_error(problem: LayerProblem, layer: int) -> UserError:
    loads = problem.loads[layer] / problem.replicas[layer]
    hottest = int(np.argmax(loads))
    return UserError(
        f"load balance is infeasible at MoE layer {layer}: no placement keeps every GPU's load under the cap "
        f"{problem.caps[layer]:.1f} tokens (hottest expert {hottest} carries {loads[hottest]:.1f} per replica); "
        f"raise --balance or add --redundant slots"
    )


def initial_hosts(loads: np.ndarray, replicas: np.ndarray, devices: int, slots: int) -> np.ndarray:
    """bool [L, E, D]: EPLB-style balanced packing of each layer's replicas (the warm start)."""
    L, E = loads.shape
    hosts = np.zeros((L, E, devices), dtype=bool)
    for l in range(L):
        replica_expert = np.repeat(np.arange(E), replicas[l])
        pack = balanced_packing((loads[l] / replicas[l])[replica_expert], replica_expert, devices, slots)
        hosts[l, replica_expert, pack] = True
    return hosts


BALANCE_BASES = ("mean", "eplb")


def least_max_load(loads: np.ndarray, replicas: np.ndarray, devices: int, slots: int) -> np.ndarray:
    """float [L]: a lower bound on any placement's max GPU load with these replica counts.

    The mean; and the GPU holding the hottest replica, which also holds `slots - 1` replicas of
    other experts, each at least as heavy as the lightest ones."""
    per_replica = loads / replicas
    mean = loads.sum(axis=1) / devices
    order = np.sort(per_replica, axis=1)
    hottest = order[:, -1]
    lightest_others = order[:, : max(slots - 1, 0)].sum(axis=1) if slots > 1 else 0.0
    return np.maximum(mean, hottest + lightest_others)


def layer_caps(loads: np.ndarray, replicas: np.ndarray, devices: int, slots: int, balance: float, base: str) -> np.ndarray:
    """float [L]: per-GPU load cap, (1 + balance) x a per-layer reference load.

    base "mean": the mean device load (ARCHITECTURE's definition). "eplb": the max device load of
    the EPLB-style packing with the same replicas, an achievable value: the cap is then always
    feasible and keeps every layer within `balance` of EPLB's balance."""
    if base == "mean":
        reference = loads.sum(axis=1) / devices
    elif base == "eplb":
        packed = initial_hosts(loads, replicas, devices, slots)
        reference = np.array([(packed[l].T.astype(float) @ (loads[l] / replicas[l])).max() for l in range(len(loads))])
    else:
        raise UserError(f"--balance-base must be one of {BALANCE_BASES}, got {base!r}")
    return (1.0 + balance) * reference


def check_caps(loads: np.ndarray, replicas: np.ndarray, caps: np.ndarray, devices: int, slots: int, balance: float) -> None:
    """Fail early, naming layer and expert, when the hottest replica (with the lightest replicas
    that must share its GPU) already exceeds its layer's cap."""
    least = least_max_load(loads, replicas, devices, slots)
    over = least > caps * (1 + 1e-9)
    if over.any():
        layer = int(np.flatnonzero(over)[0])
        per_replica = loads[layer] / replicas[layer]
        expert = int(np.argmax(per_replica))
        mean = loads[layer].sum() / devices
        need = least[layer] / mean - 1
        raise UserError(
            f"load balance is infeasible at MoE layer {layer}: expert {expert} carries {per_replica[expert]:.0f} "
            f"tokens per replica, so its GPU (with {slots - 1} more experts) holds at least {least[layer]:.0f}, over the cap "
            f"{caps[layer]:.0f} = (1 + {balance:g}) x {'mean ' + format(mean, '.0f') if abs(caps[layer] / (1 + balance) - mean) < 1e-6 * mean else 'reference'}; "
            f"add --redundant slots, or use --balance {need:.3f} or more, or --balance-base eplb"
        )


@dataclass
class StagedSolution:
    hosts: np.ndarray  # bool [L, E, D]
    replicas: np.ndarray  # int [L, E]
    caps: np.ndarray  # float [L]
    counts: np.ndarray  # float [L-1, E, E]
    sweeps: dict
    notes: list


def staged_placement(counts, loads, topology, redundant: int, balance: float, balance_base: str,
                     solver: str, deadline: float, per_mip_limit: float = 1.0) -> StagedSolution:
    """Stage 1 (nodes) then stage 2 (GPUs of each node); see module docstring."""
    from moeplan.passes.optimize.placement_eplb import replica_counts

    L, E = loads.shape
    D, N, G = topology.devices, topology.nodes, topology.gpus_per_node
    slots = (E + redundant) // D
    replicas = np.stack([replica_counts(loads[l], E + redundant, D) for l in range(L)])
    caps = layer_caps(loads, replicas, D, slots, balance, balance_base)
    check_caps(loads, replicas, caps, D, slots, balance)
    problem = LayerProblem(counts, loads, replicas, caps, solver)
    hosts = initial_hosts(loads, replicas, D, slots)
    initial = hosts.copy()
    start = time.perf_counter()
    stage1_deadline = start + 0.45 * max(deadline - start, 0.0)
    sweeps = {}
    node_caps = caps * G
    if N > 1:
        node_assign = hosts.reshape(L, E, N, G).sum(axis=3).astype(np.int64)
        try:
            sweeps["nodes"] = solve_stage(problem, node_assign, replicas, np.full(N, G * slots), G,
                                          node_caps, stage1_deadline, per_mip_limit)
        except StageInfeasible as exc:
            raise infeasible_layer_error(problem, exc.args[0]) from None
    else:
        node_assign = replicas[:, :, None].astype(np.int64)
    gpu_sweeps = []
    for attempt in range(8):
        bad_layer = None
        for n in range(N):
            node_deadline = time.perf_counter() + max(deadline - time.perf_counter(), 0.0) / (N - n)
            to_place = node_assign[:, :, n]
            gpu_assign = _pack_within_node(loads, replicas, to_place, G, slots)
            try:
                gpu_sweeps.append(solve_stage(problem, gpu_assign, to_place, np.full(G, slots), 1, caps,
                                              node_deadline, per_mip_limit))
            except StageInfeasible as exc:
                bad_layer = exc.args[0]
                break
            hosts[:, :, n * G:(n + 1) * G] = gpu_assign > 0
        if bad_layer is None:
            break
        # the node split of this layer packs badly into GPUs: tighten its node cap and redo it
        if N == 1:
            raise infeasible_layer_error(problem, bad_layer)
        if attempt >= 5:  # fall back to the warm start's node split, which packs under the cap if anything does
            node_assign[bad_layer] = initial.reshape(L, E, N, G).sum(axis=3)[bad_layer]
            continue
        node_caps = node_caps.copy()
        node_caps[bad_layer] *= 0.97
        layer_only = np.zeros_like(replicas)
        layer_only[bad_layer] = replicas[bad_layer]
        try:
            solve_stage(problem, node_assign, layer_only, np.full(N, G * slots), G, node_caps,
                        time.perf_counter() + 10 * per_mip_limit, per_mip_limit)
        except StageInfeasible:
            raise infeasible_layer_error(problem, bad_layer) from None
    sweeps["gpus"] = max(gpu_sweeps) if gpu_sweeps else 0
    return StagedSolution(hosts, replicas, caps, counts, sweeps, problem.notes)


def _pack_within_node(loads, replicas, to_place, gpus, slots) -> np.ndarray:
    """int [L, E, G]: EPLB-style packing of a node's replicas onto its GPUs (stage 2 warm start)."""
    L, E = to_place.shape
    out = np.zeros((L, E, gpus), dtype=np.int64)
    for l in range(L):
        replica_expert = np.repeat(np.arange(E), to_place[l])
        pack = balanced_packing((loads[l] / replicas[l])[replica_expert], replica_expert, gpus, slots)
        out[l, replica_expert, pack] = 1
    return out
