"""Per-token cost conventions shared by every importer, so torch and ONNX imports agree exactly.

* FLOPs per token: 2 x the weight parameters a token multiplies through (one multiply-add per
  weight). Norms count 4 x hidden; embeddings count 0 (a lookup). Attention counts its
  projections only: score and value products grow with context length and are left to the
  operator profiler, which measures them.
* Activation bytes per token: what the stage hands to the next one, hidden x dtype bytes, except
  the head, which emits vocab logits.
"""
from __future__ import annotations

from moeplan.core.ir import dtype_bytes


def dense_flops_per_token(kind: str, params: int, hidden_size: int) -> int:
    if kind == "embedding":
        return 0
    if kind == "norm":
        return 4 * hidden_size
    return 2 * params


def activation_bytes_per_token(kind: str, hidden_size: int, vocab_size: int, dtype: str) -> int:
    width = vocab_size if kind == "head" else hidden_size
    return int(width * dtype_bytes(dtype))


def moe_flops_per_token(router_params: int, expert_params: int, top_k: int, shared_expert_params: int) -> int:
    return 2 * (router_params + top_k * expert_params + shared_expert_params)
