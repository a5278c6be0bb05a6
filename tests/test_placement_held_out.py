"""Held-out load model (scenarios from the planning trace) and the caps it lowers (issue 15)."""
import numpy as np
from hypothesis import given, settings, strategies as st

from moeplan.passes.analysis.trace.format import make_trace
from moeplan.passes.optimize.placement.schema import Topology
from moeplan.passes.optimize.placement.held_out import expected_max_loads, held_out_caps, load_scenarios
from moeplan.passes.optimize.placement.algorithms.ilp_caps import initial_hosts, layer_caps
from moeplan.passes.optimize.placement.algorithms.eplb import replica_counts
from moeplan.passes.optimize.placement.metrics import max_gpu_loads
from moeplan.passes.optimize.placement.policies import PlacementRequest, plan_placement


def drifting_trace(seed, tokens=2048, layers=2, experts=8, top_k=1, sequence_length=64):
    """Later sequences favour experts 0 and 1 together (a topic shift), earlier ones 2 and 3."""
    rng = np.random.default_rng(seed)
    sequence = np.arange(tokens) // sequence_length
    late = sequence >= sequence.max() / 2
    p_early = np.full(experts, 1.0)
    p_early[[2, 3]] = 4.0
    p_late = np.full(experts, 1.0)
    p_late[[0, 1]] = 4.0
    chosen = np.empty((tokens, layers, top_k), dtype=np.int32)
    for t in range(tokens):
        p = p_late if late[t] else p_early
        for l in range(layers):
            chosen[t, l] = rng.choice(experts, size=top_k, replace=False, p=p / p.sum())
    return make_trace(chosen, num_experts=experts, sequence=sequence)


@settings(max_examples=10, deadline=None)
@given(st.integers(0, 10_000), st.sampled_from([1, 2]))
def test_scenarios_keep_the_total_and_never_predict_below_the_planning_max(seed, top_k):
    trace = drifting_trace(seed, tokens=1024, top_k=top_k)
    scenarios = load_scenarios(trace)
    loads = trace.expert_loads().astype(float)
    assert scenarios.shape[1:] == loads.shape and len(scenarios) % 2 == 0
    assert np.allclose(scenarios.sum(axis=2), 0.0, atol=1e-6 * loads.sum())  # a block scaled to the layer's total
    assert np.allclose(scenarios[: len(scenarios) // 2], -scenarios[len(scenarios) // 2:])
    rng = np.random.default_rng(seed)
    replicas = np.stack([replica_counts(loads[l], 12, 4) for l in range(len(loads))])
    hosts = initial_hosts(loads, replicas, 4, 3)
    for l in range(len(hosts)):
        hosts[l] = hosts[l][:, rng.permutation(4)]
    planned = max_gpu_loads(hosts, loads)
    assert np.all(expected_max_loads(hosts, loads, scenarios) >= planned - 1e-9)  # symmetric scenarios: convexity
    assert np.allclose(expected_max_loads(hosts, loads, scenarios[:0]), planned)


def test_experts_that_rise_together_are_predicted_to_overload_the_gpu_they_share():
    """Experts 0 and 1 rise together late in the trace: a GPU holding both moves more than GPUs
    that hold one each, which independent per-expert noise would not tell apart."""
    trace = drifting_trace(0, tokens=4096)
    loads = trace.expert_loads().astype(float)
    scenarios = load_scenarios(trace)
    together = np.zeros((2, 8, 4), dtype=bool)
    apart = np.zeros((2, 8, 4), dtype=bool)
    for l in range(2):
        for e, p in enumerate([0, 0, 1, 1, 2, 2, 3, 3]):
            together[l, e, p] = True
        for e, p in enumerate([0, 1, 0, 1, 2, 3, 2, 3]):  # 0 with 2 and 1 with 3: each GPU one rising, one falling
            apart[l, e, p] = True
    assert np.all(expected_max_loads(together, loads, scenarios) > expected_max_loads(apart, loads, scenarios) * 1.05)


@settings(max_examples=15, deadline=None)
@given(st.integers(0, 10_000), st.floats(0.0, 0.3))
def test_held_out_caps_only_lower_caps_and_respect_the_floor(seed, balance):
    trace = drifting_trace(seed, tokens=1024)
    loads = trace.expert_loads().astype(float)
    replicas = np.stack([replica_counts(loads[l], 12, 4) for l in range(len(loads))])
    packed = initial_hosts(loads, replicas, 4, 3)
    caps = layer_caps(loads, replicas, 4, 3, balance, "eplb")
    rng = np.random.default_rng(seed)
    hosts = packed.copy()
    for l in range(len(hosts)):
        hosts[l] = hosts[l][:, rng.permutation(4)]
    floor = 0.9 * caps
    lowered = held_out_caps(hosts, packed, loads, caps, caps, load_scenarios(trace), floor)
    assert np.all(lowered <= caps + 1e-9) and np.all(lowered >= floor - 1e-9)
    # the packing itself rises exactly as much as the packing: nothing to lower
    assert np.allclose(held_out_caps(packed, packed, loads, caps, caps, load_scenarios(trace), floor), caps)


def test_ilp_with_held_out_caps_meets_the_requested_caps_and_does_not_rise_more_than_without():
    trace = drifting_trace(1, tokens=4096, top_k=2)
    topology = Topology(2, 2)
    request = dict(policy="ilp", redundant=4, balance=0.0, balance_base="eplb", effort=0.5)
    loads = trace.expert_loads().astype(float)
    scenarios = load_scenarios(trace)
    robust = plan_placement(trace, PlacementRequest(topology, **request))
    plain = plan_placement(trace, PlacementRequest(topology, held_out_caps=False, **request))
    replicas = np.stack([replica_counts(loads[l], 12, 4) for l in range(len(loads))])
    caps = layer_caps(loads, replicas, 4, 3, 0.0, "eplb")
    assert np.all(max_gpu_loads(robust.hosts(), loads) <= caps * (1 + 1e-9))
    assert expected_max_loads(robust.hosts(), loads, scenarios).mean() <= \
        expected_max_loads(plain.hosts(), loads, scenarios).mean() + 1e-9
    assert 0.0 <= robust.metrics["bound"] <= robust.metrics["objective"]
