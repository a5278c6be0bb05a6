"""One entry point for the mixed-integer programs moeplan solves, in matrix form.

Why: models are built as scipy.sparse matrices (fast at any size) and handed to HiGHS (free,
embedded, the default) or Gurobi (`gurobipy`, optional, imported only when asked). The pip
Gurobi licence is size-limited (about 2000 variables or constraints): such a model, or a missing
or unlicensed gurobipy, falls back to HiGHS with a note saying why. Every solve has a time
limit, may be warm-started, and returns its incumbent, objective, best bound and gap. A HiGHS
answer whose objective is not its point's cost is not trusted: the model is solved again
without presolve (HiGHS 1.16 returned a warm start as optimal with objective 0).

Model: minimise c @ x subject to row_lower <= A @ x <= row_upper, lower <= x <= upper,
x[integer] integral.

Every HiGHS object is made by `quiet_highs()`: highspy prints HiGHS's banner on stdout while it
constructs one, before any option can turn output off, and `--json` stdout must stay JSON.
"""
from __future__ import annotations

import contextlib
import os
import sys
import time
from dataclasses import dataclass, field

import numpy as np
import scipy.sparse as sp

GUROBI_SIZE_LIMIT = 2000


@dataclass
class MilpResult:
    x: np.ndarray | None  # best incumbent (None when none was found)
    objective: float
    bound: float
    status: str  # "optimal", "time_limit", "infeasible", "other"
    seconds: float
    notes: list = field(default_factory=list)
    solver: str = "highs"

    @property
    def gap(self) -> float:
        return relative_gap(self.objective, self.bound)

    @property
    def feasible(self) -> bool:
        return self.x is not None


class Rows:
    """Constraint rows lower <= A @ x <= upper for `solve_milp`, appended one or a block at a time.

    Why: the models here are built row by row from index arithmetic; one builder keeps the row
    numbering, the bounds and the sparse matrix in one place instead of in each model."""

    def __init__(self):
        self._rows, self._cols, self._vals, self._lower, self._upper = [], [], [], [], []
        self.count = 0

    def add(self, columns, values, lower: float, upper: float) -> None:
        """One row: sum_i values[i] x[columns[i]] within [lower, upper]."""
        self.add_block(np.zeros(len(columns), dtype=np.int64), columns, values, lower, upper, 1)

    def add_block(self, row_ids, columns, values, lower, upper, count: int) -> None:
        """`count` rows at once: entry i (values[i] at column columns[i]) goes to the block's row
        row_ids[i], numbered 0 .. count-1; lower and upper are scalars or float [count]."""
        self._rows.append(self.count + np.asarray(row_ids, dtype=np.int64))
        self._cols.append(np.asarray(columns, dtype=np.int64))
        self._vals.append(np.asarray(values, dtype=np.float64))
        self._lower.append(np.broadcast_to(np.asarray(lower, dtype=np.float64), (count,)))
        self._upper.append(np.broadcast_to(np.asarray(upper, dtype=np.float64), (count,)))
        self.count += count

    def matrix(self, columns: int) -> tuple:
        """(A: scipy.sparse CSC [rows, columns], row lower float [rows], row upper float [rows])."""
        def joined(parts, dtype):
            return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)

        A = sp.csc_matrix((joined(self._vals, np.float64), (joined(self._rows, np.int64), joined(self._cols, np.int64))),
                          shape=(self.count, columns))
        return A, joined(self._lower, np.float64), joined(self._upper, np.float64)


def relative_gap(objective: float, bound: float) -> float:
    """(objective - bound) / |objective| for a minimisation; 0 when both are 0."""
    if not np.isfinite(objective):
        return float("inf")
    if abs(objective) < 1e-9:
        return 0.0 if bound >= objective - 1e-9 else float("inf")
    return max(0.0, (objective - bound) / abs(objective))


