"""Placement policies: invariants (hypothesis), ILP quality and bound, infeasibility, determinism."""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from moeplan.passes.analysis.trace.synth_planted import synthesize_trace
from moeplan.passes.analysis.trace.format import make_trace
from moeplan.passes.optimize.placement.policies import PlacementRequest, plan_placement
from moeplan.passes.optimize.placement.schema import Topology, validate_placement
from moeplan.core.errors import UserError


@pytest.fixture(scope="module")
def planted():
    return synthesize_trace(layers=6, experts=32, top_k=2, tokens=4000, affinity=0.7, zipf=0.5, seed=1)


def device_loads(placement, trace):
    hosts = placement.hosts()
    loads = trace.expert_loads().astype(float)
    return np.stack([hosts[l].T.astype(float) @ (loads[l] / hosts[l].sum(axis=1)) for l in range(len(loads))])


@st.composite
def problems(draw):
    nodes = draw(st.integers(1, 2))
    gpus = draw(st.integers(1, 3))
    D = nodes * gpus
    per_device = draw(st.integers(1, 4))
    E = D * per_device
    redundant = D * draw(st.integers(0, 1)) if D > 1 else 0
    L = draw(st.integers(1, 3))
    K = draw(st.integers(1, min(2, E)))
    T = draw(st.integers(5, 60))
    seed = draw(st.integers(0, 10_000))
    rng = np.random.default_rng(seed)
    experts = np.stack([np.stack([rng.choice(E, size=K, replace=False) for _ in range(L)]) for _ in range(T)])
    return make_trace(experts, num_experts=E), Topology(nodes, gpus), redundant


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems(), st.sampled_from(["eplb", "ilp"]))
def test_policy_invariants(problem, policy):
    trace, topology, redundant = problem
    E, D = trace.num_experts, topology.devices
    request = PlacementRequest(topology, policy, redundant, balance=10.0, time_limit=5)
    placement = plan_placement(trace, request)
    validate_placement(placement)  # every expert somewhere, replicas on distinct devices
    slots = (E + redundant) // D
    for devices in placement.layers:
        assert [len(d) for d in devices] == [slots] * D
        counts = np.bincount([e for d in devices for e in d], minlength=E)
        assert counts.min() >= 1 and counts.sum() == E + redundant
        if redundant == 0:
            assert np.all(counts == 1)
    m = placement.metrics
    for key in ("gpu_local_fraction", "node_local_fraction"):
        assert 0.0 <= m[key] <= 1.0
    assert m["gpu_local_fraction"] <= m["node_local_fraction"] + 1e-12
    assert m["max_over_mean_load"] >= 1.0 - 1e-9
    if policy == "ilp":
        assert m["bound"] <= m["objective"] + 1e-6 and 0.0 <= m["gap"] <= 1.0


@pytest.mark.slow
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 1000), st.sampled_from([0.1, 0.3]), st.sampled_from([0, 4]))
def test_ilp_respects_the_balance_cap_when_feasible(seed, balance, redundant):
    trace = synthesize_trace(layers=3, experts=16, top_k=2, tokens=400, affinity=0.6, zipf=0.3, seed=seed)
    request = PlacementRequest(Topology(2, 2), "ilp", redundant, balance=balance, time_limit=5)
    try:
        placement = plan_placement(trace, request)
    except UserError as exc:
        assert "infeasible at MoE layer" in str(exc)
        return
    loads = device_loads(placement, trace)
    caps = (1 + balance) * loads.mean(axis=1)
    assert np.all(loads.max(axis=1) <= caps * (1 + 1e-9))


