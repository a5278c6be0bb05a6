"""Expert-popularity prediction: per-expert token loads of a batch from its token ids alone.

Why: serverless functions are sized before serving, so each expert's load must be predicted
from what is known ahead of time - the batch's token ids and positions. Three predictors:

* `BayesianPredictor` (serverless-MoE paper, Sec. III-B): a key-value count table over (token id
  f1, position f2, attention id f3, layer e, expert i). For a token with known f1 the paper's
  posterior reduces, in discrete form, to score_i = sum_{f2,f3} C(f1,f2,f3,e,i) P'(f3), with
  P'(f3) the token-id frequency of f3 in the profiled data. The position of a token in its
  request is known before inference too, so by default (`use_position=True`) we condition on
  it: score_i(f1, f2) = sum_{f3} C(f1,f2,f3,e,i) P'(f3), shrunk towards the token-level score
  and that towards the layer marginal (Dirichlet back-off with strength `prior`), which also
  covers unseen tokens. MAP top-k (the k largest scores) gives each token's experts.
* `LinaPredictor`: token id only, unweighted counts, MAP top-k (the baseline to beat).
* `MarginalPredictor`: every token spread by the layer's marginal popularity.
`assignment="map"` counts each token's top-k experts (the paper); `"expected"` adds k times the
posterior instead (smoother loads; the default for ours - see `BayesianPredictor`). Metric: `load_error`, the mean absolute per-expert token-count
difference over held-out batches, layers and experts (the paper's prediction error).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from moeplan.passes.analysis.trace_format import Trace
from moeplan.planner.errors import UserError


def true_loads(trace: Trace, rows=None) -> np.ndarray:
    """Real per-expert token counts [L, E] of the given token rows (each of k choices counts)."""
    ex = trace.experts if rows is None else trace.experts[rows]
    L, E = trace.num_layers, trace.num_experts
    out = np.zeros((L, E), dtype=np.int64)
    for l in range(L):
        ids = ex[:, l, :].ravel()
        out[l] = np.bincount(ids[ids >= 0], minlength=E)[:E]
    return out


def batches(num_tokens: int, batch_tokens: int, start: int = 0) -> list:
    """Consecutive full batches of `batch_tokens` token rows (a short remainder is dropped)."""
    n = (num_tokens - start) // batch_tokens
    return [np.arange(start + b * batch_tokens, start + (b + 1) * batch_tokens) for b in range(n)]


def load_error(predicted: list, real: list) -> float:
    """Mean absolute per-expert token-count error over batches, layers and experts."""
    diffs = [np.abs(np.asarray(p, float) - np.asarray(r, float)) for p, r in zip(predicted, real)]
    return float(np.mean(diffs)) if diffs else 0.0


@dataclass
class CountTable:
    """The key-value table: one row per distinct (token, position, attention id, layer, expert)."""

    token: np.ndarray
    position: np.ndarray
    attention: np.ndarray
    layer: np.ndarray
    expert: np.ndarray
    count: np.ndarray            # float: the BO may set any non-negative value
    token_freq: dict             # P'(f3): token id -> frequency in the profiled data
    num_layers: int
    num_experts: int
    top_k: int

    @classmethod
    def from_trace(cls, trace: Trace) -> "CountTable":
        if trace.token_ids is None:
            raise UserError("popularity prediction needs 'token_ids' in the trace; re-record it with 'moeplan trace'")
        T, L, K = trace.experts.shape
        tok = np.repeat(trace.token_ids.astype(np.int64), L * K)
        pos = np.repeat(_positions(trace), L * K)
        att = np.repeat(trace.attention_ids if trace.attention_ids is not None else np.full((T, L), -1), K, axis=1).ravel()
        lay = np.tile(np.repeat(np.arange(L), K), T)
        exp = trace.experts.reshape(-1).astype(np.int64)
        keep = exp >= 0
        cols = np.stack([tok[keep], pos[keep], att[keep], lay[keep], exp[keep]], axis=1)
        uniq, counts = _unique_rows(cols)
        ids, freq = np.unique(trace.token_ids, return_counts=True)
        token_freq = dict(zip(ids.tolist(), (freq / freq.sum()).tolist()))
        return cls(uniq[:, 0], uniq[:, 1], uniq[:, 2], uniq[:, 3], uniq[:, 4], counts.astype(float),
                   token_freq, L, trace.num_experts, K)

    def with_values(self, keys: np.ndarray, values: np.ndarray) -> "CountTable":
        """A copy where each key row (token, position, attention, layer, expert) has its count set."""
        if len(keys) == 0:
            return self
        own = np.stack([self.token, self.position, self.attention, self.layer, self.expert], axis=1)
        merged = np.concatenate([own, np.asarray(keys, dtype=np.int64)])
        vals = np.concatenate([self.count, np.asarray(values, float)])
        # the last write of a key wins: unique over the reversed rows keeps first occurrences
        rev = merged[::-1]
        uniq, first = _unique_rows(rev, return_index=True)
        counts = vals[::-1][first]
        return CountTable(uniq[:, 0], uniq[:, 1], uniq[:, 2], uniq[:, 3], uniq[:, 4], counts,
                          self.token_freq, self.num_layers, self.num_experts, self.top_k)


def _unique_rows(cols: np.ndarray, return_index: bool = False):
    """np.unique over rows, via one packed int64 per row when the ranges allow (much faster)."""
    cols = np.asarray(cols, dtype=np.int64)
    lo = cols.min(axis=0)
    span = cols.max(axis=0) - lo + 1
    if np.prod(span.astype(float)) < 2 ** 62:
        packed = np.zeros(len(cols), dtype=np.int64)
        for c in range(cols.shape[1]):
            packed = packed * span[c] + (cols[:, c] - lo[c])
        _, first, counts = np.unique(packed, return_index=True, return_counts=True)
        uniq = cols[first]
        return (uniq, first) if return_index else (uniq, counts)
    uniq, first, counts = np.unique(cols, axis=0, return_index=True, return_counts=True)
    return (uniq, first) if return_index else (uniq, counts)


def _positions(trace: Trace) -> np.ndarray:
    if trace.positions is not None:
        return trace.positions.astype(np.int64)
    return np.zeros(trace.num_tokens, dtype=np.int64)


class _Scorer:
    """Shared MAP / expected-load machinery over per-token score rows."""

    assignment = "map"

    def scores(self, token_ids, positions) -> np.ndarray:  # [T, L, E] unnormalised
        raise NotImplementedError

    def predict_loads(self, token_ids, positions=None) -> np.ndarray:
        """Predicted per-expert token counts [L, E] for a batch."""
        token_ids = np.asarray(token_ids, dtype=np.int64)
        positions = np.zeros_like(token_ids) if positions is None else np.asarray(positions, dtype=np.int64)
        s = self.scores(token_ids, positions)
        T, L, E = s.shape
        k = self.top_k
        if self.assignment == "expected":
            post = s / np.maximum(s.sum(axis=2, keepdims=True), 1e-300)
            return np.rint(k * post.sum(axis=0)).astype(np.int64)
        # MAP top-k; ties broken by the layer marginal, then by expert id (deterministic)
        tie = self.marginal[None, :, :] * 1e-9 - np.arange(E)[None, None, :] * 1e-15
        top = np.argsort(-(s + tie), axis=2, kind="stable")[:, :, :k]
        out = np.zeros((L, E), dtype=np.int64)
        for l in range(L):
            out[l] = np.bincount(top[:, l, :].ravel(), minlength=E)
        return out


class MarginalPredictor(_Scorer):
    """Every token spread over experts by the layer's marginal popularity (expected counts)."""

    def __init__(self, table: CountTable):
        self.top_k = table.top_k
        self.marginal = _marginal(table)
        self.assignment = "expected"

    def scores(self, token_ids, positions):
        return np.broadcast_to(self.marginal, (len(token_ids),) + self.marginal.shape).copy()


