"""Popularity prediction: the count table, the load metric, and ours vs the Lina-style baseline."""
import numpy as np
import pytest

from moeplan.passes.analysis import popularity as pop
from synth_routing import synthesize_routed_tokens
from moeplan.passes.analysis.trace.format import make_trace


def _tiny_trace():
    # 4 tokens, 1 layer, top-1, 3 experts; token 7 appears twice at position 0 -> expert 2
    experts = np.array([[[2]], [[2]], [[0]], [[1]]])
    return make_trace(experts, num_experts=3, token_ids=[7, 7, 5, 5], positions=[0, 0, 1, 9],
                      attention_ids=[[7], [7], [7], [5]])


def test_count_table_counts_each_distinct_key():
    t = pop.CountTable.from_trace(_tiny_trace())
    rows = {(int(a), int(b), int(c), int(d), int(e)): n
            for a, b, c, d, e, n in zip(t.token, t.position, t.attention, t.layer, t.expert, t.count)}
    assert rows == {(7, 0, 7, 0, 2): 2, (5, 1, 7, 0, 0): 1, (5, 9, 5, 0, 1): 1}
    assert t.token_freq == {5: 0.5, 7: 0.5}


def test_with_values_sets_and_adds_keys():
    t = pop.CountTable.from_trace(_tiny_trace())
    t2 = t.with_values(np.array([[7, 0, 7, 0, 2], [9, 3, 5, 0, 1]]), np.array([5.0, 4.0]))
    rows = {(int(a), int(b), int(c), int(d), int(e)): n
            for a, b, c, d, e, n in zip(t2.token, t2.position, t2.attention, t2.layer, t2.expert, t2.count)}
    assert rows[(7, 0, 7, 0, 2)] == 5 and rows[(9, 3, 5, 0, 1)] == 4 and rows[(5, 1, 7, 0, 0)] == 1
    assert len(t.count) == 3  # the original is unchanged


def test_true_loads_and_load_error_by_hand():
    tr = _tiny_trace()
    assert tr.expert_loads().tolist() == [[1, 1, 2]]
    assert pop.load_error([np.array([[2, 1, 1]])], [np.array([[1, 1, 2]])]) == pytest.approx(2 / 3)


def test_map_prediction_follows_the_table_and_unseen_tokens_use_the_marginal():
    t = pop.CountTable.from_trace(_tiny_trace())
    bayes = pop.make_predictor("bayes", t, assignment="map")
    assert bayes.predict_loads([7, 7], [0, 0]).tolist() == [[0, 0, 2]]
    # token 99 was never profiled: the marginal's most popular expert (2) takes it
    assert bayes.predict_loads([99], [0]).tolist() == [[0, 0, 1]]
    marginal = pop.make_predictor("marginal", t)
    assert marginal.predict_loads([1, 2, 3, 4], [0, 1, 2, 3]).sum() == 4


def _errors(tr, assignment, **ours):
    table = pop.CountTable.from_trace(tr.select(np.arange(8000)))
    held = pop.batches(tr.num_tokens, 1000, start=8000)
    real = [tr.expert_loads(b) for b in held]
    out = {}
    for name in ("bayes", "lina", "marginal"):
        opts = {} if name == "marginal" else {"assignment": assignment, **(ours if name == "bayes" else {})}
        p = pop.make_predictor(name, table, **opts)
        out[name] = pop.load_error([p.predict_loads(tr.token_ids[b], tr.positions[b]) for b in held], real)
    return out


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("assignment", ["map", "expected"])
def test_ours_beats_lina_when_routing_depends_on_position(seed, assignment):
    tr = synthesize_routed_tokens(tokens=12000, layers=2, experts=8, top_k=2, vocab=64, seed=seed)
    err = _errors(tr, assignment, position="joint", context="none")
    assert err["bayes"] < err["lina"], err


def _context_routed(seed):
    """Routing driven by (token, previous token) pairs, as in a byte-level language model."""
    rng = np.random.default_rng(seed)
    T, E, V = 12000, 8, 16
    tok = rng.integers(0, V, size=T)
    pos = np.arange(T) % 64
    prev = pop.previous_tokens(tok, pos)
    pref = rng.normal(size=(V, V + 1, E)) * 2.0
    logits = pref[tok, prev + 1] + 0.5 * rng.gumbel(size=(T, E))
    experts = np.argsort(-logits, axis=1, kind="stable")[:, None, :2]
    return make_trace(experts, num_experts=E, token_ids=tok, positions=pos)


@pytest.mark.parametrize("assignment", ["map", "expected"])
def test_ours_beats_lina_when_routing_depends_on_context(assignment):
    err = _errors(_context_routed(0), assignment, context="previous", position="none")
    assert err["bayes"] < 0.8 * err["lina"], err


def test_options_are_selected_on_validation_batches():
    tr = _context_routed(1)
    table = pop.CountTable.from_trace(tr.select(np.arange(8000)))
    val = [(b, tr.expert_loads(b)) for b in pop.batches(10000, 1000, start=8000)]
    best, tried = pop.select_options(table, tr, val)
    assert best == {"context": "previous", "position": "none"}
    assert len(tried) == len(pop.CANDIDATE_OPTIONS) and min(e for _, e in tried) == {str(t[0]): t[1] for t in tried}[str(best)]


def test_predictions_are_deterministic():
    tr = synthesize_routed_tokens(tokens=3000, layers=2, experts=4, top_k=2, vocab=32, seed=3)
    t = pop.CountTable.from_trace(tr)
    a = pop.make_predictor("bayes", t).predict_loads(tr.token_ids[:500], tr.positions[:500])
    b = pop.make_predictor("bayes", t).predict_loads(tr.token_ids[:500], tr.positions[:500])
    assert np.array_equal(a, b) and abs(int(a.sum()) - 2 * 2 * 500) <= 2 * 4  # rounding per expert


def test_trace_without_token_ids_is_a_user_error():
    from moeplan.core.errors import UserError

    with pytest.raises(UserError, match="token_ids"):
        pop.CountTable.from_trace(make_trace(np.zeros((3, 1, 1), dtype=int), num_experts=2))
