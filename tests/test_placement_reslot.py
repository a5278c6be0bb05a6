"""The re-slotting local search: invariants on random instances, and the moves it exists for."""
import numpy as np
from hypothesis import HealthCheck, given, settings, strategies as st

from moeplan.passes.optimize.placement.local_search.reslot import reslot_search, tighten


def layer_value(hosts, counts, G):
    """The search's value: local transitions (even split) at GPU plus at node level, all layer pairs."""
    L, E, D = hosts.shape
    total = 0.0
    for l in range(L - 1):
        share = hosts[l] / hosts[l].sum(axis=1, keepdims=True)
        total += np.einsum("ab,ap,bp->", counts[l], share, hosts[l + 1].astype(float))
        node_share = share.reshape(E, D // G, G).sum(axis=2)
        node_present = hosts[l + 1].reshape(E, D // G, G).any(axis=2).astype(float)
        total += np.einsum("ab,an,bn->", counts[l], node_share, node_present)
    return total


def device_loads(hosts, loads):
    return np.stack([(loads[l] / hosts[l].sum(axis=1)) @ hosts[l] for l in range(len(loads))])


def random_hosts(rng, L, E, D, slots):
    """Every expert once, the rest of each GPU's slots filled with distinct extra copies."""
    hosts = np.zeros((L, E, D), dtype=bool)
    for l in range(L):
        units = list(rng.permutation(E)) + list(rng.choice(E, size=D * slots - E, replace=True))
        free = dict.fromkeys(range(D), slots)
        for e in units:
            options = [p for p in range(D) if free[p] and not hosts[l, e, p]]
            if options:
                p = options[int(rng.integers(len(options)))]
                hosts[l, e, p] = True
                free[p] -= 1
        for p in range(D):  # fill what duplicates left empty with any expert not yet there
            for e in range(E):
                if free[p] and not hosts[l, e, p]:
                    hosts[l, e, p] = True
                    free[p] -= 1
    return hosts


@st.composite
def instances(draw):
    seed = draw(st.integers(0, 10_000))
    rng = np.random.default_rng(seed)
    G = draw(st.sampled_from([1, 2]))
    D = G * draw(st.integers(2, 3))
    E = D * draw(st.integers(1, 3))
    slots = min(E, E // D + draw(st.integers(0, 2)))
    L = draw(st.integers(2, 4))
    counts = rng.integers(0, 20, size=(L - 1, E, E)).astype(float)
    loads = rng.integers(1, 50, size=(L, E)).astype(float)
    hosts = random_hosts(rng, L, E, D, slots)
    slack = draw(st.sampled_from([0.9, 1.0, 1.2]))
    caps = device_loads(hosts, loads).max(axis=1) * slack
    return hosts, counts, loads, caps, G, slots


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(instances(), st.integers(1, 3), st.booleans())
def test_reslot_keeps_slots_copies_and_caps_and_never_loses_value(instance, max_replicas, exchanges):
    hosts, counts, loads, caps, G, slots = instance
    max_replicas = max(max_replicas, int(hosts.sum(axis=2).max()))
    out, moves = reslot_search(hosts, counts, loads, caps, G, max_replicas=max_replicas, exchanges=exchanges)
    assert (out.sum(axis=1) == slots).all()  # every GPU keeps its slot count
    assert (out.sum(axis=2) >= 1).all() and (out.sum(axis=2) <= max_replicas).all()
    before, after = device_loads(hosts, loads), device_loads(out, loads)
    over_before = np.clip(before - caps[:, None], 0, None).sum(axis=1)
    over_after = np.clip(after - caps[:, None], 0, None).sum(axis=1)
    assert (over_after <= over_before + 1e-6).all()  # overload never grows, per layer
    fits = over_before <= 1e-9
    if fits.all():
        assert layer_value(out, counts, G) >= layer_value(hosts, counts, G) - 1e-6
    if moves == 0:
        assert (out == hosts).all()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(instances())
def test_tighten_reports_every_layer_it_leaves_over_its_cap(instance):
    hosts, counts, loads, caps, G, slots = instance
    out, _, over = tighten(hosts, counts, loads, caps * 0.97, G)
    after = device_loads(out, loads).max(axis=1)
    assert sorted(over) == [l for l in range(len(loads)) if after[l] > caps[l] * 0.97 * (1 + 1e-9)]
    assert (out.sum(axis=1) == slots).all()


def test_a_redundant_slot_moves_to_the_expert_whose_copy_balances_the_gpus():
    # one layer, 2 GPUs of 3 slots, 5 experts: the spare slot holds a copy of expert 0 (load 2),
    # so GPU 0 carries 1 + 10 + 1 against GPU 1's 1 + 1 + 1; no exchange fits a cap of 8, but
    # dropping expert 0's copy on GPU 1 for a copy of expert 1 (load 10) gives 2 + 5 + 1 and 5 + 1 + 1
    hosts = np.zeros((1, 5, 2), dtype=bool)
    hosts[0, [0, 1, 2], 0] = True
    hosts[0, [0, 3, 4], 1] = True
    loads = np.array([[2.0, 10.0, 1.0, 1.0, 1.0]])
    counts = np.zeros((0, 5, 5))
    out, moves = reslot_search(hosts, counts, loads, np.array([8.0]), 1)
    assert moves >= 1
    assert out[0].sum(axis=1).tolist() == [1, 2, 1, 1, 1]  # the slot went from expert 0 to expert 1
    assert device_loads(out, loads)[0].tolist() == [8.0, 7.0]


def test_exchange_brings_a_successor_next_to_its_predecessor():
    # two layers, two GPUs: expert 0 (GPU 0) at layer 0 always goes to expert 1 at layer 1, which
    # sits on GPU 1; loads are equal, so exchanging experts 0 and 1 of layer 1 makes it local
    hosts = np.zeros((2, 2, 2), dtype=bool)
    hosts[0, 0, 0] = hosts[0, 1, 1] = True
    hosts[1, 0, 0] = hosts[1, 1, 1] = True
    counts = np.array([[[0.0, 5.0], [5.0, 0.0]]])
    loads = np.ones((2, 2))
    out, _ = reslot_search(hosts, counts, loads, np.array([1.0, 1.0]), 1)
    assert layer_value(out, counts, 1) == 20.0  # both transitions local at GPU and node level


def test_reslot_only_moves_slots_and_leaves_exchanges_to_the_gpu_sweeps():
    """exchanges=False (64-GPU scale): the slot still moves in the re-slot example; the exchange example,
    which has no redundant copy to move, is left as it is."""
    hosts = np.zeros((1, 5, 2), dtype=bool)
    hosts[0, [0, 1, 2], 0] = True
    hosts[0, [0, 3, 4], 1] = True
    loads = np.array([[2.0, 10.0, 1.0, 1.0, 1.0]])
    out, moves = reslot_search(hosts, np.zeros((0, 5, 5)), loads, np.array([8.0]), 1, exchanges=False)
    assert moves >= 1 and out[0].sum(axis=1).tolist() == [1, 2, 1, 1, 1]
    hosts = np.zeros((2, 2, 2), dtype=bool)
    hosts[:, 0, 0] = hosts[:, 1, 1] = True
    counts = np.array([[[0.0, 5.0], [5.0, 0.0]]])
    out, moves = reslot_search(hosts, counts, np.ones((2, 2)), np.array([1.0, 1.0]), 1, exchanges=False)
    assert moves == 0 and (out == hosts).all()
