"""Synthetic routing traces with planted inter-layer affinity and Zipf-skewed expert popularity.

Why: placement needs traces whose optimum is known in shape (a good placement exists and a
naive one misses it) at any size, including DeepSeek-V3's 58 layers x 256 experts x top-8.

The generative model, per MoE layer l:
- popularity: p_l(e) proportional to rank(e)^-zipf over a random permutation of the experts;
- hidden clusters: the experts are split at random into clusters of `group_size`; every cluster
  at layer l has one preferred successor cluster at l+1 (a random permutation of clusters);
- layer 0: each token draws its K experts without replacement from p_0;
- layer l+1: a token whose heaviest expert at l lies in cluster C draws its K experts without
  replacement from q = affinity * p_{l+1} restricted to succ(C) (renormalised)
  + (1 - affinity) * p_{l+1}. So its heaviest next expert is in succ(C) with probability about
  `affinity` (plus the popularity mass that succ(C) has anyway).
Sampling without replacement draws the K slots in turn by inverse CDF and redraws duplicates
(the same distribution as successive sampling), vectorised over tokens. Choices are
stored in draw order, heaviest first, with gate weights (K - k) / sum(1..K). Tokens are grouped
into sequences of `sequence_length` so traces can be split train/held-out by sequence.
Deterministic for a seed.
"""
from __future__ import annotations


import numpy as np

from moeplan.passes.analysis.trace.format import Trace, make_trace
from moeplan.core.errors import UserError


def default_group_size(num_experts: int, top_k: int) -> int:
    """Clusters of E/16 experts (at least K): small enough that a GPU can host whole clusters."""
    return max(top_k, num_experts // 16, 1)


def synthesize_trace(
    *,
    layers: int,
    experts: int,
    top_k: int,
    tokens: int,
    affinity: float,
    zipf: float,
    seed: int,
    group_size: int | None = None,
    sequence_length: int = 128,
) -> Trace:
    """A `Trace` drawn from the planted model described in the module docstring."""
    _check(layers, experts, top_k, tokens, affinity, zipf, sequence_length)
    group_size = default_group_size(experts, top_k) if group_size is None else int(group_size)
    if group_size < 1 or group_size > experts:
        raise UserError(f"--group-size must be between 1 and the number of experts ({experts}), got {group_size}")
    rng = np.random.default_rng(seed)
    num_clusters = -(-experts // group_size)
    chosen = np.empty((tokens, layers, top_k), dtype=np.int32)
    cluster_of = None
    successor = None
    for layer in range(layers):
        popularity = _zipf_popularity(rng, experts, zipf)
        new_cluster_of = np.empty(experts, dtype=np.int64)
        new_cluster_of[rng.permutation(experts)] = np.arange(experts) // group_size
        if layer == 0:
            rows = np.zeros(tokens, dtype=np.int64)
            probabilities = popularity[None, :]
        else:
            members = new_cluster_of[None, :] == np.arange(num_clusters)[:, None]  # [C, E]
            in_cluster = np.where(members, popularity[None, :], 0.0)
            in_cluster /= in_cluster.sum(axis=1, keepdims=True)
            probabilities = affinity * in_cluster + (1.0 - affinity) * popularity[None, :]
            rows = successor[cluster_of[chosen[:, layer - 1, 0]]]
        chosen[:, layer, :] = _draw_without_replacement(rng, probabilities, rows, top_k)
        cluster_of = new_cluster_of
        successor = rng.permutation(num_clusters)
    gate = np.arange(top_k, 0, -1, dtype=np.float32)
    weights = np.broadcast_to(gate / gate.sum(), chosen.shape).copy()
    index = np.arange(tokens)
    return make_trace(
        chosen, weights, num_experts=experts,
        sequence=index // sequence_length, positions=index % sequence_length,
    )


def _draw_without_replacement(rng, probabilities: np.ndarray, rows: np.ndarray, top_k: int) -> np.ndarray:
    """int [T, K]: for token t, K distinct experts drawn in turn from probabilities[rows[t]]."""
    num_rows, experts = probabilities.shape
    cdf = np.cumsum(probabilities, axis=1)
    cdf /= cdf[:, -1:]
    flat = (cdf + np.arange(num_rows)[:, None]).ravel()  # row r's CDF shifted into [r, r + 1]
    offsets = rows.astype(np.float64)
    out = np.empty((len(rows), top_k), dtype=np.int64)

    def draw(which):
        u = np.minimum(rng.random(len(which)), 1.0 - 1e-12)
        hits = np.searchsorted(flat, offsets[which] + u, side="right")
        return np.minimum(hits - rows[which] * experts, experts - 1)

    for slot in range(top_k):
        pending = np.arange(len(rows))
        for _ in range(10_000):
            out[pending, slot] = draw(pending)
            clash = (out[pending, :slot] == out[pending, slot, None]).any(axis=1)
            pending = pending[clash]
            if not len(pending):
                break
        else:  # support smaller than K: fill with the lowest unused ids so ids stay distinct
            for t in pending:
                used = set(out[t, :slot].tolist())
                out[t, slot] = next(e for e in range(experts) if e not in used)
    return out


def _zipf_popularity(rng: np.random.Generator, experts: int, zipf: float) -> np.ndarray:
    ranks = np.empty(experts)
    ranks[rng.permutation(experts)] = np.arange(1, experts + 1)
    weights = ranks ** -zipf
    return weights / weights.sum()


def _check(layers, experts, top_k, tokens, affinity, zipf, sequence_length):
    if layers < 1:
        raise UserError(f"--layers must be at least 1, got {layers}")
    if experts < 1:
        raise UserError(f"--experts must be at least 1, got {experts}")
    if not 1 <= top_k <= experts:
        raise UserError(f"--k must be between 1 and --experts ({experts}), got {top_k}")
    if tokens < 1:
        raise UserError(f"--tokens must be at least 1, got {tokens}")
    if not 0.0 <= affinity <= 1.0:
        raise UserError(f"--affinity is a probability in [0, 1], got {affinity}")
    if zipf < 0:
        raise UserError(f"--zipf must be >= 0 (0 = uniform popularity), got {zipf}")
    if sequence_length < 1:
        raise UserError(f"sequence length must be at least 1, got {sequence_length}")
