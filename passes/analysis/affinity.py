"""Inter-layer expert affinity (ExFlow Eq. 1): how strongly layer l's expert predicts layer l+1's.

`top1_transition_counts` counts, per consecutive MoE-layer pair, tokens whose heaviest expert is
a at layer l and b at layer l+1. `top1_affinity` is the share of tokens whose next expert is the
most likely one given the current: sum_a max_b c[a, b] / sum c, i.e. the top-1 conditional
transition probability P(b* | a) averaged over source experts weighted by their token counts.
"""
from __future__ import annotations

import numpy as np

from moeplan.passes.analysis.trace_format import Trace


def top1_transition_counts(trace: Trace) -> np.ndarray:
    """int64 [L-1, E, E]: c[l, a, b] = tokens with top-1 expert a at layer l and b at layer l+1."""
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
