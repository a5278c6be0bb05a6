"""Cross-GPU transitions of one placement under two relaxations of the metric's routing.

Why: the reported gap compares the metric's cross-GPU count (`passes/optimize/placement/metrics.py`: a token sits on one
copy of its heaviest expert, chosen by where it came from) with a bound. Every bound in
`bounds/pairwise.py` and `bounds/chain.py` bounds a relaxation instead, so part of the gap is the
relaxation, not the solver. For a placement, in increasing order (each a lower bound of the next):
- `colocation_cross`: a transition a -> b of the counts is local when some GPU hosts a at l and
  b at l+1 (what the LP bounds relax to; a token of a replicated expert may use a different copy
  for each of its choices);
- `free_routing_cross`: each token sits on whichever copy of its heaviest expert keeps most of its
  next-layer choices local (one copy per token);
- the metric's `cross_gpu_transitions` (its routing rule).
Where the co-location count of a good placement is already far below its metric count, no bound
that relaxes to co-location can show a small gap. Every bound here bounds the free-routing count;
all but the per-token caps of `bounds.pairwise.source_token_caps` (which bind only where a token chooses
more experts than a GPU holds) bound the co-location count too.
"""
from __future__ import annotations

import numpy as np

from moeplan.passes.analysis.affinity import heaviest_choice, transition_counts
from moeplan.passes.analysis.trace.format import Trace


def colocation_cross(trace: Trace, hosts: np.ndarray) -> float:
    """Counted transitions (`transition_counts` "current") whose experts share no GPU; hosts bool [L, E, D]."""
    counts = transition_counts(trace, "current")
    h = hosts[:, :trace.num_experts].astype(np.float64)
    shared = np.stack([(h[l] @ h[l + 1].T) > 0 for l in range(len(counts))]) if len(counts) else counts > 0
    return float((counts * ~shared).sum())


def free_routing_cross(trace: Trace, hosts: np.ndarray) -> float:
    """Counted transitions not local when every token picks its best copy (one per token and layer)."""
    heaviest = heaviest_choice(trace)
    experts = trace.experts.astype(np.int64)
    cross = 0
    for l in range(trace.num_layers - 1):
        source = heaviest[:, l]
        choices = experts[:, l + 1, :]
        valid = (choices >= 0) & (source >= 0)[:, None]
        hit = (hosts[l + 1][np.where(valid, choices, 0)] & valid[:, :, None]).sum(axis=1)  # [T, D]
        on_copy = hosts[l][np.where(source >= 0, source, 0)]  # [T, D]
        best = np.where(on_copy, hit, 0).max(axis=1)
        cross += int(valid.sum() - best.sum())
    return float(cross)
