"""`milp.Rows`: the constraint-row builder the MILP models share."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from moeplan.passes.optimize.milp import Rows, solve_milp


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 4), st.integers(0, 10_000)), min_size=0, max_size=8))
def test_rows_and_blocks_build_the_dense_matrix_row_by_row(parts):
    """Single rows and blocks (rows numbered within the block, bounds scalar or per row, repeated
    entries summed) give the matrix and bounds written out densely in the same order."""
    columns = 5
    rows = Rows()
    dense, lower, upper = [], [], []
    for single, count, seed in parts:
        rng = np.random.default_rng(seed)
        count = 1 if single else count
        entries = rng.integers(1, 6)
        row_ids = rng.integers(0, count, entries)
        cols = rng.integers(0, columns, entries)
        vals = rng.integers(-3, 4, entries).astype(float)
        lo, hi = -rng.random(count), rng.random(count)
        block = np.zeros((count, columns))
        np.add.at(block, (row_ids, cols), vals)
        if single:
            rows.add(cols, vals, lo[0], hi[0])
        else:
            rows.add_block(row_ids, cols, vals, lo, hi, count)
        dense.append(block)
        lower.append(lo)
        upper.append(hi)
    A, lo, hi = rows.matrix(columns)
    assert rows.count == A.shape[0] == sum(len(d) for d in dense)
    assert np.array_equal(A.toarray(), np.concatenate(dense) if dense else np.zeros((0, columns)))
    assert np.array_equal(lo, np.concatenate(lower) if lower else np.zeros(0))
    assert np.array_equal(hi, np.concatenate(upper) if upper else np.zeros(0))


def test_rows_feed_solve_milp():
    """max x0 + x1 with x0 + x1 <= 1.5 and x0 - x1 = 0 (a block of one row, scalar bounds): 1.5."""
    rows = Rows()
    rows.add([0, 1], [1.0, 1.0], -np.inf, 1.5)
    rows.add_block([0, 0], [0, 1], [1.0, -1.0], 0.0, 0.0, 1)
    A, lo, hi = rows.matrix(2)
    result = solve_milp(np.array([-1.0, -1.0]), A, lo, hi, np.zeros(2), np.ones(2), np.zeros(2, dtype=bool), time_limit=10)
    assert result.objective == pytest.approx(-1.5)
    assert np.allclose(result.x, [0.75, 0.75])
