"""Attention for grouped-query models that reads the KV cache in place: the query heads sharing a
K/V head are stacked as rows of one product with it, instead of repeating every K/V head for them.

Why: transformers' eager attention (each modeling file's `eager_attention_forward`) first runs
`repeat_kv` (expand + reshape: a copy of the layer's whole cache, keys and values, at every step).
On the runtime's CPU decode step (qwen3_moe_hd32, 4 layers, 1 rank, batch 64, cProfile) those copies
were 4.7 of 12.5 ms; grouped, the same step measured 9.5-12.5 ms against eager's 11.2-16.2 (noisy
CPU, 4 runs each). The arithmetic is the eager function's own: the same dot products, scaling, mask,
float32 softmax and weighted sums, row by row; only the tensors' layout differs. transformers' own
`sdpa` was measured slower on this CPU with the runtime's padded masks (docs/models.md).

It is registered in transformers' `AttentionInterface` (with the eager mask builder), the library's
hook for attention kernels; the attention modules, projections, rotary and cache stay the library's.
A module whose own eager function is not the library's standard one (same bytecode as Mixtral's:
gpt-oss adds attention sinks, Llama-4 takes its softmax at the input dtype) or a module in training
(dropout) runs its own modeling file's eager function unchanged.

Shapes: query [B, H, Q, d], key [B, G, W, d], value [B, G, W, dv], H = G x n (n query heads per
K/V head, query head h reads K/V head h // n, as `repeat_kv` lays them out); mask additive
[B or 1, 1, Q, W]; out [B, Q, H, dv].
"""
from __future__ import annotations

import functools
import sys

import torch

NAME = "moeplan_grouped"


def register() -> str:
    """Register the kernel and its mask builder under NAME in transformers; returns NAME."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(NAME, grouped_attention)
    AttentionMaskInterface.register(NAME, eager_mask)
    return NAME


def _code(fn) -> tuple:
    c = fn.__code__
    return c.co_code, c.co_consts, c.co_names, c.co_varnames


@functools.cache
def _standard() -> tuple:
    from transformers.models.mixtral.modeling_mixtral import eager_attention_forward

    return _code(eager_attention_forward)


@functools.cache
def own_eager(module_class: type):
    """(the modeling file's eager function or None, whether it is the library's standard one)."""
    own = getattr(sys.modules.get(module_class.__module__), "eager_attention_forward", None)
    return own, own is not None and _code(own) == _standard()


def grouped_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """transformers' attention-function signature; returns (out [B, Q, H, dv], weights [B, H, Q, W])."""
    own, standard = own_eager(type(module))
    if not standard or module.training:  # dropout in training: the library's own
        if own is None:
            raise RuntimeError(f"{type(module).__name__} has no eager attention function to fall back on")
        return own(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    b, h, q, _ = query.shape
    g, w = key.shape[1], key.shape[2]
    n = h // g
    scores = torch.matmul(query.reshape(b, g, n * q, -1), key.transpose(2, 3)) * scaling  # [B, G, n*Q, W]
    if attention_mask is not None:
        scores = (scores.view(b, g, n, q, w) + attention_mask[:, :, None]).view(b, g, n * q, w)
    weights = torch.nn.functional.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    out = torch.matmul(weights, value)  # [B, G, n*Q, dv]
    return out.view(b, h, q, -1).transpose(1, 2).contiguous(), weights.view(b, h, q, w)
