"""Expert placement: decide, per MoE layer, which GPU hosts which experts (and replicas).

Policies, all returning a `Placement` scored by `metrics.score_placement`:
- `contiguous`: expert i on device i // (E / D) at every layer (DeepSpeed-MoE's default);
- `eplb`: DeepSeek's Expert Parallelism Load Balancer, our implementation (`eplb`);
- `ilp`: ExFlow's staged affinity ILP with a load cap and redundant slots (`ilp`),
  reporting objective (cross-GPU transitions), a valid lower bound (`bound`) and gap.

`ilp` work is set by `effort` (a multiplier on sweeps, exchange moves, branch-and-bound nodes and
LP sizes; `budget`), never by the clock, so the same inputs give the same bytes on any
machine. `time_limit` is a safety net: when it stops the solve, metrics say
`stopped_by: "time_limit"` and a note warns that the result may not be reproducible.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from moeplan.passes.analysis.affinity import transition_counts
from moeplan.passes.analysis.trace.format import Trace
from moeplan.passes.optimize.milp import relative_gap
from moeplan.passes.optimize.placement.bound import capped_transition_lower_bound, source_token_caps
from moeplan.passes.optimize.placement.budget import DEFAULT_EFFORT, WorkBudget
from moeplan.passes.optimize.placement.eplb import eplb_placement
from moeplan.passes.optimize.placement.held_out import load_scenarios
from moeplan.passes.optimize.placement.ilp import BALANCE_BASES, staged_placement
from moeplan.passes.optimize.placement.metrics import score_placement
from moeplan.passes.optimize.placement.routed import RoutedTrace
from moeplan.passes.optimize.placement.decision import Placement, Topology
from moeplan.planner.errors import UserError

POLICIES = ("ilp", "eplb", "contiguous")
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


def check_request(trace: Trace, request: PlacementRequest) -> None:
    """Reject requests no placement can satisfy, naming the constraint."""
    E, D = trace.num_experts, request.topology.devices
    if request.topology.nodes < 1 or request.topology.gpus_per_node < 1:
        raise UserError(f"--nodes and --gpus-per-node must be at least 1, got {request.topology.nodes} and {request.topology.gpus_per_node}")
    if request.policy not in POLICIES:
        raise UserError(f"--policy must be one of {', '.join(POLICIES)}, got {request.policy!r}")
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
    if request.policy == "contiguous":
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
    L, E = trace.num_layers, trace.num_experts
    loads = trace.expert_loads().astype(np.float64)
    extra = {}
    if request.policy == "contiguous":
        hosts = contiguous_placement(L, E, topology)
    elif request.policy == "eplb":
        hosts = eplb_placement(loads, topology, request.redundant, request.expert_groups)
    else:
        hosts, extra = _ilp(trace, loads, request, start)
    score = score_placement(trace, hosts, topology)
    metrics = {
        "gpu_local_fraction": score.gpu_local_fraction,
        "node_local_fraction": score.node_local_fraction,
        "max_over_mean_load": score.max_over_mean_load,
        "transitions": score.transitions,
        "redundant": request.redundant,
    }
    metrics = without_unknown_locality(metrics, trace)
    if request.policy == "ilp":
        objective = float(score.cross_gpu_transitions)
        bound = min(extra.pop("bound"), objective)
        metrics.update(objective=objective, bound=bound, gap=relative_gap(objective, bound),
                       solve_seconds=time.perf_counter() - start, **extra)
        metrics["balance"] = request.balance
        metrics["balance_base"] = request.balance_base
        metrics["effort"] = request.effort
        if request.held_out_balance:
            metrics["held_out_balance"] = True
    return Placement.from_hosts(request.policy, topology, hosts, metrics)


def _ilp(trace: Trace, loads: np.ndarray, request: PlacementRequest, start: float):
    topology = request.topology
    D = topology.devices
    counts = transition_counts(trace, "current")
    budget = WorkBudget(request.effort, deadline=start + 0.95 * request.time_limit)
    solution = staged_placement(counts, loads, topology, request.redundant, request.balance, request.balance_base,
                                request.solver, budget,
                                None if trace.loads_only else RoutedTrace.from_trace(trace, topology.gpus_per_node, counts),
                                load_scenarios(trace) if request.held_out_caps else None, request.held_out_balance)
    slots = (trace.num_experts + request.redundant) // D
    # the bound covers every placement the planner could have returned, so it assumes the search space's most
    # copies of an expert, not the fewer the returned placement may use
    max_copies = max(solution.max_copies, int(solution.replicas.max()))
    bound, method = capped_transition_lower_bound(counts, loads, solution.caps, D, slots, max_copies, budget=budget,
                                                  token_caps=source_token_caps(trace, slots))
    extra = {"bound": bound, "bound_method": method, "sweeps": solution.sweeps,
             "stopped_by": "time_limit" if budget.timed_out else "work"}
    notes = list(solution.notes)
    if budget.timed_out:
        notes.append(f"--time-limit {request.time_limit:g} s stopped the solve before its work budget "
                     f"(--effort {request.effort:g}) was spent: this placement depends on machine speed and load "
                     f"and may not be reproducible; raise --time-limit (or lower --effort) for a deterministic result")
    if notes:
        extra["notes"] = notes
    return solution.hosts, extra


def contiguous_placement(num_layers: int, num_experts: int, topology: Topology) -> np.ndarray:
    """bool [L, E, D]: expert i on device i // (E / D) at every layer (DeepSpeed-MoE's default)."""
    D = topology.devices
    hosts = np.zeros((num_layers, num_experts, D), dtype=bool)
    hosts[:, np.arange(num_experts), np.arange(num_experts) // (num_experts // D)] = True
    return hosts


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
