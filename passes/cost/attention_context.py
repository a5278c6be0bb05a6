"""Attention at context in moeplan's own runtime (torchrun bundles): what one decoder block's attention
computes and reads that grows with the tokens each query attends to (issue 38 item 2).

The torchrun cost model (`cost_model.py: predict`) prices a block's attention per token at a short
context (`ModelShape.attention_flops`: projections and norms). What it leaves out grows with context:

* FLOPs: a query at position p (0-based) attends to p + 1 keys: QK^T is 2 x q_heads x qk_dim FLOPs per
  key and PV 2 x q_heads x v_dim (MLA: qk_dim = qk_nope + qk_rope head dims, as transformers' DeepSeek
  attention computes it after decompressing the latent);
* bytes: each step reads every sequence's cached K/V up to its last position, once per sequence (the
  library's attention reads the cache once for all of a step's queries of that sequence), at the
  runtime's cache bytes per token and block (`capacity.runtime_kv_bytes_per_token` over the blocks:
  K and V of the KV heads, or MLA's latent and rotary key, in float32).

`context_cost(ctx, tokens)` gives a rank's extra (FLOPs, bytes) for the (sequence, position) tokens its
attention runs in one step, `context_per_rank` every rank's at once; `cost_model.predict` adds them to
each block's attention compute as FLOPs and bytes read (`ModelShape.attention_context`).
Sliding windows are not modelled here (every layer attends to the whole context: an upper bound on
models with windowed layers); linear-attention layers have no cache to read but are priced the same.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class AttentionContext:
    """Per decoder block: FLOPs per (query, key) pair and KV bytes per cached token (the runtime's float32)."""

    flops_per_key: float
    kv_bytes_per_key: float


def runtime_attention_context(config, ir, kv_dtype: str = "float32") -> AttentionContext:
    """The model's attention at context as the runtime runs it (`config`: the library's config object,
    None for models without one: then heads x head dim = hidden), its KV cache held at `kv_dtype` (the dtype the
    runtime holds the model's dense weights at on the plan's hardware, `runtime/precision.py`)."""
    from moeplan.passes.cost.capacity import runtime_kv_bytes_per_token

    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    get = (lambda name: getattr(text, name, None)) if text is not None else (lambda name: None)
    heads = get("num_attention_heads") or get("num_heads")
    if get("kv_lora_rank"):
        qk_dim = (get("qk_nope_head_dim") or 0) + (get("qk_rope_head_dim") or 0)
        v_dim = get("v_head_dim") or qk_dim
    elif heads:
        qk_dim = v_dim = get("head_dim") or ir.hidden_size // heads
    else:
        heads, qk_dim, v_dim = 1, ir.hidden_size, ir.hidden_size
    blocks = sum(1 for s in ir.stages if getattr(s, "kind", "") == "attention") or len(ir.moe_stages)
    return AttentionContext(flops_per_key=2.0 * heads * (qk_dim + v_dim),
                            kv_bytes_per_key=runtime_kv_bytes_per_token(config, ir, kv_dtype) / blocks)


def context_cost(ctx: AttentionContext, tokens) -> tuple:
    """(FLOPs, bytes read) one block's attention adds at context for `tokens` [(sequence, position)]
    run on one rank in one step (module docstring)."""
    seq = np.array([s for s, _ in tokens], dtype=np.int64)
    pos = np.array([p for _, p in tokens], dtype=np.int64)
    flops, nbytes = context_per_rank(ctx, np.zeros_like(seq), seq, pos, 1)
    return float(flops[0]), float(nbytes[0])


def context_per_rank(ctx: AttentionContext, rank: np.ndarray, seq: np.ndarray, pos: np.ndarray, world: int) -> tuple:
    """(FLOPs, bytes read) float [W] that one block's attention adds at context on each rank, for a step's
    tokens: token i of sequence seq[i] at position pos[i] (0-based) runs its attention on rank rank[i]
    (int [n] each). FLOPs: pos + 1 keys per token; bytes: per (rank, sequence), the cache up to the last
    position of that sequence's tokens on that rank, read once."""
    keys = np.bincount(rank, weights=pos + 1.0, minlength=world)
    span = int(seq.max(initial=0)) + 1
    last = np.full(world * span, -1, dtype=np.int64)
    np.maximum.at(last, rank * span + seq, pos)
    cached = (last + 1).reshape(world, span).sum(axis=1)
    return ctx.flops_per_key * keys, ctx.kv_bytes_per_key * cached
