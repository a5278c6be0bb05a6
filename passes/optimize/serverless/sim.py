"""Simulate a serverless MoE plan on real per-expert loads: billed cost, latency, throughput.

Why: a plan is sized for predicted loads; what it costs is decided by the loads that arrive.
Each expert keeps its planned memory and replicas; when the real load breaks a constraint the
runtime does what Alg. 2 of the paper does - invoke more replicas of the same function:
* memory: a replica would need more than its memory -> the fewest replicas that fit;
* payload (direct method): the request or response would exceed the limit -> the fewest
  replicas whose share fits.
Both are reported as overflows. Latency uses the same equations as sizing
(`serverless/billing.py`); cost is that of the MoE layers (the paper's objective) and, separately,
of the non-MoE functions at their fixed memory.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from moeplan.passes.optimize.serverless import billing as sc
from moeplan.runtime.lambda_.charges import billed_gb_seconds, lambda_usd


@dataclass
class SimResult:
    moe_cost: float            # dollars per batch, MoE layers (experts)
    dense_cost: float          # dollars per batch, non-MoE functions
    latency: float             # end-to-end seconds per batch
    tokens: int
    layer_latency: list
    layer_cost: list
    overflows: list = field(default_factory=list)   # (layer, expert, kind, replicas used)

    @property
    def total_cost(self) -> float:
        return self.moe_cost + self.dense_cost

    @property
    def throughput(self) -> float:
        return self.tokens / self.latency if self.latency > 0 else 0.0


def _fit_replicas(p, lf, method, memory_mb, replicas, d) -> tuple:
    """Replicas actually invoked for load d, and why more than planned (None if not)."""
    g, why = replicas, None
    while g < d and float(sc.memory_need_mb(p, lf, math.ceil(d / g))) > memory_mb + 1e-9:
        g += 1
        why = "memory"
    if method == sc.DIRECT:
        while g < d and not bool(sc.payload_ok(p, lf, math.ceil(d / g))):
            g += 1
            why = why or "payload"
    return g, why


def simulate(facts: sc.ServerlessFacts, layers, loads, batch_tokens: int) -> SimResult:
    """Cost and latency of `layers` (LayerDecision per MoE layer) for real loads [L, E]."""
    p = facts.platform
    loads = np.asarray(loads, dtype=np.int64)
    fixed = sc.dense_times(facts, batch_tokens)
    latency = fixed["head"] + fixed["tail"] + sum(fixed["non_moe"])
    moe_cost, lat_rows, cost_rows, overflows = 0.0, [], [], []
    for e, dec in enumerate(layers):
        lf = facts.layers[e]
        cost, contribs = 0.0, []
        for i, ch in enumerate(dec.experts):
            d = int(loads[e, i])
            if d <= 0:
                continue
            g, why = _fit_replicas(p, lf, dec.method, ch.memory_mb, ch.replicas, d)
            if why:
                overflows.append((e, i, why, g))
            r = math.ceil(d / g)
            t = float(sc.replica_time(p, lf, dec.method, ch.memory_mb, r, dec.beta))
            cost += float(sc.expert_cost(p, ch.memory_mb, g, t))
            contribs.append(float(sc.latency_contribution(p, lf, dec.method, t, r)))
        lat = sc.layer_latency(p, lf, dec.method, contribs, float(loads[e].sum()))
        moe_cost += cost
        latency += lat
        lat_rows.append(lat)
        cost_rows.append(cost)
    # non-MoE functions: head, one per layer, tail, all at the dense memory size
    dense_seconds = fixed["head"] + fixed["tail"] + sum(sc.head_time(p, l.dense_param_bytes) + t
                                                        for l, t in zip(facts.layers, fixed["non_moe"]))
    invocations = len(facts.layers) + 2
    dense_cost = lambda_usd(billed_gb_seconds(dense_seconds, p.dense_function_memory_mb, p.billing_granularity_s),
                            invocations, p.price_per_gb_s, p.price_per_request)
    return SimResult(moe_cost, dense_cost, latency, int(batch_tokens), lat_rows, cost_rows, overflows)
