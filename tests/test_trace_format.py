"""The trace .npz contract: round trip, validation of every documented rule, atomic writes."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from moeplan.passes.analysis.trace.format import load_trace, make_trace, save_trace
from moeplan.core.errors import UserError


def _trace(T=5, L=3, K=2, E=4, seed=0):
    rng = np.random.default_rng(seed)
    experts = np.stack([np.stack([rng.permutation(E)[:K] for _ in range(L)]) for _ in range(T)])
    return make_trace(experts, num_experts=E, token_ids=rng.integers(0, 256, T),
                      positions=np.arange(T), sequence=np.zeros(T, dtype=int),
                      attention_ids=rng.integers(0, 256, (T, L)))


@settings(max_examples=40, deadline=None)
@given(
    shape=st.tuples(st.integers(1, 6), st.integers(1, 4), st.integers(1, 3)),
    extra_experts=st.integers(0, 3),
    data=st.data(),
)
def test_round_trip_preserves_every_array(tmp_path_factory, shape, extra_experts, data):
    T, L, K = shape
    E = K + extra_experts
    experts = data.draw(hnp.arrays(np.int32, shape, elements=st.integers(-1, E - 1)))
    weights = data.draw(hnp.arrays(np.float32, shape, elements=st.floats(0, 1, width=32)))
    trace = make_trace(experts, weights, num_experts=E, positions=np.arange(T))
    path = tmp_path_factory.mktemp("t") / "trace.npz"
    save_trace(trace, path)
    back = load_trace(path)
    assert back.num_experts == E
    np.testing.assert_array_equal(back.experts, experts)
    np.testing.assert_array_equal(back.weights, weights)
    np.testing.assert_array_equal(back.positions, np.arange(T))
    assert back.token_ids is None and back.attention_ids is None


def test_default_weights_are_one_over_k_and_zero_for_missing_choices():
    trace = make_trace(np.array([[[0, -1]]]), num_experts=2)
    np.testing.assert_allclose(trace.weights, [[[0.5, 0.0]]])


def test_num_experts_defaults_to_max_id_plus_one():
    assert make_trace(np.array([[[3, 1]]])).num_experts == 4


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(experts=np.zeros((2, 3))), "must have 3 dimensions"),
        (dict(experts=np.zeros((2, 3, 1), dtype=np.float32)), "must hold integers"),
        (dict(experts=np.full((2, 3, 1), 4), num_experts=4), "expert id 4"),
        (dict(experts=np.full((2, 3, 1), -2)), "below -1"),
        (dict(experts=np.zeros((2, 3, 1), int), weights=np.zeros((2, 3, 2))), "'weights' has shape"),
        (dict(experts=np.zeros((2, 3, 1), int), weights=np.zeros((2, 3, 1), int)), "must hold floats"),
        (dict(experts=np.zeros((2, 3, 1), int), weights=np.full((2, 3, 1), np.nan)), "NaN"),
        (dict(experts=np.zeros((2, 3, 1), int), token_ids=np.zeros(3, int)), "'token_ids' has 3 entries"),
        (dict(experts=np.zeros((2, 3, 1), int), attention_ids=np.zeros((2, 2), int)), "'attention_ids' has shape"),
        (dict(experts=np.zeros((2, 0, 1), int)), "at least one MoE layer"),
    ],
)
def test_invalid_arrays_raise_one_clear_user_error(kwargs, message):
    with pytest.raises(UserError, match=message) as info:
        make_trace(**kwargs)
    assert "\n" not in str(info.value)


def test_load_rejects_missing_foreign_and_corrupt_files(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        load_trace(tmp_path / "absent.npz")
    (tmp_path / "text.npz").write_text("not a zip")
    with pytest.raises(UserError, match="not a readable .npz"):
        load_trace(tmp_path / "text.npz")
    np.savez(tmp_path / "foreign.npz", something=np.zeros(3))
    with pytest.raises(UserError, match="no 'experts' array"):
        load_trace(tmp_path / "foreign.npz")
    np.savez(tmp_path / "extra.npz", experts=np.zeros((1, 1, 1), int), bogus=np.zeros(1))
    with pytest.raises(UserError, match="unknown arrays"):
        load_trace(tmp_path / "extra.npz")
    np.savez(tmp_path / "v3.npz", experts=np.zeros((1, 1, 1), int), version=np.int64(3))
    with pytest.raises(UserError, match="version 3"):
        load_trace(tmp_path / "v3.npz")


def test_load_reports_out_of_range_ids_against_declared_num_experts(tmp_path):
    np.savez(tmp_path / "t.npz", experts=np.array([[[0], [5]]]), num_experts=np.int64(4))
    with pytest.raises(UserError, match=r"expert id 5 at MoE layer 1 .* 4 experts"):
        load_trace(tmp_path / "t.npz")


def test_select_keeps_rows_of_every_array():
    trace = _trace()
    part = trace.select(np.array([0, 2]))
    assert part.num_tokens == 2 and part.num_experts == trace.num_experts
    np.testing.assert_array_equal(part.attention_ids, trace.attention_ids[[0, 2]])
    np.testing.assert_array_equal(part.token_ids, trace.token_ids[[0, 2]])


def test_failed_save_leaves_nothing_behind(tmp_path, monkeypatch):
    trace = _trace()
    target = tmp_path / "out" / "trace.npz"

    def boom(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(np.lib.format, "write_array", boom)
    with pytest.raises(RuntimeError):
        save_trace(trace, target)
    assert not target.exists()
    assert list(target.parent.iterdir()) == []


def test_saving_the_same_trace_twice_gives_identical_bytes(tmp_path):
    save_trace(_trace(), tmp_path / "a.npz")
    save_trace(_trace(), tmp_path / "b.npz")
    assert (tmp_path / "a.npz").read_bytes() == (tmp_path / "b.npz").read_bytes()
