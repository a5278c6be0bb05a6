"""The serverless planning pipeline: profile -> facts -> popularity -> (BO) -> ODS sizing -> plan.

Why one function: `moeplan plan --target lambda` and the benchmark must run the same steps in
the same order. The routing trace is split by sequence into the key-value table (the profiled
samples, first part) and the validation batches (last `validation_fraction`), whose token ids
are the expected requests and whose real loads are the BO objective. The plan is static - sized
once for the mean predicted per-expert load of a `batch_tokens` batch - because functions are
deployed before serving.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np

from moeplan.passes.analysis import popularity as pop
from moeplan.passes.analysis.trace.format import Trace
from moeplan.passes.optimize.serverless import billing as sc
from moeplan.passes.optimize.serverless import sizing
from moeplan.passes.optimize.serverless.bo_refine import BOOptions, refine
from moeplan.passes.optimize.serverless.sim import simulate
from moeplan.core.errors import UserError

DEFAULT_BATCH_TOKENS = 10240


def split_by_sequence(trace: Trace, validation_fraction: float) -> tuple:
    """Row indices (table, validation): whole sequences, the last ones held out."""
    T = trace.num_tokens
    n_val = int(round(T * validation_fraction))
    cut = T - n_val
    if trace.sequence is not None and 0 < cut < T:
        seq = trace.sequence
        # move the cut back to a sequence boundary
        while cut > 0 and seq[cut - 1] == seq[cut]:
            cut -= 1
    return np.arange(cut), np.arange(cut, T)


def real_batches(trace: Trace, rows: np.ndarray, batch_tokens: int) -> list:
    """(rows, real loads) per full batch; a split shorter than one batch is one scaled batch."""
    out = []
    for b in range(len(rows) // batch_tokens):
        r = rows[b * batch_tokens:(b + 1) * batch_tokens]
        out.append((r, trace.expert_loads(r)))
    if not out and len(rows):
        scale = batch_tokens / len(rows)
        out.append((rows, np.rint(trace.expert_loads(rows) * scale).astype(np.int64)))
    return out


def predicted_loads(predictor, trace: Trace, batches: list, batch_tokens: int, statistic: str = "mean") -> np.ndarray:
    """Predicted per-expert load of a `batch_tokens` batch: the mean (or, per expert, the max)
    over the given batches. Sizing for the max trades cost for fewer SLO misses on busy batches."""
    preds = []
    for rows, _ in batches:
        pl = predictor.predict_loads(trace.token_ids[rows], None if trace.positions is None else trace.positions[rows])
        preds.append(pl * (batch_tokens / len(rows)))
    if statistic not in ("mean", "max"):
        raise UserError(f"unknown load statistic '{statistic}'; use mean or max")
    agg = np.max(preds, axis=0) if statistic == "max" else np.mean(preds, axis=0)
    return np.rint(agg).astype(np.int64)


@dataclass
class SizingOptions:
    methods: tuple = sizing.DEFAULT_METHODS
    betas: tuple = sizing.DEFAULT_BETAS
    time_limit_s: float = 10.0
    solver: str = "highs"


@dataclass
class PlanOutcome:
    result: sizing.SizingResult
    sizing_loads: np.ndarray
    predicted_sim: object
    validation: list                  # SimResult per validation batch
    predictor_error: dict             # name -> load error on validation batches
    bo: dict | None = None
    timings: dict = field(default_factory=dict)
    predictor: object = None          # the (refined) predictor the plan was sized with
    predictor_options: dict = field(default_factory=dict)
    predictor_selection: list = field(default_factory=list)  # (options, validation error) tried


def size_for(facts, loads, slo_s, batch_tokens, opts: SizingOptions):
    return sizing.ods(facts, loads, slo_s, methods=opts.methods, betas=opts.betas, batch_tokens=batch_tokens,
                      time_limit_s=opts.time_limit_s, solver=opts.solver)


def penalised_cost(sim, slo_s: float, penalty: float) -> float:
    excess = max(0.0, sim.latency / slo_s - 1.0)
    return sim.moe_cost * (1.0 + penalty * excess)


def plan_serverless(facts: sc.ServerlessFacts, trace: Trace, slo_s: float, *, batch_tokens: int = DEFAULT_BATCH_TOKENS,
                    validation_fraction: float = 0.2, predictor_options: dict | None = None,
                    sizing_options: SizingOptions | None = None, bo_options: BOOptions | None = None,
                    progress=None, table_rows=None, validation_rows=None, request_batches=None,
                    size_for_statistic: str = "mean") -> PlanOutcome:
    """Everything after profiling. `bo_options=None` skips BO refinement.

    By default the trace is split by sequence (`validation_fraction`); `table_rows` /
    `validation_rows` override the split, and `request_batches` (row arrays of `trace`) are the
    expected requests whose predicted loads the final plan is sized for (default: the
    validation batches).
    """
    sizing_options = sizing_options or SizingOptions()
    if trace.token_ids is None:
        raise UserError("the trace has no 'token_ids'; serverless planning predicts loads from token ids - re-record it with 'moeplan trace'")
    if trace.num_layers != len(facts.layers):
        raise UserError(f"the trace has {trace.num_layers} MoE layers but the model has {len(facts.layers)}; was it traced from another model?")
    if slo_s <= 0 or not math.isfinite(slo_s):
        raise UserError(f"--slo must be a positive number of seconds, got {slo_s}")
    timings = {}
    t0 = time.perf_counter()
    if table_rows is None or validation_rows is None:
        table_rows, val_rows = split_by_sequence(trace, validation_fraction)
    else:
        val_rows = validation_rows
    if len(table_rows) == 0 or len(val_rows) == 0:
        raise UserError(f"the trace has {trace.num_tokens} tokens: too few to split into a table and validation batches; trace more text")
    table = pop.CountTable.from_trace(trace.select(table_rows))
    val = real_batches(trace, val_rows, batch_tokens)
    if predictor_options is None:
        popts, selection = pop.select_options(table, trace, val)
    else:
        popts, selection = dict(predictor_options), []
    errors = {}
    lina_opts = {"assignment": popts.get("assignment", pop.BayesianPredictor.assignment)}
    for name, opts in (("ours", popts), ("lina", lina_opts), ("marginal", {})):
        kind = {"ours": "bayes"}.get(name, name)
        pr = pop.make_predictor(kind, table, **opts)
        preds = [pr.predict_loads(trace.token_ids[r], None if trace.positions is None else trace.positions[r]) * (batch_tokens / len(r)) for r, _ in val]
        errors[name] = pop.load_error(preds, [l for _, l in val])
    requests = val if request_batches is None else [(r, None) for r in request_batches]
    predictor = pop.make_predictor("bayes", table, **popts)
    loads = predicted_loads(predictor, trace, requests, batch_tokens, size_for_statistic)
    timings["prediction_s"] = round(time.perf_counter() - t0, 3)
    bo_report = None
    if bo_options is not None:
        t1 = time.perf_counter()

        def evaluate(candidate):
            pr = pop.make_predictor("bayes", candidate, **popts)
            pl = predicted_loads(pr, trace, val, batch_tokens, size_for_statistic)
            try:
                res = size_for(facts, pl, slo_s, batch_tokens, sizing_options)
            except UserError:
                return math.inf, []
            costs, misses = [], []
            for rows, real in val:
                sim = simulate(facts, res.layers, real, batch_tokens)
                costs.append(penalised_cost(sim, slo_s, bo_options.slo_penalty))
                misses += _mispredictions(trace, rows, res.layers, pl, real, sim, bo_options.alpha)
            return float(np.mean(costs)), misses

        positions = trace.positions[table_rows] if trace.positions is not None else np.zeros(1, dtype=np.int64)
        bo = refine(table, evaluate, vocab_tokens=np.unique(trace.token_ids[table_rows]),
                    max_position=int(positions.max()), options=bo_options, progress=progress)
        predictor = pop.make_predictor("bayes", bo.best_table, **popts)
        loads = predicted_loads(predictor, trace, requests, batch_tokens, size_for_statistic)
        preds = [predictor.predict_loads(trace.token_ids[r], None if trace.positions is None else trace.positions[r]) * (batch_tokens / len(r)) for r, _ in val]
        errors["ours_after_bo"] = pop.load_error(preds, [l for _, l in val])
        bo_report = {"iterations": bo.iterations, "baseline_cost": bo.baseline_cost, "best_cost": bo.best_cost,
                     "seconds": bo.seconds, "history": bo.history}
        timings["bo_s"] = round(time.perf_counter() - t1, 3)
    t2 = time.perf_counter()
    result = size_for(facts, loads, slo_s, batch_tokens, sizing_options)
    timings["sizing_s"] = round(time.perf_counter() - t2, 3)
    predicted_sim = simulate(facts, result.layers, loads, batch_tokens)
    validation = [simulate(facts, result.layers, real, batch_tokens) for _, real in val]
    return PlanOutcome(result, loads, predicted_sim, validation, errors, bo_report, timings, predictor, popts, selection)


def _mispredictions(trace, rows, layers, predicted, real, sim, alpha) -> list:
    """(kind, keys) for experts whose per-replica load was off by more than alpha tokens."""
    over = {(e, i): kind for e, i, kind, _ in sim.overflows}
    out = []
    ex = trace.experts[rows]
    for e, dec in enumerate(layers):
        for i, ch in enumerate(dec.experts):
            if abs(predicted[e, i] - real[e, i]) / max(ch.replicas, 1) <= alpha:
                continue
            hit = np.flatnonzero((ex[:, e, :] == i).any(axis=1))[:64]
            r = rows[hit]
            att = trace.attention_ids[r, e] if trace.attention_ids is not None else np.full(len(r), -1)
            pos = trace.positions[r] if trace.positions is not None else np.zeros(len(r), dtype=np.int64)
            keys = np.stack([trace.token_ids[r], pos, att, np.full(len(r), e), np.full(len(r), i)], axis=1)
            out.append((over.get((e, i), "other"), keys))
    return out

