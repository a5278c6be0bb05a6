"""EAMs, the paper's distance, the EAMC (k-means, capacity by held-out recall) and the request stream."""
import numpy as np
from hypothesis import given, settings, strategies as st

from moeplan.passes.analysis.activation import (build_eamc, eam_distance, kmeans_eamc, popularity_by_layer,
                                                 row_normalised, sequence_eams, stream_order)
from moeplan.passes.analysis.trace.format import make_trace
from synth_routing import synthesize_routed_tokens
from moeplan.passes.optimize.offload.stream import build_stream


def test_eams_count_each_sequence_in_order_of_first_appearance():
    # sequence 7 appears first (rows 0, 2), then sequence 3 (rows 1, 3); positions reversed for 7
    ex = np.array([[[1, 2]], [[0, 1]], [[2, 3]], [[0, -1]]])
    tr = make_trace(ex, num_experts=4, sequence=[7, 3, 7, 3], positions=[1, 0, 0, 1])
    assert stream_order(tr).tolist() == [2, 0, 1, 3]
    eams = sequence_eams(tr)
    assert eams.tolist() == [[[0, 1, 2, 1]], [[2, 1, 0, 0]]]
    assert np.allclose(popularity_by_layer(tr), [[2 / 7, 2 / 7, 2 / 7, 1 / 7]])
    stream = build_stream(tr)
    assert stream.keys.tolist() == [2, 3, 1, 2, 0, 1, 0]
    assert stream.step_seq.tolist() == [0, 0, 1, 1]
    # prefill of 2 tokens: one step per sequence, its distinct experts in order of first request
    pre = build_stream(tr, prompt_tokens=2)
    assert pre.keys.tolist() == [2, 3, 1, 0, 1]
    assert pre.num_tokens == 2 and pre.step_start.tolist() == [0, 3, 5]


eam = st.lists(st.lists(st.integers(0, 5), min_size=4, max_size=4), min_size=3, max_size=3).map(np.array)


@settings(max_examples=80, deadline=None)
@given(a=eam, b=eam)
def test_distance_is_row_cosine_and_kmeans_geometry(a, b):
    d = float(eam_distance(a, b))
    ran = [l for l in range(3) if a[l].any()]
    cos = [float(a[l] @ b[l]) / (np.linalg.norm(a[l]) * np.linalg.norm(b[l])) if b[l].any() else 0.0 for l in ran]
    assert np.isclose(d, 1 - np.mean(cos)) if ran else d == 1.0
    if a.any(axis=1).all() and b.any(axis=1).all():  # full EAMs: ||U1 - U2||^2 = 2 L dist
        diff = row_normalised(a) - row_normalised(b)
        assert np.isclose((diff ** 2).sum(), 2 * 3 * d)


def test_eamc_holds_real_eams_and_picks_capacity_by_recall():
    train = synthesize_routed_tokens(tokens=3000, layers=3, experts=8, top_k=2, seq_len=50, seed=0)
    held = synthesize_routed_tokens(tokens=1000, layers=3, experts=8, top_k=2, seq_len=50, seed=1)
    eams = sequence_eams(train)
    chosen = kmeans_eamc(eams, 5, seed=0)
    assert 1 <= len(chosen) <= 5
    assert all(any(np.array_equal(c, e) for e in eams) for c in chosen)
    assert np.array_equal(chosen, kmeans_eamc(eams, 5, seed=0))  # deterministic for a seed
    choice = build_eamc(train, held, candidates=(1, 4, 16))
    assert set(choice.recall_by_capacity) == {1, 4, 16}
    assert all(0 <= r <= 1 for r in choice.recall_by_capacity.values())
    best = max(choice.recall_by_capacity.values())
    assert choice.recall_by_capacity[choice.capacity] >= best - 0.005
    assert len(choice.eamc) <= choice.capacity
