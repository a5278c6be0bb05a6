"""The request cost spec of a Lambda plan: what the request cost model (runtime/lambda_/request_cost.py) needs to price one generation.

Why at plan time: the dense parts' compute at any step size comes from the profile's predictors
(the partition pass evaluates them on `REQUEST_GRID`), the experts' from the serverless facts; the
spec freezes them with the plan's decisions (slices, memory, replicas, methods, shares) so that
`moeplan simulate` and the deployed front function (which has neither the profile nor moeplan)
price the same request identically. Parts are listed in state-machine order (segment by segment,
slices in chain order), as the functions run them (backends/lambda_/codegen.py dense_parts).
"""
from __future__ import annotations

from moeplan.runtime.lambda_.request_cost import SPEC_VERSION
from moeplan.passes.optimize.serverless import billing as sc

REQUEST_GRID = (1, 8, 64, 512, 2048)
KV_BYTES_PER_ELEMENT = 4  # the functions run and keep float32


def kv_bytes_per_layer_token(config, ir) -> int:
    """K/V bytes one token adds to one attention layer's cache, in the functions' float32."""
    from moeplan.passes.optimize.offload.cache_plan import kv_bytes_per_token
    from moeplan.core.ir import dtype_bytes

    layers = sum(1 for s in ir.stages if getattr(s, "kind", "") == "attention") or len(ir.moe_stages)
    return int(kv_bytes_per_token(config, ir) // layers // dtype_bytes(ir.dtype) * KV_BYTES_PER_ELEMENT)


def request_spec(facts: sc.ServerlessFacts, layers: list, slices: list, grid_units: dict, attention_units: set,
                 kv_per_layer_token: int, front_memory_mb: int, http_request_price: float = 0.0) -> dict:
    """The spec. `layers`: LayerDecision per MoE layer; `slices`: the partition's SliceReports;
    `grid_units`: {tokens: dense units} at REQUEST_GRID (grouped as the slices were);
    `attention_units`: unit names that run an attention layer."""
    p = facts.platform
    grid = sorted(grid_units)
    order = [n for s in slices for n in s.names]
    segment_of = {n: u.segment for u in grid_units[grid[0]] for n in u.names}
    L = len(layers)
    parts = []
    for seg in range(L + 1):
        for k, s in enumerate(slices):
            names = [n for n in s.names if segment_of[n] == seg]
            if not names:
                continue
            first, last = order.index(names[0]), order.index(names[-1])
            starts = first == 0 or segment_of[order[first - 1]] != seg
            ends = last + 1 == len(order) or segment_of[order[last + 1]] != seg
            v = p.vcpus(s.memory_mb)
            units = {T: [u for u in grid_units[T] if u.names[0] in names] for T in grid}
            head, tail = units[grid[0]][0], units[grid[0]][-1]
            parts.append({
                "function": f"Dense{k:02d}", "segment": seg, "memory_mb": int(s.memory_mb), "param_bytes": int(s.param_bytes),
                "seconds": [sum(u.seconds(T, v) for u in units[T]) for T in grid],
                "in_bytes_per_token": int(head.in_bytes_per_token), "out_bytes_per_token": int(tail.out_bytes_per_token),
                "kv_bytes_per_token": kv_per_layer_token * sum(1 for n in names if n in attention_units),
                "reads_state": first > 0, "logits": last + 1 == len(order),
                "gather": seg - 1 if starts and seg > 0 and layers[seg - 1].method != sc.DIRECT else None,
                "scatter": seg if ends and seg < L else None})
    spec_layers = []
    for e, d in enumerate(layers):
        lf = facts.layers[e]
        total = sum(c.tokens for c in d.experts)
        spec_layers.append({
            "method": sc.METHOD_NAMES[d.method], "beta": int(d.beta), "top_k": int(lf.top_k), "d_in": int(lf.d_in),
            "d_out": int(lf.d_out), "param_bytes": int(lf.expert_param_bytes), "tokens_grid": list(lf.tokens_grid),
            "threads": list(lf.threads), "s_per_token": [list(r) for r in lf.expert_s_per_token],
            "mb_per_vcpu": float(lf.mb_per_vcpu), "max_vcpus": float(lf.max_vcpus),
            "experts": [{"memory_mb": int(c.memory_mb), "replicas": int(c.replicas),
                         "share": (c.tokens / total) if total else 1.0 / len(d.experts)} for c in d.experts]})
    keys = ("price_per_gb_s", "price_per_request", "billing_granularity_s", "s3_latency_s", "s3_bandwidth_bytes_per_s",
            "f2f_bandwidth_bytes_per_s", "warm_start_s", "s3_put_price", "s3_get_price", "express_request_price",
            "express_price_per_gb_s", "express_billing_granularity_s", "express_memory_mb")
    return {"version": SPEC_VERSION, "grid": grid, "platform": {k: float(getattr(p, k)) for k in keys},
            "parts": parts, "layers": spec_layers, "http_request_price": float(http_request_price),
            "front": {"memory_mb": int(front_memory_mb), "seconds": float(p.warm_start_s)}}