def solve_milp(
    c: np.ndarray,
    A: sp.spmatrix,
    row_lower: np.ndarray,
    row_upper: np.ndarray,
    lower: np.ndarray,
    upper: np.ndarray,
    integer: np.ndarray,
    *,
    time_limit: float,
    warm_start: np.ndarray | None = None,
    solver: str = "highs",
    mip_gap: float = 1e-4,
    node_limit: int | None = None,
    iteration_limit: int | None = None,
) -> MilpResult:
    """Solve the model above; `integer` is a bool mask over columns.

    `node_limit` caps branch-and-bound nodes: a work limit, so results do not depend on machine
    speed the way a time limit does (the time limit stays as a safety net). `iteration_limit`
    caps simplex iterations (LPs): also a work limit; the status is then "work_limit".

    The objective is scaled to O(1) before solving: solvers' absolute gap tolerances (1e-6 in
    HiGHS) would otherwise stop at once on objectives such as dollar costs of ~1e-6. When the
    limit hits before the solver finds a point, the warm start is returned as the incumbent."""
    c = np.asarray(c, dtype=np.float64)
    scale = float(np.max(np.abs(c))) if c.size and np.max(np.abs(c)) > 0 else 1.0
    notes = []
    result = None
    if solver == "gurobi":
        result = _try_gurobi(c / scale, A, row_lower, row_upper, lower, upper, integer, time_limit, warm_start, mip_gap, notes,
                             node_limit, iteration_limit)
    elif solver != "highs":
        raise ValueError(f"unknown solver {solver!r}")
    if result is None:
        result = _solve_highs(c / scale, A, row_lower, row_upper, lower, upper, integer, time_limit, warm_start, mip_gap,
                              node_limit, iteration_limit)
    result.notes = notes + result.notes
    if result.x is None and warm_start is not None and result.status in ("time_limit", "work_limit"):
        result.x = np.asarray(warm_start, dtype=np.float64)
        result.objective = float((c / scale) @ result.x)
    result.objective *= scale
    result.bound *= scale
    return result


def quiet_highs():
    """A `highspy.Highs` with output off that wrote nothing to stdout while it was made.

    Why: highspy 1.16's constructor registers its callbacks first, and HiGHS logs its two-line
    banner to the process's stdout then (once per process), so `output_flag` set afterwards is too
    late. The banner is written by C code, so file descriptor 1 itself is pointed at /dev/null for
    the constructor and C's stdio buffer is flushed there before it is restored."""
    import highspy

    with _fd1_to_devnull():
        h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    return h


@contextlib.contextmanager
def _fd1_to_devnull():
    """Point file descriptor 1 at /dev/null for the block (C-level writes included)."""
    try:
        sys.stdout.flush()
    except (AttributeError, ValueError):  # stdout replaced or closed
        pass
    try:
        saved = os.dup(1)
    except OSError:  # no fd 1 at all: nothing to protect
        yield
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        try:
            yield
        finally:
            _flush_c_stdio()
            os.dup2(saved, 1)
    finally:
        os.close(devnull)
        os.close(saved)


def _flush_c_stdio() -> None:
    """fflush(NULL): what C code buffered for fd 1 goes to /dev/null, not to the restored stdout."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
        libc.fflush(None)
    except (OSError, AttributeError):  # no C library to flush (then nothing was buffered by it)
        pass


def _solve_highs(c, A, row_lower, row_upper, lower, upper, integer, time_limit, warm_start, mip_gap, node_limit=None,
                 iteration_limit=None) -> MilpResult:
    import highspy

    start = time.perf_counter()
    A = sp.csc_matrix(A)
    n_rows, n_cols = A.shape
    lp = highspy.HighsLp()
    lp.num_col_ = n_cols
    lp.num_row_ = n_rows
    lp.col_cost_ = np.asarray(c, dtype=np.float64)
    lp.col_lower_ = np.asarray(lower, dtype=np.float64)
    lp.col_upper_ = np.asarray(upper, dtype=np.float64)
    lp.row_lower_ = np.asarray(row_lower, dtype=np.float64)
    lp.row_upper_ = np.asarray(row_upper, dtype=np.float64)
    lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
    lp.a_matrix_.start_ = A.indptr.astype(np.int32)
    lp.a_matrix_.index_ = A.indices.astype(np.int32)
    lp.a_matrix_.value_ = A.data.astype(np.float64)
    is_mip = bool(np.any(integer))
    if is_mip:
        lp.integrality_ = [highspy.HighsVarType.kInteger if i else highspy.HighsVarType.kContinuous for i in integer]
    h = quiet_highs()
    h.setOptionValue("threads", 1)
    h.setOptionValue("random_seed", 0)
    h.setOptionValue("time_limit", float(max(time_limit, 0.01)))
    h.setOptionValue("mip_rel_gap", float(mip_gap))
    if node_limit is not None:
        h.setOptionValue("mip_max_nodes", int(node_limit))
    if iteration_limit is not None:
        h.setOptionValue("simplex_iteration_limit", int(iteration_limit))
    h.passModel(lp)
    _run_from(h, warm_start if is_mip else None)
    if _misreported(h, c):
        # HiGHS 1.16's MIP presolve can hand back the warm start as "optimal" with objective and
        # bound 0 when a better point exists (a one-row knapsack in sizing); without presolve it
        # solves the same model right
        h.clearSolver()
        h.setOptionValue("presolve", "off")
        h.setOptionValue("time_limit", float(max(time_limit - (time.perf_counter() - start), 0.01)))
        _run_from(h, warm_start if is_mip else None)
    status = h.getModelStatus()
    info = h.getInfo()
    seconds = time.perf_counter() - start
    name = {
        highspy.HighsModelStatus.kOptimal: "optimal",
        highspy.HighsModelStatus.kTimeLimit: "time_limit",
        highspy.HighsModelStatus.kSolutionLimit: "work_limit",
        highspy.HighsModelStatus.kIterationLimit: "work_limit",
        highspy.HighsModelStatus.kInfeasible: "infeasible",
    }.get(status, "other")
    has_solution = info.primal_solution_status == 2  # kSolutionStatusFeasible
    x = np.asarray(h.getSolution().col_value) if has_solution else None
    objective = float(info.objective_function_value) if has_solution else float("inf")
    if is_mip:
        bound = float(info.mip_dual_bound)
        if not np.isfinite(bound):
            bound = -float("inf")
    else:
        bound = objective if name == "optimal" else -float("inf")
    if name == "optimal" and x is not None and is_mip:
        bound = max(bound, objective - abs(objective) * mip_gap)
    return MilpResult(x, objective, bound, name, seconds)


def _run_from(h, warm_start) -> None:
    """Runs the Highs object `h`, from the point float [n] `warm_start` when given."""
    import highspy

    if warm_start is not None:
        sol = highspy.HighsSolution()
        sol.col_value = np.asarray(warm_start, dtype=np.float64)
        sol.value_valid = True
        h.setSolution(sol)
    h.run()


def _misreported(h, c: np.ndarray) -> bool:
    """Whether HiGHS's reported objective is not the cost c (float [n]) of the point it returns."""
    info = h.getInfo()
    if info.primal_solution_status != 2:
        return False
    actual = float(c @ np.asarray(h.getSolution().col_value))
    return abs(actual - float(info.objective_function_value)) > 1e-7 * max(1.0, abs(actual))


