"""GPU-level exchange sweeps (`local_search/gpu_sweeps.py`), the ilp's search at DeepSeek-V3 scale, and
`held_out_balance` (caps meant for held-out traffic)."""
import numpy as np
from hypothesis import given, settings, strategies as st

from moeplan.passes.analysis.affinity import transition_counts
from moeplan.passes.analysis.trace.synth_planted import synthesize_trace
from moeplan.passes.optimize.placement.budget import WorkBudget
from moeplan.passes.optimize.placement.schema import Topology
from moeplan.passes.optimize.placement.algorithms.eplb import replica_counts
from moeplan.passes.optimize.placement.local_search.gpu_sweeps import gpu_sweeps
from moeplan.passes.optimize.placement.held_out import expected_max_loads, load_scenarios
from moeplan.passes.optimize.placement.algorithms.ilp import reslot_applies, staged_placement
from moeplan.passes.optimize.placement.algorithms.ilp_caps import initial_hosts
from moeplan.passes.optimize.placement.even_split import placement_value
from moeplan.passes.optimize.placement.metrics import max_gpu_loads
from moeplan.passes.optimize.placement.local_search.routed import RoutedTrace


def planted(seed, tokens=3000):
    return synthesize_trace(layers=4, experts=32, top_k=2, tokens=tokens, affinity=0.7, zipf=0.8, seed=seed)


def value(counts, hosts):
    return placement_value(counts, hosts)


@settings(max_examples=8, deadline=None)
@given(st.integers(0, 10_000), st.floats(1.02, 1.3))
def test_sweeps_keep_copies_and_slots_meet_the_caps_and_never_lose_value(seed, cap_over_mean):
    trace = planted(seed)
    loads = trace.expert_loads().astype(float)
    counts = transition_counts(trace)
    D, slots = 8, 5
    replicas = np.stack([replica_counts(loads[l], D * slots, D) for l in range(len(loads))])
    packed = initial_hosts(loads, replicas, D, slots)
    caps = np.maximum(loads.sum(axis=1) / D * cap_over_mean, max_gpu_loads(packed, loads))
    hosts, sweeps = gpu_sweeps(packed, counts, loads, caps, 4, WorkBudget(effort=0.25))
    assert sweeps >= 1
    assert np.array_equal(hosts.sum(axis=2), replicas) and np.all(hosts.sum(axis=1) == slots)
    assert np.all(max_gpu_loads(hosts, loads) <= caps * (1 + 1e-9))
    assert value(counts, hosts) >= value(counts, packed) - 1e-9


def crowd_gpu_zero(layer, per_copy, swaps):
    """bool [E, D] with GPU 0's lightest copies exchanged for the heaviest copies elsewhere."""
    layer = layer.copy()
    for _ in range(swaps):
        light = min(np.flatnonzero(layer[:, 0]), key=lambda e: per_copy[e])
        options = [(per_copy[e], e, q) for q in range(1, layer.shape[1]) for e in np.flatnonzero(layer[:, q])
                   if not layer[e, 0] and not layer[light, q]]
        _, heavy, q = max(options)
        layer[light, 0], layer[heavy, q] = False, False
        layer[heavy, 0], layer[light, q] = True, True
    return layer


def test_sweeps_repair_a_layer_over_its_cap_first():
    trace = planted(1)
    loads = trace.expert_loads().astype(float)
    D, slots = 8, 5
    replicas = np.stack([replica_counts(loads[l], D * slots, D) for l in range(len(loads))])
    packed = initial_hosts(loads, replicas, D, slots)
    caps = max_gpu_loads(packed, loads) * 1.01
    skewed = packed.copy()
    skewed[2] = crowd_gpu_zero(packed[2], loads[2] / replicas[2], 3)
    assert max_gpu_loads(skewed, loads)[2] > caps[2]
    hosts, _ = gpu_sweeps(skewed, transition_counts(trace), loads, caps, 4, WorkBudget(effort=0.5))
    assert max_gpu_loads(hosts, loads)[2] <= caps[2] * (1 + 1e-9)
    assert np.array_equal(hosts.sum(axis=2), replicas)


def test_at_scale_the_ilp_runs_gpu_sweeps_and_reslots_and_held_out_balance_lowers_the_expected_held_out_max():
    """effort 0.1 puts this small case past the re-slotting size, so it takes the DeepSeek-V3-scale path."""
    trace = planted(2, tokens=6000)
    loads = trace.expert_loads().astype(float)
    counts = transition_counts(trace)
    topology = Topology(2, 4)
    budget = lambda: WorkBudget(effort=0.1)
    assert not reslot_applies(32 + 8, 8, budget())
    routed = RoutedTrace.from_trace(trace, 4)
    scenarios = load_scenarios(trace)
    plain = staged_placement(counts, loads, topology, 8, 0.1, "mean", "highs", budget(), routed, scenarios)
    assert "gpu_sweeps" in plain.sweeps and "reslot_moves" in plain.sweeps  # re-slotting runs at scale too
    assert plain.replicas.max() <= plain.max_copies and (plain.hosts.sum(axis=1) == 5).all()
    assert np.all(max_gpu_loads(plain.hosts, loads) <= plain.caps * (1 + 1e-9))
    robust = staged_placement(counts, loads, topology, 8, 0.1, "mean", "highs", budget(), routed, scenarios,
                              held_out_balance=True)
    assert np.all(robust.caps <= plain.caps + 1e-9)
    mean = loads.sum(axis=1) / 8
    assert (expected_max_loads(robust.hosts, loads, scenarios) / mean).mean() < \
        (expected_max_loads(plain.hosts, loads, scenarios) / mean).mean()


def test_held_out_balance_on_a_trace_too_short_for_scenarios_says_so():
    trace = planted(3, tokens=200)
    loads = trace.expert_loads().astype(float)
    assert len(load_scenarios(trace)) == 0
    solution = staged_placement(transition_counts(trace), loads, Topology(2, 4), 8, 0.5, "mean", "highs",
                                WorkBudget(effort=0.1), None, load_scenarios(trace), held_out_balance=True)
    assert any("too short" in note for note in solution.notes)
    assert np.all(max_gpu_loads(solution.hosts, loads) <= solution.caps * (1 + 1e-9))
