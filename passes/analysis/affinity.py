"""Inter-layer expert affinity (ExFlow Eq. 1): how strongly layer l's expert predicts layer l+1's.

`top1_transition_counts` counts, per consecutive MoE-layer pair, tokens whose heaviest expert is
a at layer l and b at layer l+1. `top1_affinity` is the share of tokens whose next expert is the
most likely one given the current: sum_a max_b c[a, b] / sum c, i.e. the top-1 conditional
transition probability P(b* | a) averaged over source experts weighted by their token counts.
"""
from __future__ import annotations

import numpy as np

from moeplan.passes.analysis.trace.format import Trace, require_routing


def top1_transition_counts(trace: Trace) -> np.ndarray:
    """int64 [L-1, E, E]: c[l, a, b] = tokens with top-1 expert a at layer l and b at layer l+1."""
    require_routing(trace, "inter-layer affinity")
    E, L = trace.num_experts, trace.num_layers
    top1 = trace.experts[:, :, 0].astype(np.int64)
    counts = np.zeros((max(L - 1, 0), E, E), dtype=np.int64)
    for layer in range(L - 1):
        a, b = top1[:, layer], top1[:, layer + 1]
        valid = (a >= 0) & (b >= 0)
        counts[layer] = np.bincount(a[valid] * E + b[valid], minlength=E * E).reshape(E, E)
    return counts


def top1_affinity(trace: Trace) -> np.ndarray:
    """float64 [L-1]: per layer pair, the top-1 conditional transition probability (see module)."""
    counts = top1_transition_counts(trace)
    totals = counts.sum(axis=(1, 2))
    best = counts.max(axis=2).sum(axis=1)
    return np.divide(best, totals, out=np.zeros(len(totals)), where=totals > 0)


# --- Top-k transition counts and conditional probabilities (ExFlow Eq. 1 generalised) -------
#
# With top-k routing a token at layer l holds K choices and at l+1 another K. Two countings:
#
# - "current" (the default, what placement optimises): after layer l a token sits on the device
#   of its heaviest expert (the ARCHITECTURE's *current device*) and must reach each of its K
#   experts at l+1. So each token adds 1 to c[l, heaviest(l), b] for every valid choice b at l+1:
#   K counts per token and layer pair. Locality of these counts is exactly what the placement
#   metrics `gpu_local_fraction` / `node_local_fraction` measure (for placements without replicas).
# - "pairs": every (choice a at l, choice b at l+1) pair counts 1/K, so a token still adds K in
#   total and c[l, a, :] spreads over all K sources. Useful as an affinity statistic that does not
#   depend on which expert is the heaviest.
#
# With K = 1 both reduce to `top1_transition_counts`. The conditional probability
# P(b at l+1 | a at l) = c[l, a, b] / sum_b' c[l, a, b'] (0 for a source that never occurs).

TRANSITION_MODES = ("current", "pairs")


def heaviest_choice(trace: Trace) -> np.ndarray:
    """int64 [T, L]: each token's highest-weight valid expert per layer (-1 if it has none).

    Ties go to the earlier choice, so traces with the default equal weights use choice 0.
    """
    weights = np.where(trace.experts >= 0, trace.weights, -np.inf)
    best = np.argmax(weights, axis=2)
    chosen = np.take_along_axis(trace.experts, best[:, :, None], axis=2)[:, :, 0].astype(np.int64)
    return np.where(np.isfinite(np.max(weights, axis=2)), chosen, -1)


def transition_counts(trace: Trace, mode: str = "current") -> np.ndarray:
    """float64 [L-1, E, E]: c[l, a, b], transitions from expert a at layer l to b at l+1 (see above)."""
    if mode not in TRANSITION_MODES:
        raise ValueError(f"mode must be one of {TRANSITION_MODES}, got {mode!r}")
    require_routing(trace, "affinity-aware placement (--policy ilp) and expert transition counts")
    E, L, K = trace.num_experts, trace.num_layers, trace.top_k
    counts = np.zeros((max(L - 1, 0), E, E), dtype=np.float64)
    experts = trace.experts.astype(np.int64)
    if mode == "current":
        sources = heaviest_choice(trace)[:, :, None]  # [T, L, 1]
        weight = 1.0
    else:
        sources = experts  # [T, L, K]
        weight = 1.0 / K
    for layer in range(L - 1):
        a = sources[:, layer, :, None]  # [T, S, 1]
        b = experts[:, layer + 1, None, :]  # [T, 1, K]
        a, b = np.broadcast_arrays(a, b)
        valid = (a >= 0) & (b >= 0)
        flat = a[valid] * E + b[valid]
        counts[layer] = np.bincount(flat, minlength=E * E).reshape(E, E) * weight
    return counts
