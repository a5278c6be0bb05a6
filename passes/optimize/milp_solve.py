"""Solve a matrix-form MILP with HiGHS (default) or Gurobi (when asked and licensed).

Why a wrapper: every solve in moeplan must have a time limit, report objective, best bound and
gap, start from a heuristic incumbent, and return that incumbent when the limit hits. Models are
built as scipy.sparse matrices so large ones build quickly.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import scipy.sparse as sp

from moeplan.planner.errors import UserError


@dataclass(frozen=True)
class MilpResult:
    """Outcome of one solve; `x` is None when no feasible point was found."""

    status: str          # "optimal", "time_limit", "infeasible", "error"
    x: Optional[np.ndarray]
    objective: float
    bound: float
    gap: float
    seconds: float
    solver: str

    @property
    def feasible(self) -> bool:
        return self.x is not None


def solve_milp(c, A, row_lo, row_hi, col_lo, col_hi, integer, *, time_limit_s: float,
               warm_start: Optional[np.ndarray] = None, solver: str = "highs", seed: int = 0) -> MilpResult:
    """min c.x s.t. row_lo <= A x <= row_hi, col_lo <= x <= col_hi, x[integer] integral."""
    A = sp.csc_matrix(A)
    c = np.asarray(c, dtype=float)
    # Scale the objective to O(1): solvers' absolute gap tolerances (1e-6 in HiGHS) would
    # otherwise stop at once on dollar costs of ~1e-6.
    scale = float(np.max(np.abs(c))) if c.size and np.max(np.abs(c)) > 0 else 1.0
    res = _dispatch(c / scale, A, row_lo, row_hi, col_lo, col_hi, integer, time_limit_s, warm_start, solver, seed)
    return MilpResult(res.status, res.x, res.objective * scale, res.bound * scale, res.gap, res.seconds, res.solver)


def _dispatch(c, A, row_lo, row_hi, col_lo, col_hi, integer, time_limit_s, warm_start, solver, seed):
    if solver == "gurobi":
        return _solve_gurobi(c, A, row_lo, row_hi, col_lo, col_hi, integer, time_limit_s, warm_start)
    if solver != "highs":
        raise UserError(f"unknown solver '{solver}'; use 'highs' or 'gurobi'")
    return _solve_highs(c, A, row_lo, row_hi, col_lo, col_hi, integer, time_limit_s, warm_start, seed)


def _solve_highs(c, A, row_lo, row_hi, col_lo, col_hi, integer, time_limit_s, warm_start, seed):
    import time

    import highspy

    inf = highspy.kHighsInf
    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("time_limit", float(time_limit_s))
    h.setOptionValue("random_seed", int(seed))
    h.setOptionValue("threads", 1)
    h.setOptionValue("mip_rel_gap", 1e-6)
    h.setOptionValue("mip_abs_gap", 0.0)
    lp = highspy.HighsLp()
    n, m = A.shape[1], A.shape[0]
    lp.num_col_, lp.num_row_ = n, m
    lp.col_cost_ = np.asarray(c, dtype=float)
    lp.col_lower_ = np.where(np.isfinite(col_lo), col_lo, -inf).astype(float)
    lp.col_upper_ = np.where(np.isfinite(col_hi), col_hi, inf).astype(float)
    lp.row_lower_ = np.where(np.isfinite(row_lo), row_lo, -inf).astype(float)
    lp.row_upper_ = np.where(np.isfinite(row_hi), row_hi, inf).astype(float)
    lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
    lp.a_matrix_.start_ = A.indptr.astype(np.int32)
    lp.a_matrix_.index_ = A.indices.astype(np.int32)
    lp.a_matrix_.value_ = A.data.astype(float)
    kinds = [highspy.HighsVarType.kInteger if flag else highspy.HighsVarType.kContinuous for flag in integer]
    lp.integrality_ = kinds
    h.passModel(lp)
    if warm_start is not None:
        sol = highspy.HighsSolution()
        sol.col_value = list(map(float, warm_start))
        sol.value_valid = True
        h.setSolution(sol)
    start = time.perf_counter()
    h.run()
    seconds = time.perf_counter() - start
    status = h.getModelStatus()
    info = h.getInfo()
    S = highspy.HighsModelStatus
    has_point = info.primal_solution_status == 2  # kSolutionStatusFeasible
    names = {S.kOptimal: "optimal", S.kTimeLimit: "time_limit", S.kInfeasible: "infeasible"}
    name = names.get(status, "error")
    x = np.asarray(h.getSolution().col_value) if has_point else None
    if x is None and warm_start is not None and name == "time_limit":
        x = np.asarray(warm_start, dtype=float)
    objective = float(np.dot(c, x)) if x is not None else float("inf")
    bound = float(info.mip_dual_bound) if np.isfinite(info.mip_dual_bound) else float("-inf")
    gap = max(0.0, (objective - bound) / max(abs(objective), 1e-12)) if x is not None and np.isfinite(bound) else float("inf")
    return MilpResult(name if x is not None or name == "infeasible" else name, x, objective, bound, gap, seconds, "highs")


def _solve_gurobi(c, A, row_lo, row_hi, col_lo, col_hi, integer, time_limit_s, warm_start):
    try:
        import gurobipy as gp
    except ImportError:
        raise UserError("solver 'gurobi' needs gurobipy (pip install gurobipy and a licence); use --solver highs")
    import time

    try:
        model = gp.Model()
        model.Params.OutputFlag = 0
        model.Params.TimeLimit = float(time_limit_s)
        vtype = np.where(np.asarray(integer), gp.GRB.INTEGER, gp.GRB.CONTINUOUS)
        x = model.addMVar(A.shape[1], lb=col_lo, ub=col_hi, vtype=vtype)
        lo_rows = np.isfinite(row_lo)
        hi_rows = np.isfinite(row_hi)
        A = sp.csr_matrix(A)
        if hi_rows.any():
            model.addMConstr(A[hi_rows], x, "<", np.asarray(row_hi)[hi_rows])
        if lo_rows.any():
            model.addMConstr(A[lo_rows], x, ">", np.asarray(row_lo)[lo_rows])
        model.setObjective(np.asarray(c) @ x)
        if warm_start is not None:
            x.Start = warm_start
        start = time.perf_counter()
        model.optimize()
        seconds = time.perf_counter() - start
    except gp.GurobiError as exc:
        raise UserError(f"Gurobi failed ({exc}); the pip licence is limited to small models, use --solver highs")
    if model.SolCount == 0:
        status = "infeasible" if model.Status == gp.GRB.INFEASIBLE else "error"
        return MilpResult(status, None, float("inf"), float("-inf"), float("inf"), seconds, "gurobi")
    status = "optimal" if model.Status == gp.GRB.OPTIMAL else "time_limit"
    return MilpResult(status, np.asarray(x.X), float(model.ObjVal), float(model.ObjBound), float(model.MIPGap), seconds, "gurobi")
