"""The staged ILP's coordinate sweeps (`ilp.py`, the driver): one level (nodes, or one node's GPUs) at a time, one
layer per step with the other layers fixed.

Why coordinate sweeps: fixing every layer but l makes the even-split objective (`even_split.py`)
linear in layer l's variables, so each step is one small model: a transportation problem (E x P
variables; at most ceil(r / P) replicas of an expert per partition, which keeps presence = count
and the step linear) plus one load row per partition. Steps are solved by (1) the transportation
optimum, exact when it fits the cap; (2) otherwise priced loads (Lagrangian) for a fitting start
and steepest exchanges (`local_search/moves.py`); then, once the exchange sweeps stop gaining, (3)
the step MIP in HiGHS warm-started from it. Sweeps alternate direction and never get worse.
`run_stages` runs stage 1 on nodes, then stage 2 on each node's GPUs (independent subproblems);
`repair_layers` replaces a layer left over its cap. Work limits (sweeps, moves, branch-and-bound
nodes, MIP variables) are scaled by --effort.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import scipy.sparse as sp
from scipy.optimize import linear_sum_assignment

from moeplan.passes.optimize.milp import solve_milp
from moeplan.passes.optimize.placement.algorithms.eplb import balanced_packing
from moeplan.passes.optimize.placement.budget import WorkBudget
from moeplan.passes.optimize.placement.even_split import even_split_value
from moeplan.passes.optimize.placement.local_search.joint import polish_windows
from moeplan.passes.optimize.placement.local_search.moves import repair_exchanges, steepest_exchanges
from moeplan.passes.optimize.placement.metrics import over_cap_layers
from moeplan.core.errors import UserError

MIP_NODE_LIMIT = 50  # branch-and-bound nodes per layer step at effort 1: a deterministic work limit
MAX_SWEEPS = 12  # coordinate sweeps per stage at effort 1 (fewer when they stop gaining)
EXACT_SWEEPS = 1  # per unit of effort (rounded down): sweeps of step MIPs once the exchange sweeps
# stop gaining; a step MIP with replicas costs ~1 s at 64 experts whatever its node limit
EXACT_MAX_VARIABLES = 600  # per unit of effort: bigger steps (experts x partitions) skip the MIP sweeps
REPLICA_MIP_VARIABLES = 3_000  # per start at effort 1: step MIPs of layers with replicas (~0.5 s each at
# 64-GPU scale, mostly root work no node limit bounds) stop once their variables add up to this
SWAP_MOVES = 10_000  # exchange moves per step at effort 1


@dataclass
class LayerProblem:
    """Inputs shared by every per-layer step."""

    counts: np.ndarray  # float [L-1, E, E]
    loads: np.ndarray  # float [L, E] token assignments per expert
    replicas: np.ndarray  # int [L, E]
    caps: np.ndarray  # float [L] per-GPU load cap
    solver: str = "highs"
    notes: list = field(default_factory=list)
    budget: WorkBudget = field(default_factory=WorkBudget)
    replica_mip_left: float = float("inf")  # variables the step MIPs of layers with replicas may still use
    max_sweeps: int = MAX_SWEEPS  # coordinate sweeps per stage (`sweep_limit`)

    @property
    def max_copies(self) -> int:
        """Most copies of one expert in the search space (EPLB's largest count): what re-slotting keeps
        to and the bound assumes."""
        return int(self.replicas.max())


def per_partition_limit(to_place: np.ndarray, partitions: int, max_per_partition: int) -> np.ndarray:
    """int [n]: most replicas of an expert one partition may take: spread them, ceil(r / P).

    With at most one replica per partition the presence of an expert there equals its count, so
    the layer step stays linear (and exact); only experts with more replicas than partitions
    (very hot ones, which sit on nearly every partition anyway) get a linear approximation."""
    return np.minimum(np.maximum(1, -(-to_place // partitions)), max_per_partition)


def assignment_mip(in_gain, out_gain, to_place, max_per_partition, slots, loads, cap, warm, budget, solver, notes,
                   exact: bool = True, mip: bool = True):
    """Place one layer's replicas on P partitions maximising the local transitions they gain.

    in_gain[e, p]: transitions into e that become local if e is present on p; out_gain[e, p]:
    transitions out of e made local per replica of e on p. to_place: int [n] replicas per expert;
    slots: int [P] (exact fill); loads: float [n] load per replica; cap: load cap per partition;
    warm: int [n, P] or None; budget: the `WorkBudget` (node and move limits, safety time). The model is a transportation problem (totally unimodular) plus
    one load row per partition: when its optimum without the load rows fits the cap it is
    optimal; else priced loads give a fitting start, improved by exchanges (`steepest_exchanges`),
    which is the step when not `exact` and the MIP's warm start when `exact`. Returns
    (int [n, P] or None, status).
    """
    n, P = in_gain.shape
    limit = per_partition_limit(to_place, P, max_per_partition)
    gain = out_gain + in_gain / limit[:, None]
    cheap = bool(np.all(to_place == 1))  # a linear assignment, else an LP per pricing round
    warm_fits = warm is not None and _fits(warm, loads, cap)
    rounds = 25 if cheap else (2 if warm_fits else 8)
    quick = _flow_with_prices(gain, to_place, limit, slots, loads, cap, rounds, budget)
    if quick is not None and quick[1]:
        return quick[0], "optimal"  # the optimum without load rows already meets the cap
    if quick is not None and (warm is None or not _fits(warm, loads, cap) or (gain * quick[0]).sum() > (gain * warm).sum()):
        warm = quick[0]
    if warm is not None and not _fits(warm, loads, cap):
        warm = repair_exchanges(gain, warm, limit, loads, cap, budget.scaled(SWAP_MOVES))
    if warm is not None and _fits(warm, loads, cap):
        warm = steepest_exchanges(gain, warm, limit, loads, cap, budget.scaled(SWAP_MOVES))
        if not exact:
            return warm, "heuristic"
    if not mip:  # the caller's MIP budget is spent
        return (warm, "heuristic") if warm is not None and _fits(warm, loads, cap) else (None, "no_fit")
    nm = n * P
    budget.mip_variables += nm
    cost = -gain.ravel()
    upper = np.repeat(limit, P).astype(float)
    index = np.arange(nm)
    A = sp.vstack([
        sp.csr_matrix((np.ones(nm), (np.repeat(np.arange(n), P), index)), shape=(n, nm)),  # sum_p m[e, p] = r_e
        sp.csr_matrix((np.ones(nm), (np.tile(np.arange(P), n), index)), shape=(P, nm)),  # sum_e m[e, p] = slots_p
        sp.csr_matrix((np.repeat(loads, P), (np.tile(np.arange(P), n), index)), shape=(P, nm)),  # load <= cap
    ]).tocsc()
    lo = np.concatenate([to_place, slots, np.full(P, -np.inf)]).astype(float)
    hi = np.concatenate([to_place, slots, np.full(P, cap)]).astype(float)
    start = None if warm is None else warm.astype(float).ravel()
    result = solve_milp(cost, A, lo, hi, np.zeros(nm), upper, np.ones(nm, dtype=bool), time_limit=budget.seconds_left(),
                        warm_start=start, solver=solver, mip_gap=1e-2, node_limit=budget.scaled(MIP_NODE_LIMIT))
    budget.record(result)
    for note in result.notes:
        if note not in notes:
            notes.append(note)
    if result.x is None:
        if quick is not None:
            return quick[0], "heuristic"
        return None, result.status
    return np.rint(result.x).reshape(n, P).astype(np.int64), result.status


def _fits(assign, loads, cap) -> bool:
    return bool(np.all(loads @ assign <= cap * (1 + 1e-9)))


def _flow_with_prices(gain, to_place, limit, slots, loads, cap, rounds: int = 25, budget: WorkBudget = None):
    """The layer step without its load rows, with overloaded partitions' load priced.

    Round 0 is the exact optimum of the transportation problem; if it fits the cap it solves the
    step: (assign, True). Otherwise the price of load on overloaded partitions rises round by round
    (a Lagrangian heuristic) until an assignment fits: (assign, False); None if none does."""
    n, P = gain.shape
    price = np.zeros(P)
    scale = max(float(np.abs(gain).max()), 1e-9) / max(float(loads.max()), 1e-9)
    for round_ in range(rounds):
        assign = _transport(gain - loads[:, None] * price[None, :], to_place, limit, slots, budget)
        if assign is None:
            return None
        partition_load = loads @ assign
        if np.all(partition_load <= cap * (1 + 1e-9)):
            return assign, round_ == 0
        over = partition_load > cap
        price = price + scale * 0.25 * (round_ + 1) * over * (partition_load / cap - 1 + 0.05)
    return None


def _transport(value, to_place, limit, slots, budget: WorkBudget = None):
    """int [n, P] maximising sum value * m with row sums to_place, column sums slots, m <= limit."""
    n, P = value.shape
    if np.all(to_place == 1):
        columns = np.repeat(np.arange(P), slots)
        rows, cols = linear_sum_assignment(-value[:, columns])
        assign = np.zeros((n, P), dtype=np.int64)
        assign[rows, columns[cols]] = 1
        return assign
    nm = n * P
    index = np.arange(nm)
    A = sp.vstack([
        sp.csr_matrix((np.ones(nm), (np.repeat(np.arange(n), P), index)), shape=(n, nm)),
        sp.csr_matrix((np.ones(nm), (np.tile(np.arange(P), n), index)), shape=(P, nm)),
    ]).tocsc()
    bounds = np.concatenate([to_place, slots]).astype(float)
    budget = budget or WorkBudget()
    result = solve_milp(-value.ravel(), A, bounds, bounds, np.zeros(nm), np.repeat(limit, P).astype(float),
                        np.zeros(nm, dtype=bool), time_limit=budget.seconds_left())
    budget.record(result)
    if result.x is None:
        return None
    x = result.x.reshape(n, P)
    rounded = np.rint(x)
    if np.abs(x - rounded).max() > 1e-6:  # a non-vertex optimum: leave it to the MIP
        return None
    return rounded.astype(np.int64)


class StageInfeasible(Exception):
    """A per-layer MIP at some level has no solution (the layer index is the argument)."""


def solve_stage(problem: LayerProblem, assign: np.ndarray, to_place: np.ndarray, partition_slots: np.ndarray,
                max_per_partition: int, partition_caps: np.ndarray, max_sweeps: int, unfit: str = "raise"):
    """Coordinate sweeps over layers on one level (nodes, or the GPUs of one node), at most
    `max_sweeps` (a work limit; the budget's safety deadline can stop them earlier).

    assign: int [L, E, P] replica counts per partition (updated in place); to_place: int [L, E],
    the replicas of each expert this level distributes (0 = not this level's). With unfit
    "raise", raises `StageInfeasible(l)` when the solver proves layer l cannot meet its cap; with
    "keep" (or when no fitting step was found within the work limits) the layer keeps its
    previous assignment, which the caller checks. Returns the number of sweeps run.
    """
    L = assign.shape[0]
    replicas = problem.replicas
    counts = problem.counts
    sweeps = 0
    previous = None
    exact = False  # fast sweeps (exchanges) until they stop gaining, then sweeps of exact step MIPs
    budget = problem.budget
    exact_sweeps = 0
    step_size = int((to_place > 0).sum(axis=1).max(initial=0)) * assign.shape[2]
    exact_budget = int(EXACT_SWEEPS * budget.effort) if step_size <= EXACT_MAX_VARIABLES * budget.effort else 0
    while sweeps < max_sweeps and not budget.expired():
        order = range(L) if sweeps % 2 == 0 else reversed(range(L))
        for l in order:
            if budget.expired():
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
            metered = replicas[l].max() > 1
            mip_ok = not metered or problem.replica_mip_left >= len(experts) * assign.shape[2]
            before = budget.mip_variables
            result, status = assignment_mip(
                in_gain, out_gain, to_place[l][experts], max_per_partition, partition_slots,
                problem.loads[l][experts] / replicas[l][experts], partition_caps[l],
                assign[l][experts], budget, problem.solver, problem.notes, exact and mip_ok, mip_ok)
            if metered:
                problem.replica_mip_left -= budget.mip_variables - before
            if result is None:
                if status == "infeasible" and unfit == "raise":
                    raise StageInfeasible(l)
                continue  # time ran out without an incumbent better than the warm start: keep it
            assign[l][experts] = result
        sweeps += 1
        exact_sweeps += exact
        if exact and exact_sweeps >= exact_budget:
            break
        share = assign / problem.replicas[:, :, None]
        value = even_split_value(counts, share, (assign > 0).astype(float))
        if previous is not None and value <= previous * (1 + 1e-9):
            if exact or exact_budget == 0:
                break
            exact = True
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


def run_stages(problem, hosts, packed, topology, slots, sweeps) -> np.ndarray:
    """bool [L, E, D]: stage 1 (nodes, then the joint polish) and stage 2 (each node's GPUs) from `hosts`;
    `sweeps` (a dict) records the sweeps each stage ran."""
    L, E, D = hosts.shape
    N, G = topology.nodes, topology.gpus_per_node
    caps, replicas = problem.caps, problem.replicas
    max_sweeps = problem.max_sweeps
    hosts = hosts.copy()
    node_caps = caps * G
    if N > 1:
        node_assign = hosts.reshape(L, E, N, G).sum(axis=3).astype(np.int64)
        try:
            sweeps["nodes"] = solve_stage(problem, node_assign, replicas, np.full(N, G * slots), G,
                                          node_caps, max_sweeps)
        except StageInfeasible as exc:
            raise infeasible_layer_error(problem, exc.args[0]) from None
        joint = polish_windows(problem, node_assign, replicas, np.full(N, G * slots), node_caps)
        sweeps["joint_nodes"] = joint
    else:
        node_assign = replicas[:, :, None].astype(np.int64)
    gpu_sweeps = []
    active = np.ones(L, dtype=bool)  # layers whose GPU split is (re)solved: all, then the retried ones
    for attempt in range(8):
        for n in range(N):
            to_place = node_assign[:, :, n]
            gpu_assign = _pack_within_node(problem.loads, replicas, to_place, G, slots)
            current = hosts[:, :, n * G:(n + 1) * G]
            keep = (current.sum(axis=2) == to_place).all(axis=1) & (current.sum(axis=1) == slots).all(axis=1)
            gpu_assign[keep] = current[keep]  # the start's GPU split where it matches the node split
            # a layer whose GPU step finds nothing under the cap keeps its packing for now (caught below)
            gpu_sweeps.append(solve_stage(problem, gpu_assign, np.where(active[:, None], to_place, 0), np.full(G, slots),
                                          1, caps, max_sweeps, unfit="keep"))
            joint = polish_windows(problem, gpu_assign, to_place, np.full(G, slots), caps)
            sweeps["joint_gpus"] = sweeps.get("joint_gpus", 0.0) + joint["gained"]
            hosts[:, :, n * G:(n + 1) * G] = gpu_assign > 0
        bad_layers = over_cap_layers(hosts, problem.loads, caps)
        if not bad_layers or N == 1:
            break  # N == 1: repair_layers handles what is left (or names the infeasible layer)
        # these layers' node splits pack badly into GPUs: tighten their node caps and redo them
        active = np.isin(np.arange(L), bad_layers)
        split = packed.reshape(L, E, N, G).sum(axis=3)
        for bad_layer in bad_layers:
            if attempt >= 5:  # fall back to the packing's node split, which fits if the packing does
                node_assign[bad_layer] = split[bad_layer]
                continue
            node_caps = node_caps.copy()
            node_caps[bad_layer] *= 0.97
            layer_only = np.zeros_like(replicas)
            layer_only[bad_layer] = replicas[bad_layer]
            try:
                solve_stage(problem, node_assign, layer_only, np.full(N, G * slots), G, node_caps, max_sweeps)
            except StageInfeasible:  # tightened too far: take the packing's node split for this layer
                node_assign[bad_layer] = split[bad_layer]
    sweeps["gpus"] = max(gpu_sweeps) if gpu_sweeps else 0
    return hosts


def repair_layers(problem, hosts, packed, slots) -> np.ndarray:
    """Replace any layer over its cap by the packing, or by a capped MIP with no affinity."""
    L, E, D = hosts.shape
    hosts = hosts.copy()
    for l in over_cap_layers(hosts, problem.loads, problem.caps):
        per_replica = problem.loads[l] / problem.replicas[l]
        if (per_replica @ packed[l]).max() <= problem.caps[l] * (1 + 1e-9):
            hosts[l] = packed[l]
            continue
        zero = np.zeros((E, D))
        assign, status = assignment_mip(zero, zero, problem.replicas[l], 1, np.full(D, slots), per_replica,
                                        problem.caps[l], None, problem.budget, problem.solver, problem.notes)
        if assign is None or (per_replica @ assign).max() > problem.caps[l] * (1 + 1e-9):
            raise infeasible_layer_error(problem, l)
        hosts[l] = assign > 0
    return hosts


def _pack_within_node(loads, replicas, to_place, gpus, slots) -> np.ndarray:
    """int [L, E, G]: EPLB-style packing of a node's replicas onto its GPUs (stage 2 warm start)."""
    L, E = to_place.shape
    out = np.zeros((L, E, gpus), dtype=np.int64)
    for l in range(L):
        replica_expert = np.repeat(np.arange(E), to_place[l])
        pack = balanced_packing((loads[l] / replicas[l])[replica_expert], replica_expert, gpus, slots)
        out[l, replica_expert, pack] = 1
    return out