def _marginal(table: CountTable) -> np.ndarray:
    m = np.zeros((table.num_layers, table.num_experts))
    np.add.at(m, (table.layer, table.expert), table.count)
    return m / np.maximum(m.sum(axis=1, keepdims=True), 1e-300)


class _Grouped:
    """Weighted counts [n keys, L, E] grouped by one integer key column, with a key -> row map."""

    def __init__(self, keys: np.ndarray, table: CountTable, weights: np.ndarray):
        uniq, inv = np.unique(np.asarray(keys, dtype=np.int64), return_inverse=True)
        self.rows = {int(k): n for n, k in enumerate(uniq.tolist())}
        self.counts = np.zeros((len(uniq), table.num_layers, table.num_experts))
        np.add.at(self.counts, (inv, table.layer, table.expert), weights)

    def lookup(self, keys) -> np.ndarray:
        """Row index per key, -1 where unseen."""
        return np.array([self.rows.get(k, -1) for k in np.asarray(keys).tolist()], dtype=np.int64)


class LinaPredictor(_Scorer):
    """Token id only, unweighted counts; unseen tokens fall back to the marginal."""

    def __init__(self, table: CountTable, assignment: str = "map"):
        self.top_k = table.top_k
        self.marginal = _marginal(table)
        self.assignment = assignment
        self.by_token = _Grouped(table.token, table, table.count)

    def scores(self, token_ids, positions):
        idx = self.by_token.lookup(token_ids)
        out = np.where((idx >= 0)[:, None, None], self.by_token.counts[np.maximum(idx, 0)], self.marginal[None])
        return out


