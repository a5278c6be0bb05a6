"""The incrementally kept exchange tables (`local_search/moves.py`) make the moves a full recomputation makes."""
import numpy as np
from hypothesis import given, settings, strategies as st

from moeplan.passes.optimize.placement.local_search.moves import pair_tables, repair_exchanges, steepest_exchanges


def recomputed_exchanges(gain, assign, limit, loads, cap, max_rounds, repair=False):
    """Reference: every pair's gain and feasibility recomputed from scratch before each move; the
    steepest gain under the cap, or (repair) the largest cut of the overload, gain breaking ties."""
    assign = assign.copy()
    partition_load = loads @ assign
    for _ in range(max_rounds):
        e, p, delta, shift, ok = pair_tables(gain, assign, limit, loads)
        if repair:
            over = np.clip(partition_load - cap, 0, None)
            if over.sum() <= 0:
                break
            new_i = np.clip(partition_load[p][:, None] + shift - cap, 0, None)
            new_j = np.clip(partition_load[p][None, :] - shift - cap, 0, None)
            cut = over[p][:, None] + over[p][None, :] - new_i - new_j
            scale = max(float(np.abs(delta[ok]).max(initial=0.0)), 1.0)
            merit = np.where(ok & (cut > 1e-9 * cap), cut * (4.0 * scale / max(float(cut.max()), 1e-12)) + delta, -np.inf)
        else:
            ok &= partition_load[p][:, None] + shift <= cap * (1 + 1e-9)
            ok &= partition_load[p][None, :] - shift <= cap * (1 + 1e-9)
            merit = np.where(ok, delta, -np.inf)
        i, j = divmod(int(np.argmax(merit)), len(e))
        if not (np.isfinite(merit[i, j]) if repair else merit[i, j] > 1e-9):
            break
        for unit, source, target in ((i, p[i], p[j]), (j, p[j], p[i])):
            assign[e[unit], source] -= 1
            assign[e[unit], target] += 1
            partition_load[source] -= loads[e[unit]]
            partition_load[target] += loads[e[unit]]
    return assign


@st.composite
def layer_steps(draw):
    """A random layer step: gains (integer-valued half the time, so ties occur), replica counts with a
    per-partition limit (some experts with several copies on one partition), a feasible start, a cap."""
    seed = draw(st.integers(0, 2 ** 31))
    rng = np.random.default_rng(seed)
    n, P, slots = int(rng.integers(2, 30)), int(rng.integers(2, 8)), int(rng.integers(1, 5))
    if P * slots < n:
        slots = -(-n // P)
    to_place = np.ones(n, dtype=np.int64)
    for _ in range(P * slots - n):
        to_place[rng.integers(n)] += 1
    limit = np.maximum(-(-to_place // P), rng.integers(1, 3, n))
    assign = np.zeros((n, P), dtype=np.int64)
    room = np.full(P, slots)
    for e in np.argsort(-to_place, kind="stable"):
        for _ in range(to_place[e]):
            free = np.flatnonzero((room > 0) & (assign[e] < limit[e]))
            if len(free) == 0:
                return None
            q = free[rng.integers(len(free))]
            assign[e, q] += 1
            room[q] -= 1
    gain = rng.integers(0, 4, (n, P)).astype(float) if draw(st.booleans()) else rng.random((n, P))
    loads = rng.integers(1, 9, n).astype(float)
    cap = float((loads @ assign).max() * rng.uniform(1.0, 1.3))
    return gain, assign, limit, loads, cap


@settings(max_examples=150, deadline=None)
@given(layer_steps())
def test_patched_tables_give_the_recomputed_result(step):
    if step is None:
        return
    gain, assign, limit, loads, cap = step
    got = steepest_exchanges(gain, assign, limit, loads, cap, 300)
    assert np.array_equal(got, recomputed_exchanges(gain, assign, limit, loads, cap, 300))
    assert np.array_equal(got.sum(axis=1), assign.sum(axis=1)) and np.array_equal(got.sum(axis=0), assign.sum(axis=0))
    assert np.all(got <= limit[:, None])
    assert (loads @ got).max() <= max(cap, (loads @ assign).max()) * (1 + 1e-9)
    assert (gain * got).sum() >= (gain * assign).sum() - 1e-9


@settings(max_examples=100, deadline=None)
@given(layer_steps(), st.floats(0.6, 1.0))
def test_patched_repair_gives_the_recomputed_result_and_never_adds_overload(step, tighter):
    if step is None:
        return
    gain, assign, limit, loads, cap = step
    cap = cap * tighter  # often below the start's max load: the repair has work to do
    got = repair_exchanges(gain, assign, limit, loads, cap, 300)
    assert np.array_equal(got, recomputed_exchanges(gain, assign, limit, loads, cap, 300, repair=True))
    overload = lambda a: np.clip(loads @ a - cap, 0, None).sum()
    assert overload(got) <= overload(assign) + 1e-9
