"""Exchanges that lower a layer's expected held-out max directly (`placement/held_out_repair.py`, issue 15)."""
import numpy as np
from hypothesis import given, settings, strategies as st

from moeplan.passes.optimize.placement.held_out_repair import repair_expected_max


def expected_max(x, loads, scenarios):
    per_copy = (loads[None, :] + scenarios) / x.sum(axis=1)
    return (per_copy @ x).max(axis=1).mean()


def planning_max(x, loads):
    return ((loads / x.sum(axis=1)) @ x).max()


def test_experts_that_rise_together_are_split_and_the_expected_max_reaches_the_allowance():
    """Experts 0 and 1 share GPU 0 and rise and fall together; 2 and 3 share GPU 1 and move against them."""
    loads = np.full(4, 100.0)
    swing = np.array([30.0, 30.0, -30.0, -30.0])
    scenarios = np.stack([swing, -swing])
    x = np.array([[1, 0], [1, 0], [0, 1], [0, 1]], dtype=bool)
    assert expected_max(x, loads, scenarios) == 260.0
    gain = np.zeros((4, 2))
    new, moves = repair_expected_max(x, loads, scenarios, allowed=200.0, cap=200.0, gain=gain, max_moves=10)
    assert moves == 1
    assert expected_max(new, loads, scenarios) == 200.0
    assert new[0].sum() == 1 and not np.array_equal(new[0], new[1])  # 0 and 1 now on different GPUs


def test_the_move_losing_least_value_per_token_removed_is_taken():
    """Two exchanges fix the layer equally; the gain table makes one of them cheaper."""
    loads = np.full(4, 100.0)
    swing = np.array([30.0, 30.0, -30.0, -30.0])
    scenarios = np.stack([swing, -swing])
    x = np.array([[1, 0], [1, 0], [0, 1], [0, 1]], dtype=bool)
    gain = np.zeros((4, 2))
    gain[0, 0] = 5.0  # expert 0 is worth more on GPU 0: move expert 1 instead
    new, _ = repair_expected_max(x, loads, scenarios, allowed=200.0, cap=200.0, gain=gain, max_moves=10)
    assert new[0, 0] and new[1, 1]


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 10_000), st.integers(2, 4), st.integers(1, 3), st.integers(0, 3))
def test_repair_keeps_copies_slots_and_cap_and_never_raises_the_expected_max(seed, gpus, slots, extra):
    rng = np.random.default_rng(seed)
    experts = max(gpus * slots - extra, (gpus * slots + 1) // 2)  # the rest of the slots hold second copies
    x = np.zeros((experts, gpus), dtype=bool)
    order = list(range(experts)) + list(rng.choice(experts, gpus * slots - experts, replace=False))
    for position, e in enumerate(order):  # experts fill GPUs round-robin, so a second copy lands elsewhere
        x[e, position % gpus] = True
    if x.sum() != gpus * slots:
        return
    loads = rng.uniform(10.0, 100.0, experts)
    scenarios = rng.normal(0.0, 20.0, (6, experts))
    scenarios = np.clip(scenarios, -loads + 1.0, None)
    cap = planning_max(x, loads) * rng.uniform(1.0, 1.2)
    gain = rng.uniform(0.0, 10.0, (experts, gpus))
    before = expected_max(x, loads, scenarios)
    allowed = before * rng.uniform(0.8, 1.0)
    new, moves = repair_expected_max(x, loads, scenarios, allowed, cap, gain, max_moves=50)
    assert np.array_equal(new.sum(axis=1), x.sum(axis=1))  # copies per expert
    assert np.array_equal(new.sum(axis=0), x.sum(axis=0))  # slots per GPU
    assert planning_max(new, loads) <= cap * (1 + 1e-9)
    after = expected_max(new, loads, scenarios)
    assert after <= before + 1e-9
    assert (moves == 0) == np.array_equal(new, x)
    if moves:
        assert after < before  # every move lowers it
