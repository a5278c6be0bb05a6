"""`ilp`: ExFlow's staged placement (nodes first, then GPUs within each node), extended with a
per-layer load cap and redundant slots, solved by per-layer steps in block-coordinate sweeps.

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
variables, so each step is one small model: a transportation problem (E x P variables; at most
ceil(r / P) replicas of an expert per partition, which keeps presence = count and the step
linear) plus one load row per partition. Steps are solved by (1) the transportation optimum,
exact when it fits the cap; (2) otherwise priced loads (Lagrangian) for a fitting start and
steepest exchanges; then, once the exchange sweeps stop gaining, (3) the step MIP in HiGHS
warm-started from it. Sweeps alternate direction and never get worse. Stage 1 runs on nodes,
stage 2 on each node's GPUs (independent subproblems). Two starts (EPLB-style packing, and an
uncapped GPU-level solve that finds the affinity structure first) each run the same work; the
better wins. The joint pair-variable model of ExFlow (`placement/joint.py`) then polishes windows
of layers where it is small enough. Last, the result is valued on the planning trace itself with
the metric's routing (`placement/routed.py`): the even-split model misjudges replicated experts,
so the staged result and a routed layer chain are both polished by routed layer MIPs and the one
with more GPU-local transitions wins. At DeepSeek-V3 scale with replicas (where re-slotting
and the step MIPs do not fit the budget) the stages give way to GPU-level exchange
sweeps (`placement/gpu_sweeps.py`) from the balanced packing, then routed exchanges. A valid
bound for the whole problem, keeping the load cap, comes from `placement/bound.py`.

Determinism: every limit that shapes the answer is a work limit scaled by --effort
(`budget.WorkBudget`): sweeps per stage, exchange moves, pricing rounds, branch-and-bound
nodes per step MIP. HiGHS runs single-threaded with a fixed seed, so the same inputs give the same
placement on an idle or a loaded machine. The wall-clock --time-limit is only a safety net: a
solve it cuts short returns its best placement so far and is marked `stopped_by: time_limit`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import scipy.sparse as sp

from moeplan.passes.optimize.milp import solve_milp
from moeplan.passes.optimize.placement.budget import WorkBudget
from moeplan.passes.optimize.placement.eplb import balanced_packing
from moeplan.passes.optimize.placement.exchanges import repair_exchanges, steepest_exchanges
from moeplan.passes.optimize.placement.gpu_sweeps import WALK_SWEEPS, gpu_sweeps
from moeplan.passes.optimize.placement.held_out import expected_max_loads, held_out_allowance, held_out_caps
from moeplan.passes.optimize.placement.held_out_repair import repair_expected_max
from moeplan.passes.optimize.placement.joint import polish_windows
from moeplan.passes.optimize.placement.metrics import max_gpu_loads, over_cap_layers
from moeplan.passes.optimize.placement.reslot import layer_gain_table, reslot_search, tighten
from moeplan.passes.optimize.placement.routed import (RoutedTrace, routed_chain, routed_polish, routed_swaps,
                                                      routed_value)
from moeplan.planner.errors import UserError


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
    optimal; else priced loads give a fitting start, improved by exchanges (`improve_by_swaps`),
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
        warm = repair_by_swaps(gain, warm, limit, loads, cap, budget.scaled(SWAP_MOVES))
    if warm is not None and _fits(warm, loads, cap):
        warm = improve_by_swaps(gain, warm, limit, loads, cap, budget.scaled(SWAP_MOVES))
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


def improve_by_swaps(gain, assign, limit, loads, cap, max_rounds: int = 10_000) -> np.ndarray:
    """Steepest-ascent exchanges: move one replica of e from p to q and one of f from q to p
    while that gains and keeps both partitions under the cap and within the per-partition limit.
    Deterministic (ties: lowest index); the pair tables are patched move by move
    (`placement/exchanges.py`), not recomputed."""
    return steepest_exchanges(gain, assign, limit, loads, cap, max_rounds)


def repair_by_swaps(gain, assign, limit, loads, cap, max_rounds: int = 10_000) -> np.ndarray:
    """Exchanges that cut the load over the cap most (ties: most gain) until it fits or none cuts it.

    Why: at 64-GPU scale a node's replicas, packed onto its GPUs, often miss the per-GPU cap by a
    little; finding a fitting start by exchanges takes milliseconds where the step MIP spends
    seconds at its root. Deterministic (ties: lowest index); tables patched per move
    (`placement/exchanges.py`)."""
    return repair_exchanges(gain, assign, limit, loads, cap, max_rounds)


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
        from scipy.optimize import linear_sum_assignment

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


def _objective(counts, share, present):
    """Local transitions under the even-split model, summed over layer pairs."""
    return float(sum(((counts[l] @ present[l + 1]) * share[l]).sum() for l in range(len(counts))))


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
        value = _objective(counts, share, (assign > 0).astype(float))
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


def eplb_replicas_and_caps(loads: np.ndarray, devices: int, redundant: int, balance: float, balance_base: str) -> tuple:
    """(int [L, E] EPLB replica counts for E + redundant slots, float [L] per-layer load caps), the caps
    checked achievable (a one-line error names the layer otherwise). loads: float [L, E]."""
    from moeplan.passes.optimize.placement.eplb import replica_counts

    L, E = loads.shape
    slots = (E + redundant) // devices
    replicas = np.stack([replica_counts(loads[l], E + redundant, devices) for l in range(L)])
    caps = layer_caps(loads, replicas, devices, slots, balance, balance_base)
    check_caps(loads, replicas, caps, devices, slots, balance)
    return replicas, caps


@dataclass
class StagedSolution:
    hosts: np.ndarray  # bool [L, E, D]
    replicas: np.ndarray  # int [L, E]
    caps: np.ndarray  # float [L]
    counts: np.ndarray  # float [L-1, E, E]
    sweeps: dict
    notes: list
    max_copies: int = 1  # most copies of one expert in the search space (EPLB's largest count): what the bound assumes


def staged_placement(counts, loads, topology, redundant: int, balance: float, balance_base: str,
                     solver: str, budget: WorkBudget = None, routed: RoutedTrace = None,
                     scenarios: np.ndarray = None, held_out_balance: bool = False) -> StagedSolution:
    """Stage 1 (nodes) then stage 2 (GPUs of each node), from two starts; see module docstring.

    Start A is the EPLB-style packing. Start B first finds the affinity structure with no load
    cap (each step a pure transportation problem, exact and fast), then lets the capped stages
    repair the balance. Each start gets the same work budget; the one keeping more transitions
    local wins (ties: A); replica runs at DeepSeek-V3 scale run start A only (`sweep_limit`).
    Layers left over their cap (a step that found no fitting solution in its limits) fall back to
    the packing, which fits whenever the cap is achievable by it. Where re-slotting applies
    (`reslot_applies`), each start is polished by `reslot.reslot_search`, and a third
    start walks B's uncapped solution down to the caps (`reslot.tighten`); the replica
    counts returned are then the solution's own, which may differ from EPLB's rule.

    With `scenarios` (float [S, L, E], `placement/held_out.py`): when the solution's expected
    held-out max load rises more than EPLB's packing's, the layers concerned get their caps lowered
    by the excess (`held_out.held_out_caps`) and the solution is walked down to them by re-slotting
    moves (`reslot.tighten`, which keeps most of the affinity structure where a solve from scratch
    under the lowered caps lost it), then polished by routed steps; a layer the walk cannot fit
    keeps its placement. Where re-slotting does not apply (DeepSeek-V3 scale) the walk is GPU-level
    exchange sweeps over the lowered layers (`gpu_sweeps.py`). Elsewhere, when the expected
    held-out max loads summed over layers still exceed the packing's allowance (a cap could not go
    low enough: at EPLB's own balance the planning max is near the mean already), exchanges lower
    the expected maxima themselves (`held_out_repair.py`).

    `held_out_balance`: the caps are for held-out traffic, not the planning trace: each layer's
    planning cap is first lowered by the packing's expected held-out rise (sampling noise: +0.07 x
    mean at 64 GPUs with 5 slots each, where a placement planned at 1.10 lands at 1.16), never
    below the packing's own max load; the walk above then keeps the expected held-out max under
    the requested cap."""
    L, E = loads.shape
    D = topology.devices
    slots = (E + redundant) // D
    replicas, caps = eplb_replicas_and_caps(loads, D, redundant, balance, balance_base)
    budget = budget or WorkBudget()
    packed = initial_hosts(loads, replicas, D, slots)
    has_scenarios = scenarios is not None and len(scenarios) > 0
    if held_out_balance and has_scenarios:
        packed_max = max_gpu_loads(packed, loads)
        rise = np.maximum(expected_max_loads(packed, loads, scenarios) - packed_max, 0.0)
        caps = np.minimum(np.maximum(caps - rise, packed_max * (1 + 1e-9)), caps)
    solution = _solve_under_caps(counts, loads, topology, redundant, replicas, caps, packed, solver, budget, routed)
    if held_out_balance and not has_scenarios:
        solution.notes.append("held-out balance asked for, but the trace is too short (or loads only) to estimate "
                              "held-out loads: the caps hold on the planning trace only")
    if not has_scenarios or budget.expired():
        return solution
    at_scale = not reslot_applies(E + redundant, D, budget)  # re-slotting moves cost minutes there: GPU sweeps walk
    floor = np.minimum(least_max_load(loads, replicas, D, slots) * (1 + 1e-6), caps)
    hosts, current, lowered, moves = solution.hosts, caps, 0, 0
    for _ in range(HELD_OUT_ROUNDS_AT_SCALE if at_scale else HELD_OUT_ROUNDS):
        robust = held_out_caps(hosts, packed, loads, caps, current, scenarios, floor)
        if not np.any(robust < current * (1 - 1e-9)) or budget.expired():
            break
        lowered += int((robust < current * (1 - 1e-9)).sum())
        if at_scale:
            walked, made = gpu_sweeps(hosts, counts, loads, robust, topology.gpus_per_node, budget,
                                      layers=np.flatnonzero(robust < current * (1 - 1e-9)), sweeps=WALK_SWEEPS)
            over = over_cap_layers(walked, loads, robust)
            if over:  # exchanges alone could not fit these: walk them again from the packing, the least rising start
                walked[over] = packed[over]
                walked, more = gpu_sweeps(walked, counts, loads, robust, topology.gpus_per_node, budget, layers=over,
                                          sweeps=WALK_SWEEPS)
                made, over = made + more, over_cap_layers(walked, loads, robust)
        else:
            walked, made, over = tighten(hosts, counts, loads, robust, topology.gpus_per_node, budget, solution.max_copies)
        walked[over] = hosts[over]  # layers the walk could not bring under the lowered cap keep their placement
        current = np.maximum(robust, max_gpu_loads(walked, loads))
        if routed is not None and not at_scale:
            walked, _ = routed_polish(walked, routed, loads, current, budget, solver)
        hosts, moves = walked, moves + made
    if lowered and at_scale:
        hosts, current = _packing_where_rising(hosts, packed, counts, loads, caps, current, scenarios, topology, budget)
    repaired = 0
    if not at_scale and not budget.expired():
        hosts, repaired = _repair_expected_max(hosts, packed, counts, loads, caps, current, scenarios, topology, budget)
    if lowered or repaired:
        solution.hosts, solution.replicas = hosts, hosts.sum(axis=2)
        solution.caps = current  # the bound is then for placements at least as balanced, layer by layer
        solution.sweeps["held_out_caps"] = {"layers_lowered": lowered, "moves": moves,
                                            "mean_lowering": float(np.mean(1 - current / caps)),
                                            **({"repair_moves": repaired} if repaired else {})}
    return solution


def _repair_expected_max(hosts, packed, counts, loads, caps, current, scenarios, topology, budget) -> tuple:
    """When the expected held-out max loads, summed over layers, still exceed the packing's
    allowance after the walk (a cap could not go low enough), exchanges lower them directly
    (`held_out_repair.py`), within the caps met `current`. Returns (hosts, moves made)."""
    return repair_expected_max(hosts, loads, scenarios, held_out_allowance(packed, loads, caps, scenarios), current,
                               lambda hosts, l: layer_gain_table(hosts, counts, l, topology.gpus_per_node),
                               budget.scaled(REPAIR_MOVES) * len(hosts))


REPAIR_MOVES = 200  # exchanges per layer at effort 1


def _packing_where_rising(hosts, packed, counts, loads, caps, current, scenarios, topology, budget) -> tuple:
    """Layers still expected to rise above the packing's held-out max after the walk (their cap at its
    floor, the hottest replica's GPU) restart from the packing, improved by GPU sweeps under its own max
    load, and keep it outright if those sweeps raise the expected max again. Returns (hosts, caps met)."""
    packed_max = max_gpu_loads(packed, loads)
    allowed = held_out_allowance(packed, loads, caps, scenarios)
    rising = np.flatnonzero(expected_max_loads(hosts, loads, scenarios) > allowed * (1 + 1e-9))
    if len(rising) == 0:
        return hosts, current
    hosts = hosts.copy()
    hosts[rising] = packed[rising]
    current = current.copy()
    current[rising] = np.minimum(current[rising], packed_max[rising] * (1 + 1e-9))
    hosts, _ = gpu_sweeps(hosts, counts, loads, current, topology.gpus_per_node, budget, layers=rising)
    again = rising[expected_max_loads(hosts[rising], loads[rising], scenarios[:, rising]) > allowed[rising] * (1 + 1e-9)]
    hosts[again] = packed[again]
    return hosts, current


HELD_OUT_ROUNDS = 3  # re-solves under lowered caps at most (each only if some layer's held-out rise is too large)
HELD_OUT_ROUNDS_AT_SCALE = 8  # GPU-sweep walks of the lowered layers only (~1 CPU s each at DeepSeek-V3 scale); a
# lowering by the excess undershoots (GPUs under the cap rise too), 3 rounds left 14 of 58 layers above it there


def _solve_under_caps(counts, loads, topology, redundant, replicas, caps, packed, solver, budget,
                      routed) -> StagedSolution:
    """The stages, re-slotting and routed finish of `staged_placement` under float [L] caps."""
    L, E = loads.shape
    D = topology.devices
    slots = (E + redundant) // D
    problem = LayerProblem(counts, loads, replicas, caps, solver, budget=budget,
                           max_sweeps=sweep_limit(budget, L, E, E + redundant, D))
    if redundant and not reslot_applies(E + redundant, D, budget):  # without replicas steps are exact assignments
        return _solve_at_scale(problem, topology, packed, slots, routed)
    best = None
    loose = None
    reslot = reslot_applies(E + redundant, D, budget)
    max_copies = problem.max_copies
    starts = (("packing", False), ("uncapped", True))
    if problem.max_sweeps < budget.scaled(MAX_SWEEPS):
        starts = starts[:1]  # DeepSeek-V3 scale: one start, so the run ends on its work budget in ~2 minutes
    for name, presolve in starts:
        sweeps = {}
        problem.replica_mip_left = budget.scaled(REPLICA_MIP_VARIABLES)
        hosts = packed.copy()
        if presolve:
            uncapped = hosts.astype(np.int64)
            sweeps["uncapped"] = solve_stage(problem, uncapped, replicas, np.full(D, slots), 1, np.full(L, np.inf),
                                             problem.max_sweeps)
            hosts = loose = uncapped > 0
            uncapped_sweeps = sweeps["uncapped"]
        hosts = _run_stages(problem, hosts, packed, topology, slots, sweeps)
        hosts = _repair_layers(problem, hosts, packed, slots)
        if reslot:
            hosts, sweeps["reslot_moves"] = reslot_search(hosts, counts, loads, caps, topology.gpus_per_node, budget,
                                                          max_copies)
        best = _better(best, counts, hosts, {"start": name, **sweeps})
    if reslot and loose is not None:
        # third start: the uncapped affinity structure, walked down to the caps with re-slotting
        hosts, moves, over = tighten(loose, counts, loads, caps, topology.gpus_per_node, budget, max_copies)
        hosts[over] = best[1][over]  # layers the walk could not fit keep the staged solution's
        hosts, more = reslot_search(hosts, counts, loads, caps, topology.gpus_per_node, budget, max_copies)
        best = _better(best, counts, hosts, {"start": "tightened", "uncapped": uncapped_sweeps,
                                             "reslot_moves": moves + more, "layers_kept": len(over)})
    if routed is not None and reslot_applies(E + redundant, D, budget):
        best = _routed_finish(best, routed, counts, loads, replicas, caps, packed, budget, solver)
    elif routed is not None:  # DeepSeek-V3 scale: layer MIPs are too big; routed exchanges instead
        hosts, gain = routed_swaps(best[1], routed, loads, caps, budget)
        best = (best[0], hosts, {**best[2], "finish": "routed swaps", "routed_gain": int(gain)})
    hosts = best[1]
    return StagedSolution(hosts, hosts.sum(axis=2), caps, counts, best[2], problem.notes, max_copies)


def _solve_at_scale(problem, topology, packed, slots, routed) -> StagedSolution:
    """DeepSeek-V3 scale with replicas: GPU-level exchange sweeps from the packing (`gpu_sweeps.py`; the
    staged steps' priced node splits pack badly under a tight cap there), one pass of re-slot moves (`reslot.py`
    without its exchanges, which cost minutes at this size), layers left over their cap repaired, then routed
    exchanges valued on the planning trace itself (`routed.routed_swaps`)."""
    hosts, sweeps = gpu_sweeps(packed, problem.counts, problem.loads, problem.caps, topology.gpus_per_node,
                               problem.budget)
    info = {"start": "packing", "gpu_sweeps": sweeps}
    if RESLOT_MOVES_AT_SCALE:
        hosts, info["reslot_moves"] = reslot_search(hosts, problem.counts, problem.loads, problem.caps,
                                                    topology.gpus_per_node, problem.budget,
                                                    problem.max_copies, exchanges=False,
                                                    moves_per_layer=RESLOT_MOVES_AT_SCALE, sweeps=1)
    hosts = _repair_layers(problem, hosts, packed, slots)
    if routed is not None:
        hosts, gain = routed_swaps(hosts, routed, problem.loads, problem.caps, problem.budget)
        info.update(finish="routed swaps", routed_gain=int(gain))
    return StagedSolution(hosts, hosts.sum(axis=2), problem.caps, problem.counts, info, problem.notes,
                          problem.max_copies)


def _routed_finish(best, routed, counts, loads, replicas, caps, packed, budget, solver):
    """Value the staged result and a routed layer chain on the planning trace itself, polish both
    by routed layer steps (`placement/routed.py`) and keep the one with the most GPU-local
    transitions, then node-local (the metric's own counts; ties: the staged one).

    Why: the stages' even-split model misjudges replicated experts (the metric keeps a token on
    its GPU's copy); on trained top-1 traces the routed steps gain 6 points of GPU-local."""
    chain = routed_chain(routed, loads, replicas, caps, packed, budget, solver)
    finalists = []
    for name, hosts in (("staged", best[1]), ("routed chain", chain)):
        polished, gain = routed_polish(hosts, routed, loads, caps, budget, solver)
        finalists.append((routed_value(routed, polished), polished, {**best[2], "finish": name,
                                                                                "routed_gain": int(gain)}))
    top = max(range(len(finalists)), key=lambda i: (finalists[i][0], -i))
    value, hosts, info = finalists[top]
    return (_objective(counts, hosts / hosts.sum(axis=2, keepdims=True), hosts.astype(float)), hosts, info)


RESLOT_MOVES_AT_SCALE = 16  # re-slot moves per layer at 64-GPU scale, effort 1 (~13 ms each at DeepSeek-V3's size)
RESLOT_MAX_SIZE = 2_000  # replica slots x devices per layer, at effort 1: above it (64-GPU scale) the
# GPU-level local search costs minutes per stage, so it runs only at a higher --effort


def reslot_applies(slots_per_layer: int, devices: int, budget: WorkBudget) -> bool:
    """Run the re-slotting search (and its tightening start) when a layer step is small enough."""
    return slots_per_layer * devices <= RESLOT_MAX_SIZE * budget.effort


SWEEP_SIZE = 100_000  # layers x replica slots x devices up to which a replica run gets MAX_SWEEPS at effort 1


def sweep_limit(budget: WorkBudget, layers: int, experts: int, slots_per_layer: int, devices: int) -> int:
    """Coordinate sweeps per stage: MAX_SWEEPS x effort; with replicas (whose steps are LPs and
    MIPs, not assignments) fewer, at least 2, beyond SWEEP_SIZE, so DeepSeek-V3-sized replica
    runs end on their work budget in about 100 s on 2 cores instead of at the time limit."""
    full = budget.scaled(MAX_SWEEPS)
    if slots_per_layer <= experts:
        return full
    return max(2, min(full, budget.scaled(MAX_SWEEPS * SWEEP_SIZE / (layers * slots_per_layer * devices))))


def _better(best, counts, hosts, info):
    """Keep the placement with more local transitions (ties: the earlier one)."""
    value = _objective(counts, hosts / hosts.sum(axis=2, keepdims=True), hosts.astype(float))
    if best is None or value > best[0] * (1 + 1e-12):
        return (value, hosts, info)
    return best


def _run_stages(problem, hosts, packed, topology, slots, sweeps) -> np.ndarray:
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
            break  # N == 1: _repair_layers handles what is left (or names the infeasible layer)
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


def _repair_layers(problem, hosts, packed, slots) -> np.ndarray:
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
