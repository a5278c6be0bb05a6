"""The planner's eviction model: expected distance to a key's next request, fitted on the trace.

Why: Belady's rule (evict the key needed farthest ahead) is optimal but needs the future. We
estimate that distance from what is known when the eviction happens, with statistics of the
planning trace:

* For key (l, e), tau = the last token that has passed layer l (the current token if l <= the
  current layer, else the previous one). Features at tau: recency bucket (tau - last use, in
  tokens, across sequences), in-sequence frequency bucket (uses / tokens of this sequence so
  far: MoE-Infinity's temporal locality) and global popularity bucket (share x E, log2).
  Per feature cell the trace gives P1 = P(next use at tau + 1) and M2 = E[gap | gap >= 2]
  (gaps capped at `HORIZON` tokens), shrunk towards coarser cells when a cell is rare.
* For the next layer of the current token (l = lc + 1), P1 is sharpened by the token's own
  routing at lc (inter-layer affinity): P(e at lc+1 | token's experts at lc) from the trace
  (stored as each row's `AFFINITY_TOP` largest entries, the rest spread evenly), combined with
  the feature estimate in log-odds against the popularity prior. Layers further ahead use the
  features alone (cost: one E x E table per layer, also at Qwen3-30B-A3B's 48 x 128 experts).
* E[gap] = P1 + (1 - P1) M2 tokens; distance in layer steps = L (E[gap] - 1) + (l - lc) for
  l > lc, and L E[gap] + (l - lc) otherwise. Keys still to be requested in the current step: 0.

Shapes: L layers, E experts, N = L E keys, T tokens.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

HORIZON = 512
RECENCY_EDGES = np.array([1, 2, 3, 5, 9, 17, 33, 65])  # bucket b: edges[b-1] <= r < edges[b]; last = never
FREQ_EDGES = np.array([0.05, 0.1, 0.2, 0.4])
N_REC, N_FREQ, N_POP = len(RECENCY_EDGES) + 2, len(FREQ_EDGES) + 2, 7
SHRINK = 10.0  # pseudo-observations towards the coarser cell
MAX_FIT_TOKENS = 20000
AFFINITY_TOP = 16
PRIOR_TOKENS = 1000.0
SCALE_CLIP = 4.0


def recency_bucket(recency: np.ndarray) -> np.ndarray:
    """Bucket of tokens since last use (recency < 0 = never used) -> [0, N_REC)."""
    b = np.searchsorted(RECENCY_EDGES, recency, side="right")
    return np.where(recency < 0, N_REC - 1, b)


def freq_bucket(count: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """Bucket of in-sequence use share: 0 = unused in this sequence, then by share."""
    share = count / np.maximum(tokens, 1)
    return np.where(count <= 0, 0, 1 + np.searchsorted(FREQ_EDGES, share, side="left"))


def pop_bucket(popularity: np.ndarray, num_experts: int) -> np.ndarray:
    """Bucket of share x E on a log2 scale, clipped to [-3, 3] -> [0, 7)."""
    rel = np.log2(np.maximum(popularity * num_experts, 1e-9))
    return np.clip(np.rint(rel), -3, 3).astype(np.int64) + 3


def _cells(rb, fb, pb):
    return (rb * N_FREQ + fb) * N_POP + pb


@dataclass
class NextUseModel:
    """Fitted tables (float64): p1/m2 [N_REC, N_FREQ, N_POP]; affinity [L, E, E] (P(e at lc+1 | e'
    at lc); the last layer's row is unused); popularity [L, E]; prior [L, E] = P(a token uses e at l)."""

    p1: np.ndarray
    m2: np.ndarray
    affinity: np.ndarray
    popularity: np.ndarray
    prior: np.ndarray
    mean_k: float  # requests per step in the fitted stream
    mix: float = 0.0  # weight of the frequency distance (see NextUseState), chosen by the planner

    def to_dict(self) -> dict:
        """JSON form; the affinity as per-row top entries: {"top": [L][E][m] expert ids,
        "p": [L][E][m] probabilities, "rest": [L][E] probability of each other expert}."""
        top = np.argsort(-self.affinity, axis=2, kind="stable")[:, :, :AFFINITY_TOP]
        p = np.take_along_axis(self.affinity, top, axis=2)
        E = self.affinity.shape[2]
        rest = (self.affinity.sum(axis=2) - p.sum(axis=2)) / max(E - top.shape[2], 1)
        return {"p1": self.p1.round(6).tolist(), "m2": self.m2.round(4).tolist(),
                "affinity": {"top": top.tolist(), "p": p.round(6).tolist(), "rest": rest.round(6).tolist()},
                "popularity": self.popularity.round(6).tolist(), "mean_k": round(float(self.mean_k), 6),
                "mix": round(float(self.mix), 6)}

    @classmethod
    def from_dict(cls, d: dict) -> NextUseModel:
        top = np.asarray(d["affinity"]["top"], dtype=np.int64)
        p = np.asarray(d["affinity"]["p"], dtype=float)
        E = top.shape[1]
        aff = np.repeat(np.asarray(d["affinity"]["rest"], dtype=float)[:, :, None], E, axis=2)
        np.put_along_axis(aff, top, p, axis=2)
        pop = np.asarray(d["popularity"], dtype=float)
        mean_k = float(d["mean_k"])
        return cls(np.asarray(d["p1"], float), np.asarray(d["m2"], float), aff, pop, _prior(pop, mean_k), mean_k,
                   float(d.get("mix", 0.0)))

    def with_mix(self, mix: float) -> NextUseModel:
        return replace(self, mix=float(mix))

    def round_trip(self) -> NextUseModel:
        """The model as a plan stores it (sparse affinity, rounded): what the runtime will use."""
        return NextUseModel.from_dict(self.to_dict())

    def new_state(self, stream) -> NextUseState:
        return NextUseState(self, stream)


def fit_next_use(stream, popularity: np.ndarray) -> NextUseModel:
    """Fit the tables on a decode stream of the planning trace (its first MAX_FIT_TOKENS tokens)."""
    L, E = stream.num_layers, stream.num_experts
    T = min(stream.num_tokens, MAX_FIT_TOKENS)
    keep = stream.step_token[stream.step] < T
    keys, tok = stream.keys[keep], stream.step_token[stream.step[keep]]
    seq_of_tok = np.zeros(T, dtype=np.int64)
    seq_of_tok[stream.step_token[:T * L]] = stream.step_seq[:T * L]
    seq_start = np.r_[0, np.flatnonzero(np.diff(seq_of_tok)) + 1] if T else np.zeros(0, np.int64)
    start_of_tok = seq_start[np.searchsorted(seq_start, np.arange(T), side="right") - 1] if T else seq_start
    n_in_seq = np.arange(T) - start_of_tok + 1
    cells = N_REC * N_FREQ * N_POP
    n1, s1, n2, s2 = (np.zeros(cells) for _ in range(4))
    pb_all = pop_bucket(popularity, E).reshape(-1)
    order = np.argsort(keys, kind="stable")
    keys_s, tok_s = keys[order], tok[order]
    bounds = np.searchsorted(keys_s, np.arange(L * E + 1))
    taus = np.arange(T)
    for key in range(L * E):
        uses = np.unique(tok_s[bounds[key]:bounds[key + 1]])
        ind = np.zeros(T, dtype=np.int64)
        ind[uses] = 1
        cs = np.cumsum(ind)
        count = cs - (cs[start_of_tok] - ind[start_of_tok])
        i = np.searchsorted(uses, taus, side="right")
        padded = np.r_[-1, uses, T - 1 + HORIZON]  # padded[i] = last use <= tau, padded[i+1] = next
        recency = np.where(i > 0, taus - padded[i], -1)
        nxt = padded[i + 1]
        gap = np.minimum(nxt - taus, HORIZON)
        rb, fb = recency_bucket(recency), freq_bucket(count, n_in_seq)
        c = _cells(rb, fb, pb_all[key])
        one = (gap == 1).astype(float)
        n1 += np.bincount(c, minlength=cells)
        s1 += np.bincount(c, weights=one, minlength=cells)
        two = gap >= 2
        n2 += np.bincount(c[two], minlength=cells)
        s2 += np.bincount(c[two], weights=gap[two].astype(float), minlength=cells)
    shape = (N_REC, N_FREQ, N_POP)
    p1 = _shrunk(s1.reshape(shape), n1.reshape(shape))
    m2 = _shrunk(s2.reshape(shape), n2.reshape(shape), fallback=float(HORIZON))
    mean_k = round(_mean_k(stream), 6)
    prior = _prior(popularity, mean_k)
    affinity = _affinity(stream, T, prior)
    return NextUseModel(p1=p1, m2=m2, affinity=affinity, popularity=popularity, prior=prior, mean_k=mean_k).round_trip()


def _prior(popularity: np.ndarray, mean_k: float) -> np.ndarray:
    return np.clip(popularity * mean_k, 1e-4, 1 - 1e-4)


def _mean_k(stream) -> float:
    steps = stream.num_tokens * stream.num_layers
    return len(stream.keys) / max(steps, 1)


def _shrunk(sums: np.ndarray, counts: np.ndarray, fallback: float = 0.0) -> np.ndarray:
    """Cell means [R, F, P] shrunk towards the (recency, popularity) means, and those towards the
    recency means, then the global mean."""
    g = sums.sum() / counts.sum() if counts.sum() else fallback
    rs, rn = sums.sum(axis=(1, 2)), counts.sum(axis=(1, 2))
    r_mean = (rs + SHRINK * g) / (rn + SHRINK)
    rps, rpn = sums.sum(axis=1), counts.sum(axis=1)
    rp_mean = (rps + SHRINK * r_mean[:, None]) / (rpn + SHRINK)
    return (sums + SHRINK * rp_mean[:, None, :]) / (counts + SHRINK)


def _affinity(stream, T: int, prior: np.ndarray) -> np.ndarray:
    """P(token uses e at lc+1 | it uses e' at lc) [L, E, E], smoothed towards prior[lc+1, e]."""
    L, E = stream.num_layers, stream.num_experts
    keep = stream.step_token[stream.step] < T
    k = stream.keys[keep]
    tok, layer, expert = stream.step_token[stream.step[keep]], k // E, k % E
    by_layer = [(tok[layer == l], expert[layer == l]) for l in range(L)]  # each token's distinct experts per layer
    out = np.repeat(prior[:, None, :], E, axis=1)  # last layer: unused
    for lc in range(L - 1):  # co-occurrence counts by a join on the token (sparse: k x k pairs per token)
        (t0, e0), (t1, e1) = by_layer[lc], by_layer[lc + 1]
        o0, o1 = np.argsort(t0, kind="stable"), np.argsort(t1, kind="stable")
        t0, e0, t1, e1 = t0[o0], e0[o0], t1[o1], e1[o1]
        lo, hi = np.searchsorted(t1, t0, side="left"), np.searchsorted(t1, t0, side="right")
        reps = hi - lo
        first = np.repeat(e0, reps)
        idx = np.repeat(lo - np.r_[0, np.cumsum(reps)[:-1]], reps) + np.arange(reps.sum())
        joint = np.bincount(first * E + e1[idx], minlength=E * E).reshape(E, E).astype(np.float64)
        n = np.bincount(e0, minlength=E).astype(np.float64)
        out[lc] = (joint + SHRINK * prior[lc + 1][None, :]) / (n[:, None] + SHRINK)
    return out


def _logit(p):
    p = np.clip(p, 1e-4, 1 - 1e-4)
    return np.log(p / (1 - p))


class NextUseState:
    """The running state one cache needs to evaluate the model (per stream, updated per request).

    Score = expected distance in steps to the next request (module docstring): higher = evict
    first; keys still to be requested in the current step score -1. With `model.mix` = w > 0 the
    score is (1 - w) x that + w x the distance if uses were independent at the key's use rate
    (L / rate tokens: a Bayesian LFU whose prior is the trace's popularity)."""

    def __init__(self, model: NextUseModel, stream):
        self.m, self.stream = model, stream
        L, E = stream.num_layers, stream.num_experts
        self.L, self.E, self.N = L, E, L * E
        self.last_tok = np.full(L * E, -1, dtype=np.int64)
        self.seq_count = np.zeros(L * E, dtype=np.int64)
        self.pb = pop_bucket(model.popularity, E).reshape(-1)
        self.layer_of = np.repeat(np.arange(L), E)
        self.all_keys = np.arange(L * E)
        self.token = -1
        self.seq = -1
        self.seq_first_tok = 0
        self.layer = 0
        self.cur_experts = np.zeros(0, dtype=np.int64)
        self.prior_logit = _logit(model.prior.reshape(-1))
        self.scores_all = None
        self.stale = []
        self.pending = np.zeros(L * E, dtype=bool)
        self.step_keys = np.zeros(0, dtype=np.int64)
        cells = N_REC * N_FREQ * N_POP
        self.p1f, self.m2f = model.p1.reshape(cells), model.m2.reshape(cells)
        self.rec_lut = recency_bucket(np.arange(RECENCY_EDGES[-1] + 1))
        self.pb_cell = self.pb  # cell = (rb * N_FREQ + fb) * N_POP + pb
        # within a popularity bucket, gaps scale with 1 / (the key's use rate): the rate is the
        # trace's, updated by this stream's own counts (PRIOR_TOKENS pseudo-tokens of the trace)
        self.prior_rate = model.prior.reshape(-1)
        self.centre_rate = 2.0 ** (self.pb - 3) / E * model.mean_k
        self.count_all = np.zeros(L * E)
        self.tokens_seen = 0

    def begin_step(self, s: int, step_keys: np.ndarray) -> None:
        st = self.stream
        tok = int(st.step_token[s])
        if tok != self.token:
            self.tokens_seen += 1
        if st.step_seq[s] != self.seq:
            self.seq = st.step_seq[s]
            self.seq_count[:] = 0
            self.seq_first_tok = tok
        self.token, self.layer = tok, int(st.step_layer[s])
        self.cur_experts = step_keys % self.E
        self.pending[self.step_keys] = False
        self.pending[step_keys] = True
        self.step_keys = step_keys
        self.next_layer_affinity = self.m.affinity[self.layer][self.cur_experts].mean(axis=0) if len(step_keys) else None
        self.scores_all = None
        self.stale = []

    def touch(self, key: int) -> None:
        if self.last_tok[key] != self.token:
            self.seq_count[key] += 1
            self.count_all[key] += 1
        self.last_tok[key] = self.token
        self.pending[key] = False
        if self.scores_all is not None:
            self.stale.append(key)

    def all_scores(self) -> np.ndarray:
        """Scores of every key [N] (cached per step; keys touched since are re-scored)."""
        if self.scores_all is None:
            self.scores_all = self.scores(self.all_keys)
            self.stale = []
        elif self.stale:
            keys = np.asarray(self.stale, dtype=np.int64)
            self.scores_all[keys] = self.scores(keys)
            self.stale = []
        return self.scores_all

    def scores(self, keys: np.ndarray) -> np.ndarray:
        """Eviction score of each key [M] (float [M]; see class docstring)."""
        m, L = self.m, self.L
        lc, t = self.layer, self.token
        lk = self.layer_of[keys]
        later = lk > lc
        tau = t - later
        last = self.last_tok[keys]
        # last <= tau: later layers have not run yet for this token
        rb = np.where(last >= 0, self.rec_lut[np.minimum(tau - last, RECENCY_EDGES[-1])], N_REC - 1)
        fb = freq_bucket(self.seq_count[keys], tau - self.seq_first_tok + 1)
        cell = (rb * N_FREQ + fb) * N_POP + self.pb_cell[keys]
        p1 = self.p1f[cell]
        if self.next_layer_affinity is not None and lc + 1 < L:
            nxt = lk == lc + 1
            if nxt.any():
                z = _logit(p1[nxt]) + _logit(self.next_layer_affinity[keys[nxt] % self.E]) - self.prior_logit[keys[nxt]]
                p1[nxt] = 1.0 / (1.0 + np.exp(-z))
        rate = (self.count_all[keys] + PRIOR_TOKENS * self.prior_rate[keys]) / (self.tokens_seen + PRIOR_TOKENS)
        m2 = self.m2f[cell] * np.clip(self.centre_rate[keys] / rate, 1.0 / SCALE_CLIP, SCALE_CLIP)
        score = L * (p1 + (1.0 - p1) * m2 - later) + (lk - lc)
        if m.mix:
            frequency = L * (1.0 / np.maximum(rate, 1e-9) - later) + (lk - lc)
            score = (1.0 - m.mix) * score + m.mix * frequency
        score[self.pending[keys]] = -1.0
        return score
