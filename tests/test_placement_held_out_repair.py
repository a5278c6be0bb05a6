"""Exchanges that lower the expected held-out max loads directly (`local_search/held_out_repair.py`, issue 15)."""
import numpy as np
from hypothesis import given, settings, strategies as st

from moeplan.passes.optimize.placement.local_search.held_out_repair import repair_expected_max


def expected_max(x, loads, scenarios):
    """x: bool [E, D]; loads: float [E]; scenarios: float [S, E]."""
    per_copy = (loads[None, :] + scenarios) / x.sum(axis=1)
    return (per_copy @ x).max(axis=1).mean()


def planning_max(x, loads):
    return ((loads / x.sum(axis=1)) @ x).max()


def swinging_layer():
    """Experts 0 and 1 share GPU 0 and rise and fall together; 2 and 3 share GPU 1 and move against them."""
    loads = np.full(4, 100.0)
    swing = np.array([30.0, 30.0, -30.0, -30.0])
    x = np.array([[1, 0], [1, 0], [0, 1], [0, 1]], dtype=bool)
    return x, loads, np.stack([swing, -swing])


def test_experts_that_rise_together_are_split_until_the_allowance_holds():
    x, loads, scenarios = swinging_layer()
    assert expected_max(x, loads, scenarios) == 260.0
    new, moves = repair_expected_max(x[None], loads[None], scenarios[:, None], np.array([200.0]), np.array([200.0]),
                                     lambda hosts, l: np.zeros((4, 2)), max_moves=10)
    assert moves == 1
    assert expected_max(new[0], loads, scenarios) == 200.0
    assert new[0, 0].sum() == 1 and not np.array_equal(new[0, 0], new[0, 1])  # 0 and 1 now on different GPUs


def test_the_move_losing_least_value_per_token_removed_is_taken():
    x, loads, scenarios = swinging_layer()
    gain = np.zeros((4, 2))
    gain[0, 0] = 5.0  # expert 0 is worth more on GPU 0: move expert 1 instead
    new, _ = repair_expected_max(x[None], loads[None], scenarios[:, None], np.array([200.0]), np.array([200.0]),
                                 lambda hosts, l: gain, max_moves=10)
    assert new[0, 0, 0] and new[0, 1, 1]


def test_a_layer_under_its_allowance_pays_for_one_above_it():
    """The load metric averages max/mean over layers: layer 1's slack covers layer 0's excess, so nothing moves."""
    x, loads, scenarios = swinging_layer()
    hosts = np.stack([x, x])
    two = np.stack([scenarios, scenarios], axis=1)  # [S, 2, E]
    gain = lambda hosts, l: np.zeros((4, 2))
    kept, moves = repair_expected_max(hosts, np.stack([loads, loads]), two, np.array([200.0, 400.0]),
                                      np.array([200.0, 200.0]), gain, max_moves=10)
    assert moves == 0 and np.array_equal(kept, hosts)
    fixed, moves = repair_expected_max(hosts, np.stack([loads, loads]), two, np.array([200.0, 300.0]),
                                       np.array([200.0, 200.0]), gain, max_moves=10)
    assert moves == 1 and expected_max(fixed[0], loads, scenarios) == 200.0  # layer 0 first: the lowest on a tie


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 10_000), st.integers(2, 4), st.integers(1, 3), st.integers(0, 3), st.integers(1, 3))
def test_repair_keeps_copies_slots_and_caps_and_never_raises_the_expected_max(seed, gpus, slots, extra, layers):
    rng = np.random.default_rng(seed)
    experts = max(gpus * slots - extra, (gpus * slots + 1) // 2)  # the other slots hold second copies
    hosts = np.zeros((layers, experts, gpus), dtype=bool)
    for l in range(layers):
        order = list(rng.permutation(experts)) + list(rng.choice(experts, gpus * slots - experts, replace=False))
        for position, e in enumerate(order):  # round-robin, so a second copy lands elsewhere unless it wraps onto it
            hosts[l, e, position % gpus] = True
    if hosts.sum() != layers * gpus * slots:
        return
    loads = rng.uniform(10.0, 100.0, (layers, experts))
    scenarios = np.clip(rng.normal(0.0, 20.0, (6, layers, experts)), -loads + 1.0, None)
    caps = np.array([planning_max(hosts[l], loads[l]) for l in range(layers)]) * rng.uniform(1.0, 1.2, layers)
    gains = rng.uniform(0.0, 10.0, (layers, experts, gpus))
    before = np.array([expected_max(hosts[l], loads[l], scenarios[:, l]) for l in range(layers)])
    allowed = before * rng.uniform(0.8, 1.0, layers)
    new, moves = repair_expected_max(hosts, loads, scenarios, allowed, caps, lambda h, l: gains[l], max_moves=50)
    assert np.array_equal(new.sum(axis=2), hosts.sum(axis=2))  # copies per expert
    assert np.array_equal(new.sum(axis=1), hosts.sum(axis=1))  # slots per GPU
    after = np.array([expected_max(new[l], loads[l], scenarios[:, l]) for l in range(layers)])
    for l in range(layers):
        assert planning_max(new[l], loads[l]) <= caps[l] * (1 + 1e-9)
        assert after[l] <= before[l] + 1e-9  # every move lowers its own layer's expected max
    assert (moves == 0) == np.array_equal(new, hosts)
    assert (moves == 0) == (before.sum() <= allowed.sum() * (1 + 1e-9) or after.sum() == before.sum())
