"""The whole-column (chain) configuration bound: valid against brute force, and it sees what no
bound over one layer pair at a time can (issue 15)."""
import itertools

import numpy as np
from hypothesis import given, settings, strategies as st

from moeplan.passes.analysis.affinity import transition_counts
from moeplan.passes.optimize.placement.bounds.pairwise import capped_transition_lower_bound, matching_bound
from moeplan.passes.optimize.placement.budget import WorkBudget
from moeplan.passes.optimize.placement.bounds.chain import best_columns, chain_bound_applies, chain_configuration_bound
from moeplan.passes.optimize.placement.schema import Topology
from moeplan.passes.optimize.placement.metrics import score_placement
from test_placement_routed import layer_options, random_trace


@settings(max_examples=10, deadline=None)
@given(st.integers(0, 10_000), st.sampled_from([(3, 2, 2, 1), (4, 2, 2, 2), (4, 2, 3, 2)]), st.sampled_from([0.0, 0.3, 1.0]))
def test_chain_bound_never_exceeds_the_best_placement_under_the_cap(seed, shape, balance):
    """Brute force over every 3-layer placement (replicas where the slots allow) meeting the caps:
    the chain bound is at most the fewest cross-GPU transitions of the metric."""
    E, D, Q, top_k = shape
    rng = np.random.default_rng(seed)
    trace = random_trace(rng, 40, 3, E, top_k, skew=rng.random())
    loads = trace.expert_loads().astype(np.float64)
    options = layer_options(E, D, Q)
    max_copies = max(int(x.sum(axis=1).max()) for x in options)
    caps = (1 + balance) * loads.sum(axis=1) / D
    fits = [[x for x in options if ((loads[l] / x.sum(axis=1)) @ x).max() <= caps[l] * (1 + 1e-9)] for l in range(3)]
    if not all(fits):
        return
    topology = Topology(1, D)
    best = min(score_placement(trace, np.stack(layers), topology).cross_gpu_transitions
               for layers in itertools.product(*fits))
    counts = transition_counts(trace, "current")
    bound = chain_configuration_bound(counts, loads, caps, D, Q, max_copies, WorkBudget(4.0))
    assert 0.0 <= bound <= best + 1e-6


def conflicting_pairs():
    """Pair (0, 1) wants layer 1's experts grouped {0, 1} {2, 3}; pair (1, 2) wants {0, 2} {1, 3}."""
    counts = np.zeros((2, 4, 4))
    counts[0, 0, [0, 1]] = counts[0, 1, [2, 3]] = 10.0
    counts[1, [0, 2], 0] = counts[1, [1, 3], 1] = 10.0
    return counts, np.ones((3, 4)), np.full(3, 1e9)


def test_chain_bound_sees_what_a_bound_over_one_layer_pair_cannot():
    """Each layer pair alone can keep every transition local, both together cannot: the pair
    bound says 0, the chain bound says some transitions cross (and the reported bound takes it),
    and brute force agrees."""
    counts, loads, caps = conflicting_pairs()
    pairwise = sum(matching_bound(c, 2, 2, pair_cap=2 * 2 ** 2, time_limit=10.0) for c in counts)
    chain = chain_configuration_bound(counts, loads, caps, 2, 2, 1, WorkBudget(4.0))
    reported, method = capped_transition_lower_bound(counts, loads, caps, 2, 2)
    options = layer_options(4, 2, 2)
    best = min(sum((counts[l] * (x[l].astype(float) @ x[l + 1].T == 0)).sum() for l in range(2))
               for x in itertools.product(options, repeat=3))
    assert pairwise == 0.0
    assert 0.0 < chain <= best
    assert reported >= chain - 1e-9 and "column" in method


def test_best_columns_is_the_exact_maximum():
    """The dynamic program's best column equals the best of every column, enumerated."""
    rng = np.random.default_rng(0)
    E, Q, L = 4, 2, 3
    subsets = np.array([[1.0 if e in s else 0.0 for e in range(E)] for s in itertools.combinations(range(E), Q)])
    weights = rng.random((L - 1, E, E))
    mu = rng.random((L, E))
    feasible = rng.random((L, len(subsets))) < 0.8
    feasible[:, 0] = True
    value, columns = best_columns(subsets, feasible, weights, mu, count=3)
    brute = max(sum(subsets[c[l]] @ mu[l] for l in range(L)) + sum(subsets[c[l]] @ weights[l] @ subsets[c[l + 1]] for l in range(L - 1))
                for c in itertools.product(range(len(subsets)), repeat=L) if all(feasible[l, c[l]] for l in range(L)))
    assert np.isclose(value, brute)
    first = columns[0]
    assert np.isclose(sum(subsets[first[l]] @ mu[l] for l in range(L))
                      + sum(subsets[first[l]] @ weights[l] @ subsets[first[l + 1]] for l in range(L - 1)), brute)


def test_chain_bound_is_skipped_where_its_pricing_does_not_fit_the_budget():
    """64 experts on 8 GPUs (C(64, 9) columns per layer) and DeepSeek-V3's shape: no bound, at no cost."""
    assert not chain_bound_applies(64, 9, 8, WorkBudget())
    assert not chain_bound_applies(256, 5, 58, WorkBudget())
    assert chain_bound_applies(16, 3, 6, WorkBudget())
    counts = np.zeros((57, 256, 256))
    assert chain_configuration_bound(counts, np.ones((58, 256)), np.full(58, 1e9), 64, 5, 2) is None