@dataclass
class BayesianPredictor(_Scorer):
    """The paper's posterior over the key-value table, made position-aware.

    `position`: "none" integrates positions out (the paper's uniform P'(f2)); "joint" (default)
    conditions on the (token, position bucket) key, backing off to the token, then to the
    marginal; "naive" combines token and position evidence as conditionally independent given
    the expert,
    P(i | f1, f2) ~ P(i | f1) P(i | f2) / P(i), which learns position effects from every token at
    that position instead of only from the same token there. `attention_weighting` applies the
    paper's P'(f3) factor (counts weighted by the attention id's token frequency); it is off by
    default because it biases the posterior towards frequent attention targets and measured
    worse on held-out batches (synthetic and TinyMoE traces; see benchmarks/serverless.py).
    Defaults: expected-load assignment, which measured far better than MAP counting (MAP sends
    every occurrence of a frequent token to the same k experts).
    """

    table: CountTable
    position: str = "joint"
    position_bucket: int = 8
    prior: float = 1.0
    attention_weighting: bool = False
    assignment: str = "expected"
    top_k: int = field(init=False)
    marginal: np.ndarray = field(init=False)

    def __post_init__(self):
        t = self.table
        if self.position not in ("none", "joint", "naive"):
            raise UserError(f"unknown position mode '{self.position}'; use none, joint or naive")
        self.top_k = t.top_k
        self.marginal = _marginal(t)
        vocab = max(len(t.token_freq), 1)
        if self.attention_weighting:
            # P'(f3) scaled so a uniform vocabulary weighs 1 per count; attention ids absent from
            # the profiled text (or -1, unknown) weigh as an average token
            ids = np.array(sorted(t.token_freq), dtype=np.int64)
            freq = np.array([t.token_freq[i] for i in ids.tolist()])
            pos = np.clip(np.searchsorted(ids, t.attention), 0, len(ids) - 1)
            w = np.where(ids[pos] == t.attention, freq[pos], 1.0 / vocab) * vocab
        else:
            w = np.ones(t.count.size)
        weighted = t.count * w
        self.by_token = _Grouped(t.token, t, weighted)
        self._bucket = max(int(self.position_bucket), 1)
        bucket = t.position // self._bucket
        self.by_pos = _Grouped(bucket, t, weighted)
        self._stride = int(bucket.max()) + 2 if bucket.size else 2
        self.by_joint = _Grouped(t.token * self._stride + bucket, t, weighted) if self.position == "joint" else None

    def _shrink(self, counts, prior_dist):
        """Dirichlet back-off per layer: (counts/k + a * prior) / (tokens + a)."""
        tokens = counts.sum(axis=-1, keepdims=True) / self.top_k
        return (counts / self.top_k + self.prior * prior_dist) / (tokens + self.prior)

    def scores(self, token_ids, positions):
        token_ids = np.asarray(token_ids, dtype=np.int64)
        b = np.asarray(positions, dtype=np.int64) // self._bucket
        idx = self.by_token.lookup(token_ids)
        seen = (idx >= 0)[:, None, None]
        post = np.where(seen, self._shrink(self.by_token.counts[np.maximum(idx, 0)], self.marginal[None]), self.marginal[None])
        if self.position == "joint":
            j = self.by_joint.lookup(token_ids * self._stride + np.minimum(b, self._stride - 1))
            post = np.where((j >= 0)[:, None, None], self._shrink(self.by_joint.counts[np.maximum(j, 0)], post), post)
        elif self.position == "naive":
            pidx = self.by_pos.lookup(b)
            pos_post = self._shrink(self.by_pos.counts[np.maximum(pidx, 0)], self.marginal[None])
            combined = post * pos_post / np.maximum(self.marginal[None], 1e-12)
            combined /= np.maximum(combined.sum(axis=-1, keepdims=True), 1e-300)
            post = np.where((pidx >= 0)[:, None, None], combined, post)
        return post


def _rekey(t: CountTable, token_key: np.ndarray) -> CountTable:
    """The same table with its token column replaced (to group by position or token+position)."""
    return CountTable(np.asarray(token_key), t.position, t.attention, t.layer, t.expert, t.count,
                      t.token_freq, t.num_layers, t.num_experts, t.top_k)


def make_predictor(kind: str, table: CountTable, **options):
    """'bayes' (ours), 'lina' or 'marginal'."""
    if kind == "bayes":
        return BayesianPredictor(table, **options)
    if kind == "lina":
        return LinaPredictor(table, **{k: v for k, v in options.items() if k == "assignment"})
    if kind == "marginal":
        return MarginalPredictor(table)
    raise UserError(f"unknown predictor '{kind}'; use bayes, lina or marginal")