def _try_gurobi(c, A, row_lower, row_upper, lower, upper, integer, time_limit, warm_start, mip_gap, notes,
                node_limit=None, iteration_limit=None):
    n_rows, n_cols = A.shape
    try:
        import gurobipy as gp
    except ImportError:
        notes.append("gurobipy is not installed; solved with HiGHS instead (pip install gurobipy and a licence to use Gurobi)")
        return None
    start = time.perf_counter()
    try:
        env = gp.Env(empty=True)
        env.setParam("OutputFlag", 0)
        env.start()
        model = gp.Model(env=env)
        vtype = np.where(integer, gp.GRB.INTEGER, gp.GRB.CONTINUOUS)
        x = model.addMVar(n_cols, lb=lower, ub=upper, vtype=vtype)
        A = sp.csr_matrix(A)
        finite_hi = np.isfinite(row_upper)
        finite_lo = np.isfinite(row_lower)
        if finite_hi.any():
            model.addMConstr(A[finite_hi], x, "<", np.asarray(row_upper)[finite_hi])
        if finite_lo.any():
            model.addMConstr(A[finite_lo], x, ">", np.asarray(row_lower)[finite_lo])
        model.setObjective(np.asarray(c) @ x, gp.GRB.MINIMIZE)
        model.Params.TimeLimit = float(max(time_limit, 0.01))
        model.Params.MIPGap = mip_gap
        model.Params.Threads = 1
        model.Params.Seed = 0
        if node_limit is not None:
            model.Params.NodeLimit = float(node_limit)
        if iteration_limit is not None:
            model.Params.IterationLimit = float(iteration_limit)
        if warm_start is not None:
            x.Start = np.asarray(warm_start)
        model.optimize()
    except gp.GurobiError as exc:
        if getattr(exc, "errno", None) == 10010 or "size-limited" in str(exc).lower():
            notes.append(
                f"the Gurobi licence is size-limited (model has {n_cols} variables, {n_rows} constraints; "
                f"limit about {GUROBI_SIZE_LIMIT}); solved with HiGHS instead"
            )
        else:
            notes.append(f"Gurobi failed ({exc}); solved with HiGHS instead")
        return None
    seconds = time.perf_counter() - start
    status = {gp.GRB.OPTIMAL: "optimal", gp.GRB.TIME_LIMIT: "time_limit", gp.GRB.INFEASIBLE: "infeasible",
              gp.GRB.NODE_LIMIT: "work_limit", gp.GRB.ITERATION_LIMIT: "work_limit"}.get(model.Status, "other")
    if model.SolCount == 0:
        return MilpResult(None, float("inf"), -float("inf"), status, seconds, notes, solver="gurobi")
    bound = float(model.ObjBound) if bool(np.any(integer)) else float(model.ObjVal)
    return MilpResult(np.asarray(x.X), float(model.ObjVal), bound, status, seconds, notes, solver="gurobi")
