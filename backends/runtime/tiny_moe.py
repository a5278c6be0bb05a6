"""TinyMoE's math written against its weights, split where expert parallelism cuts the model.

The runtime never builds the whole `nn.Module`: a rank holds the dense weights and only its
experts. These functions reproduce `examples/tiny_moe/model.py` operation by operation (same
norms, projections, softmax router with renormalised top-k, SwiGLU experts), keyed by that
model's state-dict names, which is also how the bundle's shards name tensors.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F


class TinyMoEArch:
    """The pieces the expert-parallel engine calls, for one rank's weights."""

    def __init__(self, config: dict, weights: dict):
        self.w = weights
        self.hidden = int(config["hidden_size"])
        self.num_heads = int(config["num_heads"])
        self.num_kv_heads = self.num_heads
        self.head_dim = self.hidden // self.num_heads
        self.num_layers = int(config["num_layers"])
        self.num_experts = int(config["num_experts"])
        self.top_k = int(config["top_k"])
        self.shared_experts = int(config.get("shared_experts", 0))
        self.max_positions = int(config["max_positions"])
        self.eps = float(config["norm_eps"])
        self.attention_scale = 1.0 / math.sqrt(self.head_dim)

    def _norm(self, x, name):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.w[name]

    def embed(self, token_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.w["embed.weight"][token_ids] + self.w["pos_embed.weight"][positions]

    def attention_input(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """The normed hidden state that queries, keys and values are projected from."""
        return self._norm(x, f"blocks.{layer}.attn_norm.weight")

    def moe_index(self, layer: int):
        """Every TinyMoE block is an MoE block."""
        return layer

    def dense_mlp(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        raise AssertionError("TinyMoE has no dense feed-forward blocks")

    def qkv(self, layer: int, h: torch.Tensor, positions: torch.Tensor) -> tuple:
        """q, k, v as [n, heads, head_dim] each (learned positions: nothing to rotate)."""
        out = F.linear(h, self.w[f"blocks.{layer}.attn.qkv.weight"]).view(-1, 3, self.num_heads, self.head_dim)
        return out[:, 0], out[:, 1], out[:, 2]

    def attention_output(self, layer: int, y: torch.Tensor) -> torch.Tensor:
        return F.linear(y.reshape(-1, self.hidden), self.w[f"blocks.{layer}.attn.out.weight"])

    def route(self, layer: int, x: torch.Tensor) -> tuple:
        """Top-k expert ids (heaviest first) and renormalised weights, as `MoELayer.route`."""
        g = self._norm(x, f"blocks.{layer}.moe_norm.weight")
        probs = torch.softmax(F.linear(g, self.w[f"blocks.{layer}.moe.gate.weight"]), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        return ids, weights / weights.sum(dim=-1, keepdim=True)

    def _ffn(self, prefix: str, g: torch.Tensor) -> torch.Tensor:
        w = self.w
        return F.linear(F.silu(F.linear(g, w[f"{prefix}.w_gate.weight"])) * F.linear(g, w[f"{prefix}.w_up.weight"]),
                        w[f"{prefix}.w_down.weight"])

    def expert(self, layer: int, expert: int, x: torch.Tensor) -> torch.Tensor:
        """Routed expert output for residual-stream rows x (the MoE norm is applied here)."""
        g = self._norm(x, f"blocks.{layer}.moe_norm.weight")
        return self._ffn(f"blocks.{layer}.moe.experts.{expert}", g)

    def shared(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """Sum of the always-on shared experts (dense weights: on every rank)."""
        g = self._norm(x, f"blocks.{layer}.moe_norm.weight")
        out = torch.zeros_like(x)
        for s in range(self.shared_experts):
            out = out + self._ffn(f"blocks.{layer}.moe.shared_experts.{s}", g)
        return out

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self._norm(x, "final_norm.weight"), self.w["head.weight"])


def is_expert_tensor(name: str) -> tuple | None:
    """(layer, expert) if the state-dict entry belongs to a routed expert, else None (dense)."""
    parts = name.split(".")
    if len(parts) > 4 and parts[0] == "blocks" and parts[2] == "moe" and parts[3] == "experts":
        return int(parts[1]), int(parts[4])
    return None


Arch = TinyMoEArch


def encode(text: str) -> list:
    """TinyMoE's tokenizer: UTF-8 bytes."""
    return list(text.encode("utf-8"))


def decode(ids: list) -> str:
    return bytes(int(i) for i in ids).decode("utf-8", errors="replace")
