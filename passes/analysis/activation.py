"""Per-sequence expert activation: EAMs, the EAMC (MoE-Infinity, Sec. 2) and popularity by layer.

Why per sequence: at batch 1 a sequence uses few experts and reuses them (temporal locality);
summed over many sequences these signals vanish. MoE-Infinity records one expert activation
matrix (EAM, L x E token counts) per sequence and keeps a small collection of representative ones
(the EAMC) to match a running sequence against.

* Distance (the paper's Eq. 1): dist(M1, M2) = 1 - (1/L') sum_l cos(M1[l], M2[l]), averaged
  over the L' layers where the (possibly partial) first matrix has run (non-zero rows).
  L2-normalising every row and concatenating gives U with ||U1 - U2||^2 = 2 L dist for full
  matrices, so Euclidean k-means on U minimises the paper's distance.
* EAMC: k-means (k-means++ seeding, seeded Lloyd iterations) on U; per cluster the real EAM
  nearest its centroid. Capacity: the smallest candidate whose held-out recall is within
  `tolerance` of the best (the paper: gains stop near 100).
* Held-out recall: for a held-out sequence, match its EAM over the first half of its tokens; per
  layer the matched entry's top-m experts (m = distinct experts the sequence uses at that layer in
  its second half) are the prediction; recall = share of the second half's activations
  (token-weighted) that fall inside the prediction.

Sequences: in order of first appearance, tokens by position; a trace with no `sequence` array is
cut into consecutive chunks of `DEFAULT_CHUNK` tokens (documented assumption).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moeplan.runtime.offload.eam_match import eam_distance, nearest_entry, row_normalised  # noqa: F401 (re-exported)
from moeplan.passes.analysis.trace.format import Trace

DEFAULT_CHUNK = 128


def sequence_ids(trace: Trace) -> np.ndarray:
    """Sequence id per token row [T]: the trace's, else chunks of `DEFAULT_CHUNK` rows."""
    if trace.sequence is not None:
        return trace.sequence.astype(np.int64)
    return np.arange(trace.num_tokens, dtype=np.int64) // DEFAULT_CHUNK


def stream_order(trace: Trace) -> np.ndarray:
    """Token rows [T] in serving order: sequences by first appearance, then by position
    (trace order where positions are absent or tie)."""
    seq = sequence_ids(trace)
    _, first = np.unique(seq, return_index=True)
    rank_of = np.empty(len(first), dtype=np.int64)
    rank_of[np.argsort(first, kind="stable")] = np.arange(len(first))
    seq_rank = rank_of[np.unique(seq, return_inverse=True)[1].reshape(-1)]
    pos = trace.positions if trace.positions is not None else np.zeros(trace.num_tokens, dtype=np.int64)
    return np.lexsort((np.arange(trace.num_tokens), pos, seq_rank))


def popularity_by_layer(trace: Trace) -> np.ndarray:
    """Share of each layer's expert activations per expert, float [L, E] (rows sum to 1 or 0)."""
    loads = trace.expert_loads().astype(float)
    return loads / np.maximum(loads.sum(axis=1, keepdims=True), 1.0)


def sequence_eams(trace: Trace) -> np.ndarray:
    """One EAM per sequence, int32 [S, L, E], sequences in serving order (every top-k choice counts)."""
    order = stream_order(trace)
    seq = sequence_ids(trace)[order]
    _, first, inverse = np.unique(seq, return_index=True, return_inverse=True)
    rank_of = np.empty(len(first), dtype=np.int64)
    rank_of[np.argsort(first, kind="stable")] = np.arange(len(first))
    s_of_row = rank_of[inverse.reshape(-1)]
    T, L, K = trace.experts.shape
    E = trace.num_experts
    ex = trace.experts[order]
    out = np.zeros((len(first), L, E), dtype=np.int32)
    s_idx = np.repeat(s_of_row, L * K)
    l_idx = np.tile(np.repeat(np.arange(L), K), T)
    e_idx = ex.reshape(-1)
    keep = e_idx >= 0
    np.add.at(out, (s_idx[keep], l_idx[keep], e_idx[keep]), 1)
    return out