def test_ilp_beats_contiguous_and_eplb_on_planted_affinity(planted):
    topology = Topology(2, 2)
    contiguous = plan_placement(planted, PlacementRequest(topology, "contiguous"))
    eplb = plan_placement(planted, PlacementRequest(topology, "eplb"))
    ilp = plan_placement(planted, PlacementRequest(topology, "ilp", balance=0.05, balance_base="eplb", time_limit=20))
    assert ilp.metrics["gpu_local_fraction"] >= 2 * contiguous.metrics["gpu_local_fraction"]
    assert ilp.metrics["gpu_local_fraction"] > eplb.metrics["gpu_local_fraction"]
    assert ilp.metrics["max_over_mean_load"] <= 1.05 * eplb.metrics["max_over_mean_load"] + 1e-9
    assert 0 <= ilp.metrics["bound"] <= ilp.metrics["objective"]
    assert ilp.metrics["objective"] == planted_cross(ilp)


def planted_cross(placement):
    m = placement.metrics
    return round((1 - m["gpu_local_fraction"]) * m["transitions"])


def test_ilp_with_replicas_balances_within_cap(planted):
    p = plan_placement(planted, PlacementRequest(Topology(2, 2), "ilp", redundant=4, balance=0.1, time_limit=20))
    assert p.metrics["max_over_mean_load"] <= 1.1 + 1e-9
    assert p.metrics["bound"] <= p.metrics["objective"]


def test_same_inputs_same_bytes(planted):
    request = PlacementRequest(Topology(2, 2), "ilp", redundant=4, time_limit=300)  # a safety net only: never reached
    assert plan_placement(planted, request).to_json() == plan_placement(planted, request).to_json()


def test_hot_expert_makes_tight_balance_infeasible_naming_layer_and_expert():
    experts = np.zeros((40, 2, 1), dtype=np.int64)
    experts[:, 0, 0] = np.arange(40) % 4
    experts[:, 1, 0] = np.where(np.arange(40) < 30, 2, np.arange(40) % 4)  # expert 2 hot at layer 1
    trace = make_trace(experts, num_experts=4)
    with pytest.raises(UserError, match=r"infeasible at MoE layer 1: expert 2 .*--redundant"):
        plan_placement(trace, PlacementRequest(Topology(1, 4), "ilp", balance=0.1))
    # with replicas the hot expert splits and the cap can be met
    p = plan_placement(trace, PlacementRequest(Topology(1, 4), "ilp", redundant=4, balance=0.5, time_limit=5))
    assert p.metrics["max_over_mean_load"] <= 1.5 + 1e-9


@pytest.mark.parametrize("request_kwargs, message", [
    (dict(topology=Topology(3, 1), policy="contiguous"), "divisible"),
    (dict(topology=Topology(3, 1), policy="ilp"), "do not divide evenly"),
    (dict(topology=Topology(1, 2), policy="contiguous", redundant=2), "no replicas"),
    (dict(topology=Topology(1, 2), policy="eplb", redundant=34), "distinct devices"),
])
def test_infeasible_requests_name_the_constraint(planted, request_kwargs, message):
    with pytest.raises(UserError, match=message):
        plan_placement(planted, PlacementRequest(**request_kwargs))


def test_gurobi_request_falls_back_with_a_note_when_unavailable(planted):
    pytest.importorskip("highspy")
    try:
        import gurobipy  # noqa: F401
    except ImportError:
        p = plan_placement(planted, PlacementRequest(Topology(2, 2), "ilp", solver="gurobi", balance=0.05,
                                                     balance_base="eplb", time_limit=10))
        assert any("gurobipy is not installed" in note for note in p.metrics.get("notes", []))
    else:
        p = plan_placement(planted, PlacementRequest(Topology(2, 2), "ilp", solver="gurobi", balance=0.05,
                                                     balance_base="eplb", time_limit=10))
        assert p.metrics["gpu_local_fraction"] > 0


def test_gurobi_size_limited_licence_falls_back_to_highs():
    pytest.importorskip("gurobipy")
    import scipy.sparse as sp
    from moeplan.passes.optimize.milp import solve_milp
    n = 3000  # over the pip licence's ~2000-variable limit
    r = solve_milp(-np.ones(n), sp.csr_matrix(np.ones((1, n))), np.array([-np.inf]), np.array([10.0]),
                   np.zeros(n), np.ones(n), np.ones(n, dtype=bool), time_limit=5, solver="gurobi")
    assert r.objective == pytest.approx(-10.0)
    assert any("size-limited" in note for note in r.notes)


