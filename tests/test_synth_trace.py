"""Synthetic traces: deterministic, valid, planted affinity and skew visible; CLI writes them."""
import numpy as np
import pytest
from click.testing import CliRunner

from moeplan.passes.analysis.affinity import transition_counts
from moeplan.passes.analysis.trace.synth_planted import synthesize_trace
from moeplan.passes.analysis.trace.format import load_trace
from moeplan.planner.cli import main
from moeplan.core.errors import UserError

ARGS = dict(layers=4, experts=32, top_k=4, tokens=3000, zipf=0.8, seed=3)


def test_same_seed_same_trace_other_seed_other_trace():
    a = synthesize_trace(affinity=0.6, **ARGS)
    b = synthesize_trace(affinity=0.6, **ARGS)
    c = synthesize_trace(affinity=0.6, **{**ARGS, "seed": 4})
    assert np.array_equal(a.experts, b.experts) and np.array_equal(a.weights, b.weights)
    assert not np.array_equal(a.experts, c.experts)


def test_choices_are_distinct_valid_and_heaviest_first():
    t = synthesize_trace(affinity=0.6, **ARGS)
    assert t.experts.shape == (3000, 4, 4) and t.experts.min() >= 0 and t.experts.max() < 32
    s = np.sort(t.experts, axis=2)
    assert not (s[:, :, 1:] == s[:, :, :-1]).any()
    assert np.all(np.diff(t.weights, axis=2) < 0)
    assert t.sequence is not None and len(np.unique(t.sequence)) > 1


def _share_in_top_successors(trace, keep=4):
    c = transition_counts(trace)
    return np.sort(c, axis=2)[:, :, -keep:].sum() / c.sum()


def test_planted_affinity_concentrates_transitions():
    strong = synthesize_trace(affinity=0.9, **ARGS)
    none = synthesize_trace(affinity=0.0, **ARGS)
    assert _share_in_top_successors(strong) > _share_in_top_successors(none) + 0.3


def test_zipf_skews_load_and_zero_is_flat():
    flat = synthesize_trace(affinity=0.0, **{**ARGS, "zipf": 0.0, "tokens": 8000})
    skewed = synthesize_trace(affinity=0.0, **{**ARGS, "zipf": 1.2, "tokens": 8000})
    def ratio(t):
        load = np.bincount(t.experts[:, 0].ravel(), minlength=32)
        return load.max() / load.mean()
    assert ratio(flat) < 1.3 < 2.0 < ratio(skewed)


@pytest.mark.parametrize("bad", [dict(affinity=1.5), dict(affinity=0.5, top_k=40), dict(affinity=0.5, zipf=-1)])
def test_bad_parameters_raise_user_error(bad):
    with pytest.raises(UserError):
        synthesize_trace(**{**ARGS, **bad})


def test_deepseek_shape_is_fast():
    import time
    start = time.perf_counter()
    t = synthesize_trace(layers=58, experts=256, top_k=8, tokens=20000, affinity=0.6, zipf=0.8, seed=0)
    assert t.experts.shape == (20000, 58, 8)
    assert time.perf_counter() - start < 30  # seconds on a loaded 2-core machine; ~4 s idle


def test_cli_synth_writes_a_loadable_trace_and_rejects_bad_input(tmp_path):
    out = tmp_path / "t.npz"
    r = CliRunner().invoke(main, ["trace", "synth", "--layers", "3", "--experts", "8", "--k", "2", "--tokens", "100",
                                  "--affinity", "0.5", "--zipf", "0.5", "--seed", "1", "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert load_trace(out).experts.shape == (100, 3, 2)
    bad = tmp_path / "bad.npz"
    r = CliRunner().invoke(main, ["trace", "synth", "--layers", "3", "--experts", "8", "--k", "9", "--out", str(bad)])
    assert r.exit_code == 2 and len(r.output.strip().splitlines()) == 1 and "--k" in r.output
    assert not bad.exists()
