"""Transition counts and conditional probabilities for top-k traces (ExFlow Eq. 1), by hand."""
import numpy as np
import pytest

from moeplan.passes.analysis.affinity import (
    heaviest_choice, top1_affinity, top1_transition_counts, transition_counts,
)
from moeplan.passes.analysis.trace.format import make_trace


def hand_trace():
    # 3 tokens, 2 layers, top-2, E = 3. Token 1's second choice is heavier at layer 0.
    experts = [[[0, 1], [2, 0]],
               [[1, 2], [0, 1]],
               [[0, 2], [2, -1]]]
    weights = [[[0.6, 0.4], [0.5, 0.5]],
               [[0.3, 0.7], [0.9, 0.1]],
               [[0.8, 0.2], [1.0, 0.0]]]
    return make_trace(np.array(experts), np.array(weights, dtype=np.float32), num_experts=3)


def test_heaviest_choice_follows_weights_and_ties_go_first():
    assert heaviest_choice(hand_trace()).tolist() == [[0, 2], [2, 0], [0, 2]]


def test_current_mode_counts_heaviest_source_to_every_next_choice():
    c = transition_counts(hand_trace(), "current")
    expected = np.zeros((1, 3, 3))
    expected[0, 0, 2] += 1
    expected[0, 0, 0] += 1  # token 0: heaviest 0 -> {2, 0}
    expected[0, 2, 0] += 1
    expected[0, 2, 1] += 1  # token 1: heaviest 2 -> {0, 1}
    expected[0, 0, 2] += 1                          # token 2: heaviest 0 -> {2} (second choice is -1)
    assert np.array_equal(c, expected)


def test_pairs_mode_weights_every_pair_one_over_k():
    c = transition_counts(hand_trace(), "pairs")
    expected = np.zeros((3, 3))
    for sources, targets in (([0, 1], [2, 0]), ([1, 2], [0, 1]), ([0, 2], [2])):
        for a in sources:
            for b in targets:
                expected[a, b] += 0.5
    assert np.allclose(c[0], expected)


def test_top1_mode_matches_top1_counts_and_affinity_still_works():
    trace = make_trace(np.array([[[0], [1]], [[0], [1]], [[1], [0]]]), num_experts=2)
    assert np.array_equal(transition_counts(trace), top1_transition_counts(trace))
    assert np.allclose(top1_affinity(trace), [1.0])


def test_unknown_mode_is_rejected():
    with pytest.raises(ValueError):
        transition_counts(hand_trace(), "nope")
