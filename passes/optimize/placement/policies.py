"""Expert placement's entry point: a request (topology, policy, slots, caps, work) in, a scored `Placement` out.

`plan_placement` checks the request against the trace, runs the algorithm it names
(`algorithms/`: contiguous, eplb, ilp) and scores the result with the placement metric
(`metrics.score_placement`); an ilp placement also records its objective (cross-GPU transitions),
a valid lower bound (`bounds/`) and the gap. `evaluate_placement` scores an existing placement on
another trace.

`ilp` work is set by `effort` (a multiplier on sweeps, exchange moves, branch-and-bound nodes and
LP sizes; `budget.py`), never by the clock, so the same inputs give the same bytes on any
machine. `time_limit` is a safety net: when it stops the solve, metrics say
`stopped_by: "time_limit"` and a note warns that the result may not be reproducible.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from moeplan.core import progress
from moeplan.passes.analysis.trace.format import Trace
from moeplan.passes.optimize.milp import relative_gap
from moeplan.passes.optimize.placement.algorithms import PlacementAlgorithm, algorithm_named, place_experts
from moeplan.passes.optimize.placement.algorithms.ilp import time_limit_note
from moeplan.passes.optimize.placement.algorithms.ilp_caps import BALANCE_BASES
from moeplan.passes.optimize.placement.budget import DEFAULT_EFFORT
from moeplan.passes.optimize.placement.schema import Placement, Topology
from moeplan.passes.optimize.placement.metrics import score_placement
from moeplan.core.errors import UserError

SOLVERS = ("highs", "gurobi")


@dataclass(frozen=True)
class PlacementRequest:
    topology: Topology
    policy: str = "ilp"
    redundant: int = 0
    balance: float = 0.1
    balance_base: str = "mean"
    solver: str = "highs"
    time_limit: float = 300.0  # ilp: wall-clock safety net only
    expert_groups: int = 0
    effort: float = DEFAULT_EFFORT  # ilp: work multiplier (sweeps, moves, B&B nodes, LP size)
    held_out_caps: bool = True  # ilp: lower caps where loads would rise more on unseen traffic than EPLB's (`held_out.py`)
    held_out_balance: bool = False  # ilp: `balance` bounds the expected held-out max load, not the planning trace's
    bound: bool = True  # ilp: compute the lower bound and gap now; False: `finish_placement` computes them if kept


def check_request(trace: Trace, request: PlacementRequest) -> None:
    """Reject requests no placement can satisfy, naming the constraint."""
    E, D = trace.num_experts, request.topology.devices
    if request.topology.nodes < 1 or request.topology.gpus_per_node < 1:
        raise UserError(f"--nodes and --gpus-per-node must be at least 1, got {request.topology.nodes} and {request.topology.gpus_per_node}")
    algorithm = algorithm_named(request.policy)
    if request.solver not in SOLVERS:
        raise UserError(f"--solver must be one of {', '.join(SOLVERS)}, got {request.solver!r}")
    if request.balance_base not in BALANCE_BASES:
        raise UserError(f"--balance-base must be one of {', '.join(BALANCE_BASES)}, got {request.balance_base!r}")
    if request.redundant < 0:
        raise UserError(f"--redundant must be >= 0, got {request.redundant}")
    if request.balance < 0:
        raise UserError(f"--balance must be >= 0, got {request.balance}")
    if request.time_limit <= 0:
        raise UserError(f"--time-limit must be positive, got {request.time_limit}")
    if not request.effort > 0:
        raise UserError(f"--effort must be positive, got {request.effort}")
    if algorithm is PlacementAlgorithm.CONTIGUOUS:
        if request.redundant:
            raise UserError("the contiguous policy places no replicas; drop --redundant or use --policy eplb/ilp")
        if E % D:
            raise UserError(f"contiguous placement needs the experts per layer ({E}) divisible by the devices ({D} = {request.topology.nodes} nodes x {request.topology.gpus_per_node} GPUs)")
        return
    slots = E + request.redundant
    if slots % D:
        raise UserError(
            f"{E} experts + {request.redundant} redundant slots = {slots} expert slots per layer do not divide evenly "
            f"over {D} devices ({request.topology.nodes} nodes x {request.topology.gpus_per_node} GPUs); "
            f"pick --redundant so that experts + redundant is a multiple of {D}"
        )
    if request.redundant > E * (D - 1):
        raise UserError(
            f"--redundant {request.redundant} is more than the {E * (D - 1)} redundant slots {D} devices can hold: "
            f"replicas of an expert go on distinct devices, so each of the {E} experts has at most {D} copies"
        )
    if slots < D:
        raise UserError(f"{slots} expert slots per layer cannot fill {D} devices; use fewer devices or more --redundant slots")


def plan_placement(trace: Trace, request: PlacementRequest) -> Placement:
    """Run the requested policy and return the placement with its metrics."""
    check_request(trace, request)
    start = time.perf_counter()
    topology = request.topology
    algorithm = algorithm_named(request.policy)
    hosts, extra = place_experts(algorithm, trace, request, start)
    score = score_placement(trace, hosts, topology)
    metrics = {
        "gpu_local_fraction": score.gpu_local_fraction,
        "node_local_fraction": score.node_local_fraction,
        "max_over_mean_load": score.max_over_mean_load,
        "transitions": score.transitions,
        "redundant": request.redundant,
    }
    metrics = without_unknown_locality(metrics, trace)
    deferred = None
    if algorithm is PlacementAlgorithm.ILP:
        objective = float(score.cross_gpu_transitions)
        deferred = extra.pop("deferred_bound", None)
        if deferred is None:
            bound = min(extra.pop("bound"), objective)
            metrics.update(objective=objective, bound=bound, gap=relative_gap(objective, bound),
                           solve_seconds=time.perf_counter() - start, **extra)
        else:
            metrics.update(objective=objective, solve_seconds=time.perf_counter() - start, **extra)
        metrics["balance"] = request.balance
        metrics["balance_base"] = request.balance_base
        metrics["effort"] = request.effort
        if request.held_out_balance:
            metrics["held_out_balance"] = True
    placement = Placement.from_hosts(request.policy, topology, hosts, metrics)
    placement.deferred_bound = deferred
    return placement


def finish_placement(placement: Placement) -> Placement:
    """Compute what `plan_placement` left for later (an ILP's bound and gap, `PlacementRequest.bound`)."""
    deferred = getattr(placement, "deferred_bound", None)
    if deferred is None:
        return placement
    budget = deferred.budget()
    with progress.step(f"ilp, balance {placement.metrics.get('balance', 0):g}: lower bound of the placement kept"):
        bound, method = deferred.compute(budget)
    metrics = placement.metrics
    bound = min(bound, metrics["objective"])
    metrics.update(bound=bound, bound_method=method, gap=relative_gap(metrics["objective"], bound))
    if budget.timed_out and metrics.get("stopped_by") != "time_limit":
        metrics["stopped_by"] = "time_limit"
        metrics["notes"] = list(metrics.get("notes", [])) + [time_limit_note(deferred.time_limit, deferred.effort)]
    placement.deferred_bound = None
    return placement


def evaluate_placement(placement: Placement, trace: Trace) -> dict:
    """Score an existing placement on another trace (held-out generalisation)."""
    if placement.num_experts < trace.num_experts:
        raise UserError(f"the placement covers {placement.num_experts} experts per layer but the trace routes to {trace.num_experts}")
    score = score_placement(trace, placement.hosts(), placement.topology)
    return without_unknown_locality({"gpu_local_fraction": score.gpu_local_fraction,
                                     "node_local_fraction": score.node_local_fraction,
                                     "max_over_mean_load": score.max_over_mean_load, "transitions": score.transitions}, trace)


LOCALITY_METRICS = ("gpu_local_fraction", "node_local_fraction", "transitions")


def without_unknown_locality(metrics: dict, trace: Trace) -> dict:
    """A loads-only trace has no tokens to follow: its locality is unknown, not zero, so it is left out."""
    if not trace.loads_only:
        return metrics
    return {k: v for k, v in metrics.items() if k not in LOCALITY_METRICS}
