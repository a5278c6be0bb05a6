"""The layer step's transportation problem, re-solved for each round of load prices from the last basis.

Why: `ilp._flow_with_prices` solves the same transportation problem (rows: an expert's replicas,
columns: a partition's slots, at most `limit` replicas of an expert per partition) up to 8 times
per layer step, only the prices changing. Built and solved from scratch each round these LPs took
42 of the 90 CPU s of a DeepSeek-V3 x 64 GPU solve. Here the model is built once per step; a new
round changes the costs and HiGHS restarts from the previous optimal basis, which stays primal
feasible, so a few pivots suffice. A basis is a vertex, and the problem is totally unimodular,
so every answer is integral. Deterministic: single-threaded HiGHS with a fixed seed and the same
sequence of cost vectors.
"""
from __future__ import annotations

import numpy as np
import scipy.sparse as sp


class TransportLP:
    """max sum value * m, row sums `to_place` (int [n]), column sums `slots` (int [P]), 0 <= m <= limit (int [n])."""

    def __init__(self, to_place: np.ndarray, limit: np.ndarray, slots: np.ndarray):
        import highspy

        n, P = len(to_place), len(slots)
        self.shape = (n, P)
        nm = n * P
        index = np.arange(nm)
        A = sp.vstack([
            sp.csr_matrix((np.ones(nm), (np.repeat(np.arange(n), P), index)), shape=(n, nm)),
            sp.csr_matrix((np.ones(nm), (np.tile(np.arange(P), n), index)), shape=(P, nm)),
        ]).tocsc()
        bounds = np.concatenate([to_place, slots]).astype(np.float64)
        lp = highspy.HighsLp()
        lp.num_col_, lp.num_row_ = nm, n + P
        lp.col_cost_ = np.zeros(nm)
        lp.col_lower_ = np.zeros(nm)
        lp.col_upper_ = np.repeat(limit, P).astype(np.float64)
        lp.row_lower_ = bounds
        lp.row_upper_ = bounds
        lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
        lp.a_matrix_.start_ = A.indptr.astype(np.int32)
        lp.a_matrix_.index_ = A.indices.astype(np.int32)
        lp.a_matrix_.value_ = A.data.astype(np.float64)
        self.highs = highspy.Highs()
        for option, value in (("output_flag", False), ("threads", 1), ("random_seed", 0), ("presolve", "off")):
            self.highs.setOptionValue(option, value)
        self.highs.passModel(lp)
        self._optimal = highspy.HighsModelStatus.kOptimal
        self._time_limit = highspy.HighsModelStatus.kTimeLimit
        self._columns = np.arange(nm, dtype=np.int32)

    def solve(self, value: np.ndarray, time_limit: float) -> tuple:
        """(int [n, P] maximising sum value * m, from the last round's basis, or None; status: "optimal",
        "time_limit" (the safety net stopped it) or "other")."""
        scale = max(float(np.abs(value).max()), 1e-12)
        self.highs.changeColsCost(len(self._columns), self._columns, (-value / scale).ravel().astype(np.float64))
        self.highs.setOptionValue("time_limit", float(max(time_limit, 0.01)))
        self.highs.run()
        status = self.highs.getModelStatus()
        if status != self._optimal:
            return None, "time_limit" if status == self._time_limit else "other"
        x = np.asarray(self.highs.getSolution().col_value).reshape(self.shape)
        rounded = np.rint(x)
        if np.abs(x - rounded).max() > 1e-6:  # cannot happen at a basis of this TU problem; left to the MIP
            return None, "other"
        return rounded.astype(np.int64), "optimal"
