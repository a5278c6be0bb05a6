"""Summary statistics of a routing trace: how evenly experts are loaded, how predictable routing is.

These are the two properties placement trades off: load balance (max/mean tokens per expert) and
inter-layer affinity (how often a token's next expert is the one most tokens from its current
expert go to). The affinity means little without a baseline, so `routing_stats` also reports the
affinity of the same trace with each layer's routing shuffled across tokens: per-layer loads stay
exactly the same, the link between consecutive layers is destroyed. The uniform-router figure is
the affinity that independent, uniformly random top-1 choices would give on this many tokens.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from moeplan.passes.analysis.affinity import top1_affinity
from moeplan.passes.analysis.trace.format import Trace, make_trace
from moeplan.passes.analysis.trace.speculate import speculation_recall

BASELINE_SEED = 0
BASELINE_ROUNDS = 5


@dataclass(frozen=True)
class LayerLoad:
    """Tokens routed to each expert of one MoE layer, counting all k choices of every token."""

    layer: int
    tokens_per_expert: list
    max_over_mean: float  # 0.0 for a layer no token reached
    idle_experts: int


@dataclass(frozen=True)
class RoutingStats:
    num_tokens: int
    num_layers: int
    num_experts: int
    top_k: int
    num_sequences: int  # 0 when the trace has no sequence ids
    loads: list  # [LayerLoad]
    mean_max_over_mean: float
    affinity: list  # per consecutive layer pair (l, l+1)
    mean_affinity: float
    shuffled_affinity: list  # same, with each layer's routing shuffled over tokens
    mean_shuffled_affinity: float
    uniform_affinity: float  # independent uniform top-1 choices, same token count
    speculation_recall: dict | None = None  # {"d": recall} of a trace recorded with --speculate
    speculation_source: str | None = None

    def to_dict(self) -> dict:
        out = asdict(self)
        if self.speculation_recall is None:  # traces without speculation: the same JSON as before
            del out["speculation_recall"], out["speculation_source"]
        return out


def max_over_mean(loads: np.ndarray) -> np.ndarray:
    """float64 [L]: per layer, the busiest expert's load over the mean load (1.0 = perfectly even)."""
    means = loads.mean(axis=1)
    return np.divide(loads.max(axis=1), means, out=np.zeros(len(loads)), where=means > 0)


def shuffled_affinity(trace: Trace, seed: int = BASELINE_SEED, rounds: int = BASELINE_ROUNDS) -> np.ndarray:
    """float64 [L-1]: top-1 affinity after independently permuting each layer's routing over tokens.

    Averaged over `rounds` seeded permutations, so it is deterministic for a given trace.
    """
    rng = np.random.default_rng(seed)
    total = np.zeros(max(trace.num_layers - 1, 0))
    for _ in range(rounds):
        columns = [trace.experts[rng.permutation(trace.num_tokens), layer, :] for layer in range(trace.num_layers)]
        shuffled = make_trace(np.stack(columns, axis=1), num_experts=trace.num_experts)
        total += top1_affinity(shuffled)
    return total / rounds


def uniform_affinity(num_tokens: int, num_experts: int, seed: int = BASELINE_SEED,
                     rounds: int = BASELINE_ROUNDS) -> float:
    """Top-1 affinity of independent uniform routing over `num_tokens` tokens (about 1/E, plus
    the sampling noise that the max over next experts picks up on small traces)."""
    if num_tokens == 0:
        return 0.0
    rng = np.random.default_rng(seed)
    values = []
    for _ in range(rounds):
        experts = rng.integers(0, num_experts, size=(num_tokens, 2, 1))
        values.append(float(top1_affinity(make_trace(experts, num_experts=num_experts))[0]))
    return float(np.mean(values))


def routing_stats(trace: Trace) -> RoutingStats:
    """Every figure `moeplan trace stats` prints, computed from one trace."""
    loads = trace.expert_loads()
    ratios = max_over_mean(loads)
    layer_loads = [
        LayerLoad(layer=l, tokens_per_expert=[int(x) for x in loads[l]], max_over_mean=float(ratios[l]),
                  idle_experts=int((loads[l] == 0).sum()))
        for l in range(trace.num_layers)
    ]
    affinity = top1_affinity(trace)
    shuffled = shuffled_affinity(trace)
    return RoutingStats(
        num_tokens=trace.num_tokens,
        num_layers=trace.num_layers,
        num_experts=trace.num_experts,
        top_k=trace.top_k,
        num_sequences=0 if trace.sequence is None else int(len(np.unique(trace.sequence))),
        loads=layer_loads,
        mean_max_over_mean=float(ratios.mean()) if len(ratios) else 0.0,
        affinity=[float(a) for a in affinity],
        mean_affinity=float(affinity.mean()) if len(affinity) else 0.0,
        shuffled_affinity=[float(a) for a in shuffled],
        mean_shuffled_affinity=float(shuffled.mean()) if len(shuffled) else 0.0,
        uniform_affinity=uniform_affinity(trace.num_tokens, trace.num_experts),
        speculation_recall=None if trace.speculation is None else speculation_recall(trace.experts, trace.speculation),
        speculation_source=trace.speculation_source,
    )