@settings(max_examples=20, deadline=None)
@given(st.integers(0, 10_000))
def test_transition_bound_never_exceeds_the_true_minimum(seed):
    """Brute force over every balanced 2-partition of two layers of 6 experts: the reported bound (no binding load
    cap: each layer's total) holds, and it is at least the counting and dual bounds it takes the maximum of."""
    import itertools
    from moeplan.passes.optimize.placement.bounds.pairwise import capped_transition_lower_bound, counting_bound, dual_bound
    rng = np.random.default_rng(seed)
    counts = rng.integers(0, 5, size=(1, 6, 6)).astype(float)
    halves = [np.array([1 if i in combo else 0 for i in range(6)]) for combo in itertools.combinations(range(6), 3)]
    best = min(float(counts[0][np.not_equal.outer(a, b)].sum()) for a in halves for b in halves)
    loads = np.ones((2, 6))
    bound, _ = capped_transition_lower_bound(counts, loads, loads.sum(axis=1), partitions=2, slots_per_partition=3)
    assert counting_bound(counts[0], 3, 3) <= bound + 1e-9
    assert dual_bound(counts[0], 3, 3) <= bound + 1e-9
    assert bound <= best + 1e-6


def test_replica_runs_get_fewer_sweeps_only_at_deepseek_scale():
    from moeplan.passes.optimize.placement.budget import WorkBudget
    from moeplan.passes.optimize.placement.algorithms.ilp import MAX_SWEEPS, sweep_limit

    budget = WorkBudget()
    assert sweep_limit(budget, 58, 256, 256, 64) == MAX_SWEEPS  # no replicas: the full budget
    assert sweep_limit(budget, 12, 64, 72, 8) == MAX_SWEEPS  # planted 8-GPU case
    assert 2 <= sweep_limit(budget, 58, 256, 320, 64) < MAX_SWEEPS  # DeepSeek-V3 + 64 slots
    assert sweep_limit(WorkBudget(effort=4.0), 58, 256, 320, 64) > sweep_limit(budget, 58, 256, 320, 64)


def test_the_bound_covers_the_whole_search_space_not_only_the_copies_used(planted):
    """The reported bound assumes the most copies of an expert any placement in the planner's space may take
    (EPLB's largest count), not the returned placement's own largest count, which re-slotting may lower."""
    from moeplan.passes.analysis.affinity import transition_counts
    from moeplan.passes.optimize.placement.bounds.pairwise import capped_transition_lower_bound
    from moeplan.passes.optimize.placement.budget import WorkBudget
    from moeplan.passes.optimize.placement.algorithms.ilp import staged_placement
    from moeplan.passes.optimize.placement.algorithms.ilp_caps import eplb_replicas_and_caps

    topology, redundant = Topology(2, 2), 4
    loads = planted.expert_loads().astype(float)
    counts = transition_counts(planted, "current")
    replicas, caps = eplb_replicas_and_caps(loads, topology.devices, redundant, 0.1, "mean")
    solution = staged_placement(counts, loads, topology, redundant, 0.1, "mean", "highs", WorkBudget())
    assert solution.max_copies == replicas.max() > 1
    placement = plan_placement(planted, PlacementRequest(topology, "ilp", redundant=redundant, balance=0.1,
                                                         held_out_caps=False, time_limit=300))
    slots = (planted.num_experts + redundant) // topology.devices
    expected, _ = capped_transition_lower_bound(counts, loads, caps, topology.devices, slots, int(replicas.max()))
    assert placement.metrics["bound"] == pytest.approx(expected)
    assert placement.metrics["bound"] <= placement.metrics["objective"]
