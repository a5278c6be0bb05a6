"""Billed time, cost and latency of MoE expert functions: Eqs. 3-11 of the serverless-MoE paper.

Why one module: the sizing MILP enumerates these numbers for every candidate (memory, replicas)
pair and the simulator evaluates them on real loads; both must use the same formulas.

Reconstructions where the paper (Liu, Wang, Wu, "Optimizing Distributed Deployment of MoE Model
Inference in Serverless Computing") is ambiguous or wrong:
* tokens per replica r = ceil(d / g) (the paper writes d / g);
* pipelined S3 (method 1): beta is the minibatch size, b = min(beta, r):
  t_rep = T_h + [T_dl + b D_o/B_s] + ceil(r/b) [T_dl + b max(D_in/B_s + U(b), D_o/B_s)];
* non-pipelined S3 (method 2): t_rep = T_h + 2 T_dl + r ((D_in + D_o)/B_s + U(r));
* direct invocation (method 3): t_rep = T_h + r (D_o/B_f + U(r)); allowed only when both the
  request r D_in and the response r D_o fit the payload limit (the paper's form is inverted);
* layer latency, S3 methods: max(max_i t_rep_i, T_load) + t_S3 with t_S3 = T_dl + sum_i d_i D_o / B_s
  (the next layer downloads every output); direct: max_i (r_i D_in/B_f + t_rep_i) + T_load;
* cost of an expert = g x (billed duration x GB x price + request fee), by the one billing rule
  (runtime/lambda_/charges.py); experts with no token are not invoked (s = 0) and cost nothing;
* memory fit: runtime + P + M_fixed + r (M_token + D_in + D_o) <= memory option.
`U(n)` is the per-token compute time at the function's vCPU share for a batch of n tokens,
interpolated from the profile's grid.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from moeplan.core.platforms import Platform, platform_from_dict
from moeplan.runtime.lambda_.charges import invocation_usd

PIPELINED_S3, S3, DIRECT = 1, 2, 3
METHOD_NAMES = {PIPELINED_S3: "pipelined_s3", S3: "s3", DIRECT: "direct"}
METHOD_IDS = {v: k for k, v in METHOD_NAMES.items()}
MB = 1024 * 1024


@dataclass(frozen=True)
class LayerFacts:
    """What sizing needs about one MoE layer; experts of a layer share one shape."""

    num_experts: int
    top_k: int
    expert_param_bytes: int
    expert_fixed_bytes: float      # intermediate memory independent of tokens
    expert_token_bytes: float      # intermediate memory per token
    d_in: int                      # bytes per token into an expert
    d_out: int                     # bytes per token out of an expert
    dense_param_bytes: int         # the non-MoE function before this layer (attention + gate)
    tokens_grid: tuple             # token counts of the compute grid
    threads: tuple                 # thread counts profiled
    expert_s_per_token: tuple      # [threads][grid] seconds per token on this machine
    dense_s_per_token: tuple       # [grid] seconds per token of the non-MoE function (at its memory)
    mb_per_vcpu: float = 1769.0
    max_vcpus: float = 6.0

    def u(self, memory_mb, tokens):
        """Per-token expert compute time at memory size(s) for batch(es) of `tokens`.

        vCPU share v = memory / mb_per_vcpu; with t threads the time is time_t * max(1, t / v)
        (below one vCPU a function gets a slice of one core); the best thread count wins.
        """
        grid = np.log(np.asarray(self.tokens_grid, dtype=float))
        x = np.log(np.maximum(np.asarray(tokens, dtype=float), 1.0))
        v = np.minimum(np.asarray(memory_mb, dtype=float) / self.mb_per_vcpu, self.max_vcpus)
        best = None
        for t, row in zip(self.threads, self.expert_s_per_token):
            per = np.interp(x, grid, np.asarray(row, dtype=float)) * np.maximum(1.0, t / v)
            best = per if best is None else np.minimum(best, per)
        return best

    def dense_time(self, tokens: float) -> float:
        grid = np.log(np.asarray(self.tokens_grid, dtype=float))
        per = float(np.interp(math.log(max(tokens, 1.0)), grid, np.asarray(self.dense_s_per_token)))
        return per * tokens


@dataclass(frozen=True)
class ServerlessFacts:
    """The platform plus per-layer facts and the fixed non-MoE times; JSON round-trips."""

    platform: Platform
    layers: tuple
    head_param_bytes: int = 0
    head_s_per_token: float = 0.0      # embedding (before the first non-MoE function)
    tail_s_per_token: float = 0.0      # final norm + LM head
    tail_param_bytes: int = 0

    def to_dict(self) -> dict:
        return {
            "platform": self.platform.to_dict(),
            "layers": [asdict(l) for l in self.layers],
            "head_param_bytes": self.head_param_bytes,
            "head_s_per_token": self.head_s_per_token,
            "tail_s_per_token": self.tail_s_per_token,
            "tail_param_bytes": self.tail_param_bytes,
        }

    @classmethod
    def from_dict(cls, d: dict) -> ServerlessFacts:
        layers = []
        for raw in d["layers"]:
            raw = dict(raw)
            raw["tokens_grid"] = tuple(raw["tokens_grid"])
            raw["threads"] = tuple(raw["threads"])
            raw["expert_s_per_token"] = tuple(tuple(r) for r in raw["expert_s_per_token"])
            raw["dense_s_per_token"] = tuple(raw["dense_s_per_token"])
            layers.append(LayerFacts(**raw))
        return cls(platform=platform_from_dict(d["platform"]), layers=tuple(layers),
                   head_param_bytes=d["head_param_bytes"], head_s_per_token=d["head_s_per_token"],
                   tail_s_per_token=d["tail_s_per_token"], tail_param_bytes=d["tail_param_bytes"])


def head_time(p: Platform, param_bytes: float) -> float:
    """T^h: load parameters from S3, one S3 round trip, warm start."""
    return param_bytes / p.s3_bandwidth_bytes_per_s + p.s3_latency_s + p.warm_start_s


def memory_need_mb(p: Platform, layer: LayerFacts, tokens_per_replica):
    """Memory one replica needs for r tokens (runtime + weights + intermediates + in/out tokens)."""
    r = np.asarray(tokens_per_replica, dtype=float)
    body = layer.expert_param_bytes + layer.expert_fixed_bytes + r * (layer.expert_token_bytes + layer.d_in + layer.d_out)
    return p.runtime_memory_mb + body / MB


def replica_time(p: Platform, layer: LayerFacts, method: int, memory_mb, r, beta: int = 0):
    """t^rep: seconds one replica runs for r tokens under `method` (vectorised over memory, r)."""
    r = np.asarray(r, dtype=float)
    th = head_time(p, layer.expert_param_bytes)
    bs, bf, dl = p.s3_bandwidth_bytes_per_s, p.f2f_bandwidth_bytes_per_s, p.s3_latency_s
    if method == PIPELINED_S3:
        b = np.maximum(np.minimum(float(beta), r), 1.0)
        steps = np.ceil(r / b)
        u = layer.u(memory_mb, b)
        step = dl + b * np.maximum(layer.d_in / bs + u, layer.d_out / bs)
        return th + dl + b * layer.d_out / bs + steps * step
    u = layer.u(memory_mb, r)
    if method == S3:
        return th + 2 * dl + r * ((layer.d_in + layer.d_out) / bs + u)
    if method == DIRECT:
        return th + r * (layer.d_out / bf + u)
    raise ValueError(f"unknown method {method}")


def latency_contribution(p: Platform, layer: LayerFacts, method: int, t_rep, r):
    """The per-expert term whose max over experts sets the layer latency."""
    if method == DIRECT:
        return np.asarray(t_rep) + np.asarray(r, dtype=float) * layer.d_in / p.f2f_bandwidth_bytes_per_s
    return np.asarray(t_rep)


def dense_load_time(p: Platform, layer: LayerFacts) -> float:
    """T^load_e: start-up of the non-MoE function after layer e (overlaps the experts for S3)."""
    return head_time(p, layer.dense_param_bytes)


def layer_constant(p: Platform, layer: LayerFacts, method: int, total_tokens: float) -> float:
    """Latency added after the slowest expert: t_S3 for the S3 methods, T_load for direct."""
    if method == DIRECT:
        return dense_load_time(p, layer)
    return p.s3_latency_s + total_tokens * layer.d_out / p.s3_bandwidth_bytes_per_s


def layer_latency(p: Platform, layer: LayerFacts, method: int, contributions, total_tokens: float) -> float:
    """Latency of a whole MoE layer from its experts' latency contributions."""
    slowest = float(np.max(contributions)) if len(contributions) else 0.0
    if method != DIRECT:
        slowest = max(slowest, dense_load_time(p, layer))
    return slowest + layer_constant(p, layer, method, total_tokens)