def kmeans_eamc(eams: np.ndarray, capacity: int, seed: int = 0, iterations: int = 30) -> np.ndarray:
    """The EAMC: `capacity` real EAMs [P, L, E] (P <= capacity), one nearest each k-means centroid."""
    S = len(eams)
    if S == 0:
        return np.zeros((0,) + eams.shape[1:], dtype=np.int32)
    U = row_normalised(eams).reshape(S, -1)
    k = min(int(capacity), S)
    rng = np.random.default_rng(seed)
    centres = [int(rng.integers(S))]
    d2 = ((U - U[centres[0]]) ** 2).sum(axis=1)
    for _ in range(1, k):  # k-means++ seeding
        total = d2.sum()
        nxt = int(rng.choice(S, p=d2 / total)) if total > 0 else int(rng.integers(S))
        centres.append(nxt)
        d2 = np.minimum(d2, ((U - U[nxt]) ** 2).sum(axis=1))
    C = U[centres].copy()
    assign = None
    for _ in range(iterations):
        dist = (U ** 2).sum(1)[:, None] - 2 * U @ C.T + (C ** 2).sum(1)[None, :]
        new = np.argmin(dist, axis=1)
        if assign is not None and np.array_equal(new, assign):
            break
        assign = new
        for c in range(k):
            members = U[assign == c]
            if len(members):
                C[c] = members.mean(axis=0)
    dist = (U ** 2).sum(1)[:, None] - 2 * U @ C.T + (C ** 2).sum(1)[None, :]
    chosen = sorted({int(np.argmin(np.where(assign == c, dist[:, c], np.inf))) for c in range(k) if (assign == c).any()})
    return np.asarray(eams[chosen], dtype=np.int32)


def split_halves(trace: Trace) -> tuple:
    """Per sequence (serving order), EAMs of its first and second half of tokens: ([S,L,E], [S,L,E])."""
    order = stream_order(trace)
    seq = sequence_ids(trace)[order]
    starts = np.r_[0, np.flatnonzero(np.diff(seq) != 0) + 1]
    ends = np.r_[starts[1:], len(seq)]
    first_rows, second_rows = [], []
    for a, b in zip(starts, ends):
        mid = a + (b - a + 1) // 2
        first_rows.append(order[a:mid])
        second_rows.append(order[mid:b])
    L, E = trace.num_layers, trace.num_experts

    def eam(rows):
        return trace.expert_loads(rows) if len(rows) else np.zeros((L, E), dtype=np.int64)
    return np.stack([eam(r) for r in first_rows]), np.stack([eam(r) for r in second_rows])


def heldout_recall(eamc: np.ndarray, first: np.ndarray, second: np.ndarray) -> float:
    """Token-weighted recall of the matched entries' top experts on the held-out second halves."""
    if len(eamc) == 0:
        return 0.0
    unit = row_normalised(eamc)
    hit = total = 0
    for f, s in zip(first, second):
        entry = eamc[nearest_entry(f, unit)].astype(float)
        for l in range(s.shape[0]):
            m = int((s[l] > 0).sum())
            if m == 0:
                continue
            top = np.argsort(-entry[l], kind="stable")[:m]
            hit += int(s[l, top].sum())
            total += int(s[l].sum())
    return hit / total if total else 0.0


@dataclass(frozen=True)
class EAMCChoice:
    """The chosen EAMC and how its capacity was picked."""

    eamc: np.ndarray       # int32 [P, L, E]
    capacity: int
    recall_by_capacity: dict  # candidate capacity -> held-out recall


def build_eamc(train: Trace, heldout: Trace, candidates=(1, 2, 4, 8, 16, 32, 64, 128, 256), tolerance: float = 0.005,
               seed: int = 0) -> EAMCChoice:
    """k-means EAMC of `train`'s sequences, capacity chosen by held-out recall on `heldout`."""
    eams = sequence_eams(train)
    first, second = split_halves(heldout)
    usable = sorted({min(int(c), len(eams)) for c in candidates if c >= 1})
    recalls, built = {}, {}
    for c in usable:
        built[c] = kmeans_eamc(eams, c, seed=seed)
        recalls[c] = heldout_recall(built[c], first, second)
    best = max(recalls.values()) if recalls else 0.0
    chosen = min(c for c, r in recalls.items() if r >= best - tolerance) if recalls else 0
    eamc = built.get(chosen, np.zeros((0, train.num_layers, train.num_experts), dtype=np.int32))
    return EAMCChoice(eamc=eamc, capacity=chosen, recall_by_capacity=recalls)
