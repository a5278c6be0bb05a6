"""The relaxations the placement bounds rest on, in order: co-location <= free routing <= the metric (issue 15)."""
import sys
from pathlib import Path

import numpy as np
from hypothesis import given, settings, strategies as st

from moeplan.passes.analysis.affinity import transition_counts
from moeplan.passes.analysis.trace.format import make_trace
from moeplan.passes.optimize.placement.bounds.pairwise import source_token_caps
from moeplan.passes.optimize.placement.schema import Topology
from moeplan.passes.optimize.placement.metrics import score_placement
from test_placement_routed import random_trace

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from research.relaxed_routing import colocation_cross, free_routing_cross


def random_hosts(rng, layers, experts, devices, slots):
    """bool [L, E, D]: every expert somewhere, up to `slots` distinct experts per device (replicas fill the rest)."""
    hosts = np.zeros((layers, experts, devices), dtype=bool)
    for l in range(layers):
        order = rng.permutation(experts)
        hosts[l, order, np.arange(experts) % devices] = True
        for d in range(devices):
            free = np.flatnonzero(~hosts[l, :, d])
            need = min(slots - int(hosts[l, :, d].sum()), len(free))
            if need > 0:
                hosts[l, rng.choice(free, size=need, replace=False), d] = True
    return hosts


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 10_000), st.sampled_from([(6, 2, 2, 4), (8, 4, 2, 3), (6, 3, 1, 3), (8, 2, 4, 3)]), st.booleans())
def test_colocation_then_free_routing_then_the_metric(seed, shape, skips):
    """For any placement, the co-location count <= the free-routing count <= the metric's cross-GPU
    count, tokens that skip a layer included: so a bound on either relaxation bounds the metric.
    The per-token caps' count (top-4 on 3 slots binds them) is at most the free-routing count."""
    E, D, top_k, slots = shape
    rng = np.random.default_rng(seed)
    trace = random_trace(rng, 60, 4, E, top_k, skew=rng.random())
    if skips:
        experts = trace.experts.copy()
        experts[rng.random(60) < 0.2, rng.integers(4)] = -1
        trace = make_trace(experts, num_experts=E, sequence=trace.sequence)
    hosts = random_hosts(rng, 4, E, D, slots)
    metric = score_placement(trace, hosts, Topology(1, D)).cross_gpu_transitions
    coloc, free = colocation_cross(trace, hosts), free_routing_cross(trace, hosts)
    assert 0 <= coloc <= free <= metric
    # the per-token caps bound free routing (not co-location): a token keeps at most `slots` choices local
    per_token = transition_counts(trace, "current").sum() - source_token_caps(trace, slots).sum()
    assert per_token <= free + 1e-9


def test_a_replicated_expert_shows_the_difference():
    """Tokens of expert 0 (on both GPUs) choose 1 and 2, which sit on different GPUs: co-location
    keeps both local, one copy per token keeps one, and the metric (tokens stay where they came
    from, GPU 0) too."""
    experts = np.array([[[0, -1], [1, 2]]] * 4, dtype=np.int32)
    trace = make_trace(experts, num_experts=3)
    hosts = np.zeros((2, 3, 2), dtype=bool)
    hosts[0, 0, :] = True
    hosts[0, 1, 0] = hosts[0, 2, 1] = True
    hosts[1, 0, 0] = hosts[1, 1, 0] = hosts[1, 2, 1] = hosts[1, 0, 1] = True
    assert colocation_cross(trace, hosts) == 0
    assert free_routing_cross(trace, hosts) == 4
    assert score_placement(trace, hosts, Topology(1, 2)).cross_gpu_transitions == 4
