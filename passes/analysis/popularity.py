"""Expert-popularity prediction: per-expert token loads of a batch from its token ids alone.

Why: serverless functions are sized before serving, so each expert's load must be predicted
from what is known ahead of time - the batch's token ids and positions. Three predictors:

* `BayesianPredictor` (serverless-MoE paper, Sec. III-B): a key-value count table over (token id
  f1, position f2, attention id f3, layer e, expert i). For a token with known f1 the paper's
  posterior reduces, in discrete form, to score_i = sum_{f2,f3} C(f1,f2,f3,e,i) P'(f3), with
  P'(f3) the token-id frequency of f3 in the profiled data. More of a request is known before
  inference than its token ids: each token's position and its preceding token. The predictor
  can condition on the previous token (`context="previous"`, a column the table keeps beside the
  paper's key) and/or the position bucket (`position="joint"`), each level shrunk towards the
  coarser one and finally the layer marginal (Dirichlet back-off with strength `prior`), which
  also covers unseen tokens. `select_options` picks the combination by validation error (which
  feature carries signal differs per model). MAP top-k (the k largest scores) gives each
  token's experts when `assignment="map"`.
* `LinaPredictor`: token id only, unweighted counts, MAP top-k (the baseline to beat).
* `MarginalPredictor`: every token spread by the layer's marginal popularity.
`assignment="map"` counts each token's top-k experts (the paper); `"expected"` adds k times the
posterior instead (smoother loads; the default for ours - see `BayesianPredictor`). Metric: `load_error`, the mean absolute per-expert token-count
difference over held-out batches, layers and experts (the paper's prediction error).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from moeplan.passes.analysis.trace.format import Trace
from moeplan.core.errors import UserError


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
    previous: np.ndarray = None  # context: the previous token of the request (-1: first / unknown)

    @classmethod
    def from_trace(cls, trace: Trace) -> CountTable:
        if trace.token_ids is None:
            raise UserError("popularity prediction needs 'token_ids' in the trace; re-record it with 'moeplan trace'")
        T, L, K = trace.experts.shape
        tok = np.repeat(trace.token_ids.astype(np.int64), L * K)
        pos = np.repeat(_positions(trace), L * K)
        prev = np.repeat(previous_tokens(trace.token_ids, _positions(trace)), L * K)
        att = np.repeat(trace.attention_ids if trace.attention_ids is not None else np.full((T, L), -1), K, axis=1).ravel()
        lay = np.tile(np.repeat(np.arange(L), K), T)
        exp = trace.experts.reshape(-1).astype(np.int64)
        keep = exp >= 0
        cols = np.stack([tok[keep], pos[keep], att[keep], lay[keep], exp[keep], prev[keep]], axis=1)
        uniq, counts = _unique_rows(cols)
        ids, freq = np.unique(trace.token_ids, return_counts=True)
        token_freq = dict(zip(ids.tolist(), (freq / freq.sum()).tolist()))
        return cls(uniq[:, 0], uniq[:, 1], uniq[:, 2], uniq[:, 3], uniq[:, 4], counts.astype(float),
                   token_freq, L, trace.num_experts, K, uniq[:, 5])

    def with_values(self, keys: np.ndarray, values: np.ndarray) -> CountTable:
        """A copy where each key (token, position, attention, layer, expert) has its count set.

        The paper's key has no context column: a set key replaces every row of that key (whatever
        its previous token) by one row with the previous token unknown (-1).
        """
        if len(keys) == 0:
            return self
        keys = np.asarray(keys, dtype=np.int64).reshape(-1, 5)
        own = np.stack([self.token, self.position, self.attention, self.layer, self.expert], axis=1)
        # the last write of a key wins
        rev = keys[::-1]
        new_keys, first = _unique_rows(rev, return_index=True)
        new_vals = np.asarray(values, float)[::-1][first]
        both = np.concatenate([own, new_keys])
        lo, span = both.min(axis=0), both.max(axis=0) - both.min(axis=0) + 1
        drop = np.isin(_pack(own, lo, span), _pack(new_keys, lo, span))
        prev = self.previous if self.previous is not None else np.full(len(own), -1)
        cols = np.concatenate([np.column_stack([own[~drop], prev[~drop]]),
                               np.column_stack([new_keys, np.full(len(new_keys), -1)])])
        counts = np.concatenate([self.count[~drop], new_vals])
        order = np.lexsort(cols.T[::-1])
        cols, counts = cols[order], counts[order]
        return CountTable(cols[:, 0], cols[:, 1], cols[:, 2], cols[:, 3], cols[:, 4], counts,
                          self.token_freq, self.num_layers, self.num_experts, self.top_k, cols[:, 5])


def previous_tokens(token_ids, positions) -> np.ndarray:
    """The previous token of each token's request (-1 at position 0); rows are in request order."""
    token_ids = np.asarray(token_ids, dtype=np.int64)
    prev = np.r_[-1, token_ids[:-1]] if len(token_ids) else token_ids.copy()
    prev[np.asarray(positions) == 0] = -1
    return prev


