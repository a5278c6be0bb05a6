"""XGBoost latency and memory predictors over profiled operator runs (MOPAR's service profiler).

Why: measurements exist only at a few (batch size, thread count) points and are noisy; a
regressor over (FLOPs/token, parameter bytes, tokens, threads, kind) smooths them and predicts
the points the planner asks for. Memory uses `reg:squaredlogerror` as MOPAR does (its RMSLE
penalises the under-estimates that cause out-of-memory kills); time is fitted on log seconds.
Both learn per-token quantities (seconds and KiB per token), which vary far less with the batch
size than totals do, so the trees' piecewise-constant fit interpolates well between grid points.
Both are scored by RMSLE on a seeded held-out quarter of the measurements (time in
microseconds, memory in bytes, so the log compares magnitudes rather than rounding to 0).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

FEATURES = ("log_flops_per_token", "log_param_bytes", "log_tokens", "threads", "is_expert")


def features(flops_per_token, param_bytes, tokens, threads, is_expert) -> np.ndarray:
    cols = [np.log1p(np.asarray(flops_per_token, float)), np.log1p(np.asarray(param_bytes, float)),
            np.log(np.asarray(tokens, float)), np.asarray(threads, float), np.asarray(is_expert, float)]
    return np.stack(np.broadcast_arrays(*cols), axis=-1)


def rmsle(pred, true) -> float:
    pred, true = np.maximum(np.asarray(pred, float), 0), np.asarray(true, float)
    return float(np.sqrt(np.mean((np.log1p(pred) - np.log1p(true)) ** 2)))


@dataclass
class OperatorPredictors:
    """Fitted time (seconds per call) and memory (peak intermediate bytes) regressors."""

    time_model: object
    memory_model: object
    time_rmsle: float
    memory_rmsle: float
    train_rows: int
    test_rows: int
    time_rmsle_by_threads: dict = None

    def time(self, X) -> np.ndarray:
        import xgboost as xgb

        X = np.atleast_2d(X)
        return np.exp(self.time_model.predict(xgb.DMatrix(X))) * np.exp(X[:, FEATURES.index("log_tokens")])

    def memory(self, X) -> np.ndarray:
        import xgboost as xgb

        X = np.atleast_2d(X)
        kib = np.maximum(self.memory_model.predict(xgb.DMatrix(X)), 0.0)
        return kib * 1024.0 * np.exp(X[:, FEATURES.index("log_tokens")])


_PARAMS = {"max_depth": 4, "eta": 0.3, "subsample": 1.0, "nthread": 1, "seed": 0, "verbosity": 0}


def fit_predictors(X: np.ndarray, seconds: np.ndarray, peak_bytes: np.ndarray, *, seed: int = 0,
                   rounds: int = 150) -> OperatorPredictors:
    """Fit both regressors on 75% of the rows (seeded split) and score RMSLE on the rest."""
    import xgboost as xgb

    n = len(X)
    order = np.random.default_rng(seed).permutation(n)
    n_test = max(1, n // 4) if n >= 4 else 0
    test, train = order[:n_test], order[n_test:]
    if n_test == 0:
        test = train
    seconds = np.asarray(seconds, float)
    peak_bytes = np.asarray(peak_bytes, float)
    # time is learned per token (log seconds / token): it varies far less with batch size than
    # the total does, so the trees' piecewise-constant fit interpolates between grid points
    tokens = np.exp(X[:, FEATURES.index("log_tokens")])
    d_time = xgb.DMatrix(X[train], label=np.log(seconds[train] / tokens[train]))
    time_model = xgb.train({**_PARAMS, "objective": "reg:squarederror", "max_depth": 3, "eta": 0.1}, d_time,
                           num_boost_round=2 * rounds)
    # Memory per token in KiB with min_child_weight 0: squaredlogerror's hessians are
    # ~1/label^2, so on raw bytes every leaf falls under the default minimum weight and the model
    # never splits; per token, intermediates are nearly constant across batch sizes.
    kib = peak_bytes / tokens / 1024.0
    d_mem = xgb.DMatrix(X[train], label=kib[train])
    memory_model = xgb.train({**_PARAMS, "objective": "reg:squaredlogerror", "min_child_weight": 0.0,
                              "base_score": float(np.median(kib[train]))}, d_mem, num_boost_round=2 * rounds)
    preds = OperatorPredictors(time_model, memory_model, 0.0, 0.0, len(train), len(test) if n_test else 0)
    preds.time_rmsle = rmsle(preds.time(X[test]) * 1e6, seconds[test] * 1e6)  # on microseconds
    th = X[test, FEATURES.index("threads")]
    preds.time_rmsle_by_threads = {int(t): rmsle(preds.time(X[test][th == t]) * 1e6, seconds[test][th == t] * 1e6)
                                   for t in np.unique(th)}
    preds.memory_rmsle = rmsle(preds.memory(X[test]), peak_bytes[test])
    return preds
