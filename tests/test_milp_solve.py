"""`milp.solve_milp` returns the optimum HiGHS reports, checked against enumeration, warm start or not."""
import numpy as np
import pytest
import scipy.sparse as sp
from hypothesis import given, settings, strategies as st

from moeplan.passes.optimize.milp import solve_milp


def pick_one(cost: np.ndarray, latency: np.ndarray, budget: float, warm: int = None):
    """Choose exactly one of n points (cost, latency float [n]) with latency <= budget, cheapest:
    the multiple-choice knapsack sizing's frontier formulation solves per layer."""
    n = len(cost)
    A = sp.csc_matrix(np.vstack([np.ones(n), latency]))
    x0 = None if warm is None else np.eye(n)[warm]
    return solve_milp(cost, A, np.r_[1.0, -np.inf], np.r_[1.0, budget], np.zeros(n), np.ones(n), np.ones(n, dtype=bool),
                      time_limit=10, warm_start=x0)


def test_a_warm_start_highs_presolve_returns_as_optimal_is_solved_again():
    """The case CI's hypothesis run found in sizing (loads [203, 1897], slack 1.140625): HiGHS 1.16's
    presolve returned the warm start (point 0) as optimal with objective and bound 0; point 12 is
    the cheapest within the budget."""
    cost = np.array([2.72333858e-05, 1.65446925e-05, 1.62405249e-05, 1.02625181e-05, 1.00666848e-05, 7.88334750e-06,
                     5.93334320e-06, 5.68334270e-06, 4.50834075e-06, 3.63333860e-06, 3.31667210e-06, 2.93333760e-06,
                     2.59166985e-06, 2.22500325e-06, 2.13958601e-06, 2.10833675e-06, 1.68333550e-06, 1.51666890e-06,
                     1.21875164e-06])
    latency = np.array([0.16881273, 0.16941213, 0.17038766, 0.17115251, 0.17117628, 0.1743985, 0.17528501, 0.17881416,
                        0.1797546, 0.18355002, 0.18850853, 0.19046679, 0.20008004, 0.20392985, 0.21189119, 0.2138649,
                        0.2347725, 0.2425082, 0.29979481])
    result = pick_one(cost, latency, 0.20392712, warm=0)
    assert np.flatnonzero(result.x > 0.5).tolist() == [12]
    assert result.objective == pytest.approx(cost[12], rel=1e-9)
    assert result.bound <= result.objective * (1 + 1e-12)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), warm=st.booleans())
def test_the_solution_is_the_enumerated_optimum_and_its_objective_is_its_cost(seed, warm):
    """Random pick-one knapsacks (costs spanning 1e-7..1, the scales sizing's dollar costs take),
    warm-started from the fastest point or cold: the cheapest feasible point within the gap, and
    the reported objective is the returned point's cost."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 25))
    latency = np.sort(rng.random(n))
    cost = np.sort(rng.random(n))[::-1] * 10 ** rng.uniform(-7, 0)
    budget = rng.uniform(latency[0], latency[-1] + 0.1)
    result = pick_one(cost, latency, budget, warm=0 if warm else None)
    best = cost[latency <= budget].min()
    assert latency @ result.x <= budget + 1e-9
    assert cost @ result.x <= best * (1 + 1e-4)
    assert result.objective == pytest.approx(cost @ result.x, rel=1e-9)
