"""The per-pair compact MILP (`benchmarks/research/pair_milp.py`): its bound never passes the true pair optimum, its best
placement never beats it, and solved to the end both meet it (brute force over every placement)."""
import itertools
import sys
from pathlib import Path

import numpy as np
from hypothesis import given, settings, strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from research.pair_milp import pair_cross_milp


def layer_placements(E, P, Q, loads, cap):
    """Every bool [E, P] with Q experts per GPU, each expert on one GPU, GPU loads within the cap."""
    for labels in itertools.product(range(P), repeat=E):
        hosts = np.zeros((E, P), dtype=bool)
        hosts[np.arange(E), labels] = True
        if (hosts.sum(axis=0) == Q).all() and (loads @ hosts <= cap + 1e-9).all():
            yield hosts


def true_min_cross(counts, loads, caps, P, Q):
    E = counts.shape[0]
    best = None
    for hf in layer_placements(E, P, Q, loads[0], caps[0]):
        for ht in layer_placements(E, P, Q, loads[1], caps[1]):
            local = (counts * ((hf.astype(float) @ ht.T.astype(float)) > 0)).sum()
            best = local if best is None else max(best, local)
    return None if best is None else counts.sum() - best


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), shape=st.sampled_from([(6, 2), (6, 3), (4, 2)]), slack=st.floats(1.0, 1.6))
def test_pair_milp_brackets_the_true_pair_optimum(seed, shape, slack):
    E, P = shape
    Q = E // P
    rng = np.random.default_rng(seed)
    counts = rng.integers(0, 20, (E, E)).astype(float) * (rng.random((E, E)) < 0.5)
    loads = rng.random((2, E)) * 10 + 0.1
    caps = loads.sum(axis=1) / P * slack
    truth = true_min_cross(counts, loads, caps, P, Q)
    bound, best = pair_cross_milp(counts, loads[0], loads[1], caps[0], caps[1], P, Q, node_limit=10_000)
    if truth is None:
        assert best == float("inf")
        return
    assert bound <= truth + 1e-6 <= best + 2e-6
    assert abs(bound - truth) <= 1e-3 * max(1.0, truth) + 1e-6 and abs(best - truth) <= 1e-6


def test_a_node_limit_keeps_the_bound_valid_and_a_start_is_kept():
    """Stopped at one node the bound is still below the best, and the start's cross is never beaten by the answer."""
    rng = np.random.default_rng(3)
    E, P, Q = 12, 3, 4
    counts = rng.integers(0, 30, (E, E)).astype(float) * (rng.random((E, E)) < 0.3)
    loads = np.ones((2, E))
    start = np.zeros((2, E, P), dtype=bool)
    start[:, np.arange(E), np.arange(E) // Q] = True
    start_cross = counts.sum() - (counts * (start[0].astype(float) @ start[1].T.astype(float) > 0)).sum()
    bound, best = pair_cross_milp(counts, loads[0], loads[1], Q, Q, P, Q, node_limit=1, start=start)
    assert 0.0 <= bound <= best <= start_cross


def test_gap_benchmark_pair_columns_bracket_the_pairwise_optimum():
    """`placement_gap.py --pair-milp`: the pairs' MILP bound is below their best placements, which (started
    from the placement) are no worse than the placement itself, so the pairwise floor lies in [0, 1]."""
    from placement_gap import pair_milp_columns
    from moeplan.passes.analysis.affinity import transition_counts
    from moeplan.passes.analysis.trace.synth_planted import synthesize_trace
    from moeplan.passes.optimize.placement.schema import Topology
    from moeplan.passes.optimize.placement.policies import PlacementRequest, plan_placement

    trace = synthesize_trace(layers=4, experts=8, top_k=2, tokens=600, affinity=0.6, zipf=0.6, seed=5)
    topology = Topology(1, 2)
    placement = plan_placement(trace, PlacementRequest(topology, "ilp", balance=0.1, time_limit=300))
    m = placement.metrics
    row = pair_milp_columns(trace, placement.hosts(), topology, (0.1, "mean"), m["objective"], m["bound"], 2000)
    counts = transition_counts(trace, "current")
    assert 0.0 <= row["pair_milp_bound"] <= row["pair_best_cross"] + 1e-6 <= m["objective"] + 2e-6
    assert row["pair_milp_bound"] <= m["objective"] <= counts.sum()
    # the floor binds bounds argued pair by pair (the whole-column bound may pass it)
    assert 0.0 <= row["gap_floor_pairwise"] <= 1 - row["pair_milp_bound"] / m["objective"] + 1e-9 <= 1.0
    assert 0.0 <= row["pair_milp_gap"] <= 1.0
