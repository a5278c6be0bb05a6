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
better wins. The joint pair-variable model of ExFlow (`local_search/joint.py`) then polishes windows
of layers where it is small enough. Last, the result is valued on the planning trace itself with
the metric's routing (`local_search/routed.py`): the even-split model misjudges replicated experts,
so the staged result and a routed layer chain are both polished by routed layer MIPs and the one
with more GPU-local transitions wins. At DeepSeek-V3 scale with replicas (where re-slotting
and the step MIPs do not fit the budget) the stages give way to GPU-level exchange
sweeps (`local_search/gpu_sweeps.py`) from the balanced packing, then routed exchanges. A valid
bound for the whole problem, keeping the load cap, comes from `bounds/pairwise.py`.

Determinism: every limit that shapes the answer is a work limit scaled by --effort
(`budget.WorkBudget`): sweeps per stage, exchange moves, pricing rounds, branch-and-bound
nodes per step MIP. HiGHS runs single-threaded with a fixed seed, so the same inputs give the same
placement on an idle or a loaded machine. The wall-clock --time-limit is only a safety net: a
solve it cuts short returns its best placement so far and is marked `stopped_by: time_limit`.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moeplan.core import progress
from moeplan.passes.analysis.affinity import transition_counts
from moeplan.passes.optimize.placement.algorithms.ilp_caps import eplb_replicas_and_caps, initial_hosts, least_max_load
from moeplan.passes.optimize.placement.algorithms.ilp_stages import (MAX_SWEEPS, REPLICA_MIP_VARIABLES, LayerProblem,
                                                                     repair_layers, run_stages, solve_stage)
from moeplan.passes.optimize.placement.bounds.pairwise import capped_transition_lower_bound, source_token_caps
from moeplan.passes.optimize.placement.budget import WorkBudget
from moeplan.passes.optimize.placement.even_split import layer_gain_table, placement_value
from moeplan.passes.optimize.placement.held_out import (expected_max_loads, held_out_allowance, held_out_caps,
                                                       load_scenarios)
from moeplan.passes.optimize.placement.local_search.gpu_sweeps import WALK_SWEEPS, gpu_sweeps
from moeplan.passes.optimize.placement.local_search.held_out_repair import repair_expected_max
from moeplan.passes.optimize.placement.local_search.reslot import reslot_search, tighten
from moeplan.passes.optimize.placement.local_search.routed import (RoutedTrace, routed_chain, routed_polish, routed_swaps,
                                                                   routed_value)
from moeplan.passes.optimize.placement.metrics import max_gpu_loads, over_cap_layers


def ilp_placement(trace, loads: np.ndarray, request, start: float) -> tuple:
    """(bool [L, E, D] hosts, extra metrics: bound, bound_method, sweeps, stopped_by, notes) of the staged ILP for a
    `policies.PlacementRequest`, with the bound of `bounds/pairwise.py` over the whole search space; `start`: the
    solve's time.perf_counter() origin (the safety deadline counts from it). With `request.bound` False the bound
    is left for later: extra holds a `DeferredBound` under "deferred_bound" instead."""
    topology = request.topology
    D = topology.devices
    counts = transition_counts(trace, "current")
    budget = WorkBudget(request.effort, deadline=start + 0.95 * request.time_limit)
    what = f"ilp, balance {request.balance:g}, {request.redundant} redundant slot(s)"
    with progress.step(f"{what}: staged solve") as advance:
        solution = staged_placement(counts, loads, topology, request.redundant, request.balance, request.balance_base,
                                    request.solver, budget,
                                    None if trace.loads_only else RoutedTrace.from_trace(trace, topology.gpus_per_node, counts),
                                    load_scenarios(trace) if request.held_out_caps else None, request.held_out_balance)
        slots = (trace.num_experts + request.redundant) // D
        # the bound covers every placement the planner could have returned, so it assumes the search space's most
        # copies of an expert, not the fewer the returned placement may use
        max_copies = max(solution.max_copies, int(solution.replicas.max()))
        deferred = DeferredBound(counts, loads, solution.caps, D, slots, max_copies, source_token_caps(trace, slots),
                                 request.effort, request.time_limit)
        extra = {}
        if request.bound:
            advance(0, description=f"{what}: lower bound")
            extra["bound"], extra["bound_method"] = deferred.compute(budget)
        else:
            extra["deferred_bound"] = deferred
    extra["sweeps"] = solution.sweeps
    extra["stopped_by"] = "time_limit" if budget.timed_out else "work"
    notes = list(solution.notes) + ([time_limit_note(request.time_limit, request.effort)] if budget.timed_out else [])
    if notes:
        extra["notes"] = notes
    return solution.hosts, extra


def time_limit_note(time_limit: float, effort: float) -> str:
    return (f"--time-limit {time_limit:g} s stopped the solve before its work budget "
            f"(--effort {effort:g}) was spent: this placement depends on machine speed and load "
            f"and may not be reproducible; raise --time-limit (or lower --effort) for a deterministic result")


@dataclass
class DeferredBound:
    """The ILP's lower bound (`bounds/pairwise.py`), computed once its placement is kept: --policy auto solves
    the ILP at several load caps and keeps at most one, and the bound can cost more than the solve (the
    whole-column bound at 16 experts over 4 GPUs: minutes). The same inputs and work budget give the same
    bound whenever it runs."""

    counts: np.ndarray  # float [L-1, E, E]
    loads: np.ndarray  # float [L, E]
    caps: np.ndarray  # float [L]
    devices: int
    slots: int
    max_copies: int
    token_caps: np.ndarray  # float [L-1, E]
    effort: float
    time_limit: float

    def budget(self) -> WorkBudget:
        """A work budget of the solve's effort, its safety deadline counted from now."""
        import time

        return WorkBudget(self.effort, deadline=time.perf_counter() + 0.95 * self.time_limit)

    def compute(self, budget: WorkBudget) -> tuple:
        """(bound, bound_method) within `budget`."""
        return capped_transition_lower_bound(self.counts, self.loads, self.caps, self.devices, self.slots,
                                             self.max_copies, budget=budget, token_caps=self.token_caps)


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
    (`reslot_applies`), each start is polished by `local_search/reslot.reslot_search`, and a third
    start walks B's uncapped solution down to the caps (`reslot.tighten`); the replica
    counts returned are then the solution's own, which may differ from EPLB's rule.

    With `scenarios` (float [S, L, E], `held_out.py`): when the solution's expected
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
        hosts = run_stages(problem, hosts, packed, topology, slots, sweeps)
        hosts = repair_layers(problem, hosts, packed, slots)
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
    hosts = repair_layers(problem, hosts, packed, slots)
    if routed is not None:
        hosts, gain = routed_swaps(hosts, routed, problem.loads, problem.caps, problem.budget)
        info.update(finish="routed swaps", routed_gain=int(gain))
    return StagedSolution(hosts, hosts.sum(axis=2), problem.caps, problem.counts, info, problem.notes,
                          problem.max_copies)


def _routed_finish(best, routed, counts, loads, replicas, caps, packed, budget, solver):
    """Value the staged result and a routed layer chain on the planning trace itself, polish both
    by routed layer steps (`local_search/routed.py`) and keep the one with the most GPU-local
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
    return (placement_value(counts, hosts), hosts, info)


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
    value = placement_value(counts, hosts)
    if best is None or value > best[0] * (1 + 1e-12):
        return (value, hosts, info)
    return best