def payload_ok(p: Platform, layer: LayerFacts, r) -> np.ndarray:
    """Direct invocation: request and response for r tokens fit the payload limit."""
    r = np.asarray(r, dtype=float)
    return r * max(layer.d_in, layer.d_out) <= p.payload_limit_bytes


def expert_cost(p: Platform, mem_mb, replicas, t_rep):
    """Dollars for all replicas of an expert (billed duration x GB x price + request fees: charges.py)."""
    one = invocation_usd(np.asarray(t_rep, dtype=float), np.asarray(mem_mb), p.billing_granularity_s, p.price_per_gb_s,
                         p.price_per_request)
    return np.asarray(replicas) * one


def dense_times(facts: ServerlessFacts, tokens: float) -> dict:
    """Fixed end-to-end terms for a batch of `tokens`.

    T_head: start the embedding function and the first non-MoE function, embed the batch;
    T_tail: final norm + LM head (its start-up overlaps the last MoE layer, as T_load);
    T_NE_e: compute of the non-MoE function (attention + gate) before MoE layer e; its start-up
    is the previous layer's T_load (stacked blocks share one shape).
    """
    p = facts.platform
    first = facts.layers[0].dense_param_bytes if facts.layers else 0
    t_head = head_time(p, facts.head_param_bytes + first) + facts.head_s_per_token * tokens
    t_tail = facts.tail_s_per_token * tokens
    t_ne = [l.dense_time(tokens) for l in facts.layers]
    return {"head": t_head, "tail": t_tail, "non_moe": t_ne}
