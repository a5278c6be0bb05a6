"""Routed layer steps, the layer-chain baseline and the load-capped bound (issue 15)."""
import itertools
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from moeplan.passes.analysis.affinity import transition_counts
from moeplan.passes.analysis.trace.format import make_trace
from moeplan.passes.optimize.placement.bounds.pairwise import capped_transition_lower_bound, source_token_caps
from moeplan.passes.optimize.placement.schema import Topology
from moeplan.passes.optimize.placement.algorithms.eplb import replica_counts
from moeplan.passes.optimize.placement.algorithms.ilp_caps import initial_hosts, layer_caps
from moeplan.passes.optimize.placement.metrics import score_placement
from moeplan.passes.optimize.placement.local_search.routed import (RoutedTrace, devices_after, local_transitions, routed_chain, routed_polish,
                                                      routed_tables)
from moeplan.core.errors import UserError

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from research.layer_chain import layer_chain_placement


def random_trace(rng, tokens, layers, experts, top_k, skew=1.0):
    popularity = rng.random(experts) ** (1 + 3 * skew)
    popularity /= popularity.sum()
    chosen = np.stack([[rng.choice(experts, size=top_k, replace=False, p=popularity) for _ in range(layers)]
                       for _ in range(tokens)])
    # affinity: half the tokens copy their previous layer's expert id (mod experts) shifted by the layer
    for l in range(1, layers):
        follow = rng.random(tokens) < 0.5
        chosen[follow, l, 0] = (chosen[follow, l - 1, 0] + l) % experts
        clash = (chosen[:, l, 1:] == chosen[:, l, :1]).any(axis=1) if top_k > 1 else np.zeros(tokens, bool)
        chosen[clash, l, 1:] = (chosen[clash, l, :1] + 1 + np.arange(top_k - 1)) % experts
    return make_trace(chosen.astype(np.int32), num_experts=experts, sequence=np.arange(tokens) // 16)


def setup(seed, redundant, balance=0.3, experts=8, nodes=2, gpus=2, top_k=2, layers=4):
    rng = np.random.default_rng(seed)
    trace = random_trace(rng, 300, layers, experts, top_k)
    topology = Topology(nodes, gpus)
    D = topology.devices
    loads = trace.expert_loads().astype(np.float64)
    replicas = np.stack([replica_counts(loads[l], experts + redundant, D) for l in range(layers)])
    slots = (experts + redundant) // D
    caps = layer_caps(loads, replicas, D, slots, balance, "eplb")
    return trace, topology, loads, replicas, caps, slots


def check_valid(hosts, loads, caps, slots, replicas=None):
    assert np.all(hosts.sum(axis=1) == slots)
    assert np.all(hosts.sum(axis=2) >= 1)
    if replicas is not None:
        assert np.array_equal(hosts.sum(axis=2), replicas)
    per_gpu = np.stack([(loads[l] / hosts[l].sum(axis=1)) @ hosts[l] for l in range(len(loads))])
    assert np.all(per_gpu.max(axis=1) <= caps * (1 + 1e-6))


@settings(max_examples=15, deadline=None)
@given(st.integers(0, 10_000), st.sampled_from([0, 4]))
def test_routed_counts_are_the_metrics_counts(seed, redundant):
    trace, topology, loads, replicas, caps, slots = setup(seed, redundant)
    rng = np.random.default_rng(seed + 1)
    hosts = initial_hosts(loads, replicas, topology.devices, slots)
    for l in range(len(hosts)):  # scramble the GPUs per layer so copies are not where the packing put them
        hosts[l] = hosts[l][:, rng.permutation(topology.devices)]
    score = score_placement(trace, hosts, topology)
    gpu, node = local_transitions(RoutedTrace.from_trace(trace, topology.gpus_per_node), hosts)
    assert gpu == score.transitions - score.cross_gpu_transitions
    assert node == score.transitions - score.cross_node_transitions


@settings(max_examples=15, deadline=None)
@given(st.integers(0, 10_000), st.integers(0, 3))
def test_routed_tables_value_a_layer_exactly_without_replicas(seed, l):
    """Without replicas a token sits on its heaviest expert's only GPU, wherever that goes: the tables'
    value of a layer's placement (in-gains and look-ahead) changes exactly as the metric's GPU-local and
    node-local counts do when that layer is placed otherwise and the rest stay."""
    trace, topology, loads, replicas, caps, slots = setup(seed, 0)
    rng = np.random.default_rng(seed + 1)
    routed = RoutedTrace.from_trace(trace, topology.gpus_per_node)
    hosts = initial_hosts(loads, replicas, topology.devices, slots)
    for layer in range(len(hosts)):
        hosts[layer] = hosts[layer][:, rng.permutation(topology.devices)]
    g, h = routed_tables(routed, hosts, devices_after(routed, hosts), l)
    G = topology.gpus_per_node
    node_value = lambda x: float((h * x.reshape(x.shape[0], -1, G).any(axis=2)).sum())
    other = hosts.copy()
    other[l] = hosts[l][rng.permutation(hosts.shape[1])]  # the same slots per GPU, experts shuffled
    gpu_before, node_before = local_transitions(routed, hosts)
    gpu_after, node_after = local_transitions(routed, other)
    assert gpu_after - gpu_before == pytest.approx(float((g * other[l]).sum() - (g * hosts[l]).sum()))
    assert node_after - node_before == pytest.approx(node_value(other[l]) - node_value(hosts[l]))


@settings(max_examples=8, deadline=None)
@given(st.integers(0, 10_000), st.sampled_from([0, 4]))
def test_routed_polish_only_improves_and_keeps_every_constraint(seed, redundant):
    trace, topology, loads, replicas, caps, slots = setup(seed, redundant)
    routed = RoutedTrace.from_trace(trace, topology.gpus_per_node)
    start = initial_hosts(loads, replicas, topology.devices, slots)
    polished, gain = routed_polish(start, routed, loads, caps)
    check_valid(polished, loads, caps, slots, replicas)
    assert local_transitions(routed, polished) >= local_transitions(routed, start)  # (GPU, node), in that order
    assert gain == local_transitions(routed, polished)[0] - local_transitions(routed, start)[0]
    chain = routed_chain(routed, loads, replicas, caps, start)
    check_valid(chain, loads, caps, slots, replicas)


def test_routed_polish_solves_a_layer_mip_once_per_distinct_input(monkeypatch):
    """A second polish of the same start on the same trace (what the held-out walk's rounds do to
    layers the walk left alone) reuses the first polish's proposals: the same placement, no new solve."""
    import moeplan.passes.optimize.placement.local_search.routed as routed_module

    trace, topology, loads, replicas, caps, slots = setup(3, 4)
    routed = RoutedTrace.from_trace(trace, topology.gpus_per_node)
    start = initial_hosts(loads, replicas, topology.devices, slots)
    solved = []
    real_layer_mip = routed_module.layer_mip
    monkeypatch.setattr(routed_module, "layer_mip", lambda *a, **k: solved.append(1) or real_layer_mip(*a, **k))
    first, gain = routed_polish(start, routed, loads, caps)
    assert solved and gain >= 0
    solves = len(solved)
    again, gain_again = routed_polish(start, routed, loads, caps)
    assert len(solved) == solves
    assert np.array_equal(again, first) and gain_again == gain
    fresh, fresh_gain = routed_polish(start, RoutedTrace.from_trace(trace, topology.gpus_per_node), loads, caps)
    assert np.array_equal(fresh, first) and fresh_gain == gain  # the cache changes no result
    assert len(solved) == 2 * solves


def test_routed_chain_keeps_tokens_on_the_copy_they_sit_on():
    """Expert 0 of layer 0 has a copy on both GPUs; tokens sit on GPU 0 when they came from there.
    The even-split model thinks half of expert 0's tokens are on each copy; the routed chain knows
    that all of them are on GPU 0 (they start there) and puts their successor 2 on GPU 0."""
    # layer 0: every token picks expert 0 (2 copies) ... first listed copy is GPU 0, so all sit there
    tokens = 40
    chosen = np.zeros((tokens, 2, 1), dtype=np.int32)
    chosen[:, 1, 0] = 2  # all go to expert 2 next
    chosen[:10, 0, 0] = 1
    chosen[:10, 1, 0] = 1
    trace = make_trace(chosen, num_experts=3)
    routed = RoutedTrace.from_trace(trace, 2)
    loads = trace.expert_loads().astype(np.float64)
    start = np.zeros((2, 3, 2), dtype=bool)
    start[0, 0, :] = True
    start[0, 1, 1] = True
    start[1, 0, :] = True
    start[1, 1, 0] = True
    start[1, 2, 1] = True  # expert 2 on GPU 1: 30 transitions lost
    replicas = start.sum(axis=2)
    caps = np.full(2, 1e9)
    chain = routed_chain(routed, loads, replicas, caps, start)
    assert chain[1, 2, 0]  # successor with the tokens' copy
    assert local_transitions(routed, chain)[0] == tokens - 10 + 10 * int(chain[1, 1, 1])


def test_layer_chain_meets_the_caps_and_names_an_infeasible_one():
    trace, topology, loads, replicas, caps, slots = setup(3, 4)
    counts = transition_counts(trace, "current")
    hosts = layer_chain_placement(counts, loads, topology.gpus_per_node, topology.devices, 4, caps)
    check_valid(hosts, loads, caps, slots, replicas)
    with pytest.raises(UserError, match="load cap"):
        layer_chain_placement(counts, loads, topology.gpus_per_node, topology.devices, 4, caps * 0.5)


def layer_options(E, D, Q):
    """Every bool [E, D] with Q experts per GPU, no expert twice on a GPU, every expert somewhere."""
    per_gpu = list(itertools.combinations(range(E), Q))
    out = []
    for combo in itertools.product(per_gpu, repeat=D):
        x = np.zeros((E, D), dtype=bool)
        for p, experts in enumerate(combo):
            x[list(experts), p] = True
        if x.any(axis=1).all():
            out.append(x)
    return out


@settings(max_examples=16, deadline=None)
@given(st.integers(0, 10_000), st.sampled_from([(4, 2, 2, 1), (3, 2, 2, 2), (4, 2, 3, 2), (3, 2, 2, 3)]),
       st.sampled_from([0.0, 0.2, 1.0]))
def test_capped_bound_never_exceeds_the_best_placement_under_the_cap(seed, shape, balance):
    """Brute force over every 2-layer placement (with replicas where slots allow) meeting the caps:
    the load-capped bound, with and without per-token caps (top-3 on 2 slots binds them), is at
    most the fewest cross-GPU transitions of the metric."""
    E, D, Q, top_k = shape
    rng = np.random.default_rng(seed)
    trace = random_trace(rng, 40, 2, E, top_k, skew=rng.random())
    topology = Topology(1, D)
    loads = trace.expert_loads().astype(np.float64)
    options = layer_options(E, D, Q)
    max_copies = max(int(x.sum(axis=1).max()) for x in options)
    caps = (1 + balance) * loads.sum(axis=1) / D
    fits = [[x for x in options if ((loads[l] / x.sum(axis=1)) @ x).max() <= caps[l] * (1 + 1e-9)] for l in range(2)]
    if not fits[0] or not fits[1]:
        return
    best = min(score_placement(trace, np.stack([a, b]), topology).cross_gpu_transitions for a in fits[0] for b in fits[1])
    counts = transition_counts(trace, "current")
    bound, _ = capped_transition_lower_bound(counts, loads, caps, D, Q, max_copies)
    plain, _ = capped_transition_lower_bound(counts, loads, loads.sum(axis=1), D, Q, max_copies)  # no binding cap
    assert plain - 1e-6 <= bound <= best + 1e-6
    with_tokens, _ = capped_transition_lower_bound(counts, loads, caps, D, Q, max_copies,
                                                   token_caps=source_token_caps(trace, Q))
    assert bound - 1e-6 <= with_tokens <= best + 1e-6


def test_capped_bound_sees_a_binding_cap():
    """Two hot experts that always follow each other cannot share a GPU under a tight cap: the
    bound without the cap says every transition can be local, the capped one does not."""
    E, D = 4, 2
    counts = np.zeros((1, E, E))
    counts[0, 0, 1] = counts[0, 2, 3] = 100.0
    counts[0, 0, 3] = counts[0, 2, 1] = 100.0
    loads = np.array([[100.0, 1.0, 100.0, 1.0], [1.0, 100.0, 1.0, 100.0]])
    caps = np.array([101.0, 101.0])
    plain, _ = capped_transition_lower_bound(counts, loads, loads.sum(axis=1), D, 2)  # no binding cap
    capped, _ = capped_transition_lower_bound(counts, loads, caps, D, 2)
    assert plain == pytest.approx(0.0, abs=1e-6)
    assert capped >= 190.0


def test_per_token_caps_see_what_co_location_cannot():
    """Every token's heaviest expert is 0 and it chooses all three experts next, on 2 GPUs of 2 slots:
    with expert 0 on both GPUs each successor shares a GPU with some copy (co-location: all local),
    but a token sits on one GPU, so at least one of its three choices is cross-GPU. The bound says
    so only with the per-token caps, and names them."""
    experts = np.array([[[0, 1, 2], [0, 1, 2]]] * 10, dtype=np.int32)
    trace = make_trace(experts, num_experts=3)
    counts = transition_counts(trace, "current")
    loads = trace.expert_loads().astype(np.float64)
    caps = loads.sum(axis=1)  # no load cap
    caps_per_token = source_token_caps(trace, 2)
    assert caps_per_token[0].tolist() == [20.0, 0.0, 0.0]
    plain, _ = capped_transition_lower_bound(counts, loads, caps, 2, 2, max_replicas=2)
    bound, method = capped_transition_lower_bound(counts, loads, caps, 2, 2, max_replicas=2, token_caps=caps_per_token)
    assert plain == pytest.approx(0.0, abs=1e-6)
    assert bound == pytest.approx(10.0)
    assert "per-token caps" in method


def test_latent_drift_generator_is_deterministic_and_has_affinity():
    """The corpus's second generator: same seed, same trace; successors follow their predecessors
    more than popularity alone would (drift 0.9 vs 0)."""
    from pathlib import Path
    from moeplan.passes.importers.resolve import import_file

    corpus = import_file(Path(__file__).parent.parent / "benchmarks" / "placement_corpus.py")
    params = dict(layers=3, experts=16, top_k=2, tokens=3000, dim=8, temperature=3.0, zipf=0.5, seed=5)
    a = corpus.latent_drift_trace(drift=0.9, **params)
    assert np.array_equal(a.experts, corpus.latent_drift_trace(drift=0.9, **params).experts)
    assert np.all((a.experts >= 0) & (a.experts < 16))
    assert np.all(a.experts[:, :, 0] != a.experts[:, :, 1])

    def argmax_share(trace):
        counts = transition_counts(trace, "current")
        return counts.max(axis=2).sum() / counts.sum()

    assert argmax_share(a) > 1.5 * argmax_share(corpus.latent_drift_trace(drift=0.0, **params))
