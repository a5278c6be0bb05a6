"""How many expert rows each EP rank computes at one step, under the plan's placement of a real trace.

Why: an engine's MoE layer takes as long as its busiest rank. The measured MoE tables are keyed by
tokens under a named distribution (balanced, or a synthetic power law whose hottest rank was timed);
what sets the pace of a real deployment is the real routing under the real placement, replicas
included. So for a step of B tokens (all attention replicas together) we take windows of B
consecutive tokens of the trace, send every routed slot to a rank by the runtime's replica rule
(`runtime/ep/expert_table.py: ExpertTable.choose`, each token at its home rank: token i of the
window on rank i mod W, as data-parallel attention spreads requests, and back home after every layer
as standard EP combines), count each rank's rows per MoE layer, and turn the busiest rank's rows into
the token count that would give a rank those rows under balanced routing:
x = rows_max x W / top_k. Pricing the measured balanced table at x then prices that rank.
Each layer's price is averaged over the windows (`window_tokens` gives (x, weight) pairs). A step of
at least the trace's tokens (a long prefill chunk over many replicas) sees the whole trace, each rank's
rows scaled by B / tokens (`whole_trace_rows`, computed once per trace and placement by the caller).

A loads-only trace (no per-token routing) gives each rank its expected rows: B x top_k x the share of
its experts' loads (a replica taking an equal part of its expert's), the same for every window.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np

from moeplan.runtime.ep.expert_table import ExpertTable
from moeplan.core.errors import UserError

WINDOWS = 8


@dataclass(frozen=True)
class RankLoad:
    """Per MoE layer: ((x, weight), ...) for its busiest rank, weights summing to 1; and the mean over
    layers and windows of busiest over mean rows (1.0 = balanced)."""

    tokens: tuple
    max_over_mean: float


def balanced(num_layers: int, batch: int) -> RankLoad:
    """Every rank's rows equal: x = B at every layer."""
    return RankLoad(tuple(((max(int(batch), 1), 1.0),) for _ in range(num_layers)), 1.0)


def _starts(num_tokens: int, batch: int, windows: int) -> list:
    """Evenly spaced window starts over the trace (deterministic: same trace, same windows)."""
    last = max(num_tokens - batch, 0)
    return sorted({int(s) for s in np.linspace(0, last, windows)})


def _check(trace, table: ExpertTable) -> None:
    L, E, _ = table.hosts.shape
    if trace.num_layers != L:
        raise UserError(f"the trace has {trace.num_layers} MoE layers and the placement {L}; give the trace the plan "
                        f"was made from")
    if trace.num_experts > E:
        raise UserError(f"the trace routes to {trace.num_experts} experts and the placement places {E}")


def _rows(trace, table: ExpertTable, rows_of: np.ndarray) -> np.ndarray:
    """int [L, W]: rows each rank computes per MoE layer for the trace's tokens `rows_of` [B] (token i of
    them at home rank i mod W)."""
    L, _, W = table.hosts.shape
    experts = np.asarray(trace.experts[rows_of], dtype=np.int64)  # [B, L, K]
    home = np.arange(len(rows_of)) % W
    out = np.zeros((L, W), dtype=np.int64)
    for l in range(L):
        ids = experts[:, l, :]
        valid = ids >= 0
        out[l] = np.bincount(table.choose(l, np.where(valid, ids, 0), home)[valid], minlength=W)
    return out


def whole_trace_rows(trace, table: ExpertTable) -> np.ndarray:
    """int [L, W]: rows each rank computes per MoE layer over every token of the trace."""
    _check(trace, table)
    return _rows(trace, table, np.arange(trace.num_tokens))


def rank_load(trace, table: ExpertTable, batch: int, windows: int = WINDOWS, whole=None) -> RankLoad:
    """The busiest rank's load per MoE layer for steps of `batch` tokens (see the module docstring);
    `whole`: `whole_trace_rows` of this trace and table where the caller keeps it."""
    _check(trace, table)
    L, _, W = table.hosts.shape
    batch = max(int(batch), 1)
    K = trace.top_k
    if trace.loads_only or trace.num_tokens == 0:
        return _from_loads(trace, table, batch)
    if batch >= trace.num_tokens:
        rows = (whole if whole is not None else whole_trace_rows(trace, table)) * (batch / trace.num_tokens)
        busiest = rows.max(axis=1)
        tokens = tuple(((max(round(b * W / K), 1), 1.0),) for b in busiest)
        ratio = busiest / np.maximum(rows.mean(axis=1), 1e-12)
        return RankLoad(tokens, float(ratio.mean()))
    per_layer = [Counter() for _ in range(L)]
    ratios = []
    starts = _starts(trace.num_tokens, batch, windows)
    for start in starts:
        rows = _rows(trace, table, start + np.arange(batch))
        for l in range(L):
            busiest = int(rows[l].max())
            per_layer[l][max(round(busiest * W / K), 1)] += 1
            if rows[l].sum():
                ratios.append(busiest / (rows[l].sum() / W))
    tokens = tuple(tuple((x, n / len(starts)) for x, n in sorted(c.items())) for c in per_layer)
    return RankLoad(tokens, float(np.mean(ratios)) if ratios else 1.0)


def _from_loads(trace, table: ExpertTable, batch: int) -> RankLoad:
    L, E, W = table.hosts.shape
    loads = np.zeros((L, E))
    source = trace.expert_loads()
    loads[:, :source.shape[1]] = source
    share = loads / np.maximum(loads.sum(axis=1, keepdims=True), 1)
    copies = np.maximum(table.hosts.sum(axis=2), 1)
    per_rank = np.einsum("le,lew->lw", share / copies, table.hosts.astype(float)) * batch * trace.top_k  # [L, W]
    busiest = per_rank.max(axis=1)
    tokens = tuple(((max(round(b * W / trace.top_k), 1), 1.0),) for b in busiest)
    ratio = busiest / np.maximum(per_rank.mean(axis=1), 1e-12)
    return RankLoad(tokens, float(ratio.mean()))
