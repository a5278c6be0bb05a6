"""Cache policies on small request streams: LRU and Belady against brute force, invariants of all."""
from __future__ import annotations

import numpy as np
from hypothesis import given, settings, strategies as st

from moeplan.passes.analysis.trace.format import make_trace
from moeplan.runtime.offload.policies import DEMAND_POLICIES, make_policy
from moeplan.passes.optimize.offload.simulator import Timing, simulate_demand, simulate_timed
from moeplan.passes.optimize.offload.stream import build_stream


def stream_of(keys, num_experts=6):
    """One MoE layer, top-1: the stream requests exactly `keys` in order."""
    ex = np.asarray(keys, dtype=np.int64).reshape(-1, 1, 1)
    return build_stream(make_trace(ex, num_experts=num_experts))


def brute_min_misses(keys, capacity, resident=()):
    """Fewest misses over every eviction choice (forced admission), by exhaustive search."""
    best = [len(keys) + 1]

    def go(i, cache, misses):
        if misses >= best[0]:
            return
        if i == len(keys):
            best[0] = misses
            return
        k = keys[i]
        if k in cache:
            go(i + 1, cache, misses)
        elif len(cache) < capacity:
            go(i + 1, cache | {k}, misses + 1)
        else:
            for v in sorted(cache):
                go(i + 1, (cache - {v}) | {k}, misses + 1)
    go(0, frozenset(resident), 0)
    return best[0]


def brute_lru(keys, capacity, resident=()):
    """LRU by its definition: on a miss in a full cache evict the key whose last request is oldest."""
    last = {k: i - len(resident) - 1 for i, k in enumerate(resident)}
    cache, hits = set(resident), 0
    for i, k in enumerate(keys):
        if k in cache:
            hits += 1
        else:
            if len(cache) >= capacity:
                cache.remove(min(cache, key=lambda c: last[c]))
            cache.add(k)
        last[k] = i
    return hits


streams = st.lists(st.integers(0, 5), min_size=1, max_size=11)


@settings(max_examples=150, deadline=None)
@given(keys=streams, capacity=st.integers(1, 4), n_res=st.integers(0, 3))
def test_belady_is_optimal(keys, capacity, n_res):
    resident = list(range(min(n_res, capacity)))
    res = simulate_demand(stream_of(keys), capacity, make_policy("belady"), resident=resident)
    assert res.requests - res.hits == brute_min_misses(keys, capacity, resident)


@settings(max_examples=150, deadline=None)
@given(keys=streams, capacity=st.integers(1, 4), n_res=st.integers(0, 3))
def test_lru_matches_definition(keys, capacity, n_res):
    resident = list(range(min(n_res, capacity)))
    res = simulate_demand(stream_of(keys), capacity, make_policy("lru"), resident=resident)
    assert res.hits == brute_lru(keys, capacity, resident)


@settings(max_examples=60, deadline=None)
@given(keys=st.lists(st.integers(0, 5), min_size=2, max_size=40), capacity=st.integers(1, 5))
def test_no_policy_beats_belady_and_timed_equals_demand(keys, capacity):
    from moeplan.runtime.offload.next_use import fit_next_use
    from moeplan.passes.analysis.activation import popularity_by_layer

    stream = stream_of(keys)
    model = fit_next_use(stream, popularity_by_layer(make_trace(np.asarray(keys).reshape(-1, 1, 1), num_experts=6)))
    opt = simulate_demand(stream, capacity, make_policy("belady")).hits
    timing = Timing(layer_s=1e-3, expert_compute_s=1e-4, pcie_copy_s=5e-3)
    for name in DEMAND_POLICIES:
        demand = simulate_demand(stream, capacity, make_policy(name, model))
        assert demand.hits <= opt
        assert demand.loads == demand.requests - demand.hits
        timed = simulate_timed(stream, capacity, make_policy(name, model), timing)
        assert timed.hits == demand.hits
        assert timed.resident_at_start == timed.hits  # nothing is in flight without prefetch


def test_lifo_evicts_inactive_last_loaded_first():
    # two layers x 1 choice; capacity 2: keys (layer, expert) = layer * 4 + expert
    ex = np.array([[[0], [1]], [[2], [1]]])  # token 0: L0 e0, L1 e1; token 1: L0 e2, L1 e1
    stream = build_stream(make_trace(ex, num_experts=4))
    assert stream.keys.tolist() == [0, 5, 2, 5]
    lifo = simulate_demand(stream, 2, make_policy("lifo"))
    lru = simulate_demand(stream, 2, make_policy("lru"))
    # at key 2, LIFO evicts the last loaded (5) and misses again; LRU evicts 0 and hits 5
    assert (lifo.hits, lru.hits) == (0, 1)