def _pack(cols, lo, span) -> np.ndarray:
    packed = np.zeros(len(cols), dtype=np.int64)
    for c in range(cols.shape[1]):
        packed = packed * int(span[c]) + (cols[:, c] - lo[c])
    return packed


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

    def scores(self, token_ids, positions, previous) -> np.ndarray:  # [T, L, E] unnormalised
        raise NotImplementedError

    def predict_loads(self, token_ids, positions=None, previous=None) -> np.ndarray:
        """Predicted per-expert token counts [L, E] for a batch of requests' tokens, in order.

        `previous` (each token's preceding token, -1 at a request start) defaults to what the
        order and positions imply.
        """
        token_ids = np.asarray(token_ids, dtype=np.int64)
        positions = np.zeros_like(token_ids) if positions is None else np.asarray(positions, dtype=np.int64)
        previous = previous_tokens(token_ids, positions) if previous is None else np.asarray(previous, dtype=np.int64)
        s = self.scores(token_ids, positions, previous)
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

    def scores(self, token_ids, positions, previous):
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

    def scores(self, token_ids, positions, previous):
        idx = self.by_token.lookup(token_ids)
        out = np.where((idx >= 0)[:, None, None], self.by_token.counts[np.maximum(idx, 0)], self.marginal[None])
        return out


@dataclass
class BayesianPredictor(_Scorer):
    """The paper's posterior over the key-value table, made context- and position-aware.

    `context`: "previous" (default) first refines the token-level posterior with the
    (token, previous token) counts; "none" skips it.

    `position`: "none" (default) integrates positions out (the paper's uniform P'(f2)); "joint"
    conditions on the (token, position bucket) key, backing off to the previous level, then to
    the marginal; "naive" combines token and position evidence as conditionally independent given
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
    context: str = "previous"
    position: str = "none"
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
        if self.context not in ("none", "previous"):
            raise UserError(f"unknown context mode '{self.context}'; use none or previous")
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
        self._vocab = int(max(t.token.max(initial=0), (t.previous.max(initial=0) if t.previous is not None else 0))) + 2
        self.by_prev = None
        if self.context == "previous" and t.previous is not None:
            known = t.previous >= 0
            sub = CountTable(t.token[known], t.position[known], t.attention[known], t.layer[known], t.expert[known],
                             t.count[known], t.token_freq, t.num_layers, t.num_experts, t.top_k, t.previous[known])
            self.by_prev = _Grouped(sub.token * self._vocab + sub.previous, sub, weighted[known])

    def _shrink(self, counts, prior_dist):
        """Dirichlet back-off per layer: (counts/k + a * prior) / (tokens + a)."""
        tokens = counts.sum(axis=-1, keepdims=True) / self.top_k
        return (counts / self.top_k + self.prior * prior_dist) / (tokens + self.prior)

    def scores(self, token_ids, positions, previous):
        token_ids = np.asarray(token_ids, dtype=np.int64)
        b = np.asarray(positions, dtype=np.int64) // self._bucket
        idx = self.by_token.lookup(token_ids)
        seen = (idx >= 0)[:, None, None]
        post = np.where(seen, self._shrink(self.by_token.counts[np.maximum(idx, 0)], self.marginal[None]), self.marginal[None])
        if self.by_prev is not None:
            prev = np.asarray(previous, dtype=np.int64)
            ok = (prev >= 0) & (prev < self._vocab) & (token_ids < self._vocab)
            c = self.by_prev.lookup(np.where(ok, token_ids * self._vocab + prev, -1))
            post = np.where(((c >= 0) & ok)[:, None, None], self._shrink(self.by_prev.counts[np.maximum(c, 0)], post), post)
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


CANDIDATE_OPTIONS = (
    {"context": "previous", "position": "none"},
    {"context": "none", "position": "joint"},
    {"context": "previous", "position": "joint"},
    {"context": "none", "position": "none"},
)


def select_options(table: CountTable, trace: Trace, batches: list, candidates=CANDIDATE_OPTIONS) -> tuple:
    """The candidate options with the lowest load error on validation `batches` [(rows, real loads)].

    Which features carry signal differs per model (TinyMoE routes by context, other models by
    position), so the choice is measured on held-out batches, never on the test data.
    """
    errors = []
    for opts in candidates:
        p = BayesianPredictor(table, **opts)
        preds = []
        for rows, real in batches:
            pred = p.predict_loads(trace.token_ids[rows], None if trace.positions is None else trace.positions[rows])
            # a validation split shorter than a batch has its real loads scaled up: scale alike
            preds.append(pred * (np.sum(real) / max(p.top_k * len(rows), 1)))
        errors.append(load_error(preds, [real for _, real in batches]))
    best = int(np.argmin(errors))
    return dict(candidates[best]), [(dict(c), e) for c, e in zip(candidates, errors)]


def make_predictor(kind: str, table: CountTable, **options):
    """'bayes' (ours), 'lina' or 'marginal'."""
    if kind == "bayes":
        return BayesianPredictor(table, **options)
    if kind == "lina":
        return LinaPredictor(table, **{k: v for k, v in options.items() if k == "assignment"})
    if kind == "marginal":
        return MarginalPredictor(table)
    raise UserError(f"unknown predictor '{kind}'; use bayes, lina or marginal")
