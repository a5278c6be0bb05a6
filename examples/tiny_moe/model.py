"""TinyMoE: moeplan's reference decoder-only MoE language model, in plain torch.

Byte-level vocabulary (256), learned positions, pre-norm blocks of causal multi-head attention
followed by a top-k MoE layer (softmax router -> top-k -> renormalised weights, SwiGLU experts,
optional shared expert). It is written so that every piece moeplan cares about is visible:

* `MoELayer.gate` is the router (Linear d -> E); `MoELayer.experts` a ModuleList of `Expert`s.
* `Attention.probs` and `MoELayer.routing` are identity modules whose forward hooks see the
  attention probabilities [B, H, S, S] and the routing decision (top-k ids, weights): tracing
  hooks them instead of re-implementing the model.
* The router is MatMul -> Softmax -> TopK, the pattern the ONNX importer recognises.

This file imports only torch so that it can be copied into bundles and loaded by path.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class TinyMoEConfig:
    vocab_size: int = 256
    hidden_size: int = 128
    num_layers: int = 6
    num_heads: int = 4
    num_experts: int = 16
    top_k: int = 2
    expert_hidden: int = 128
    shared_experts: int = 0
    max_positions: int = 256
    norm_eps: float = 1e-5

    @classmethod
    def from_dict(cls, data: dict) -> TinyMoEConfig:
        names = cls.__dataclass_fields__.keys()
        return cls(**{k: v for k, v in data.items() if k in names})

    def to_dict(self) -> dict:
        return asdict(self)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Attention(nn.Module):
    """Causal multi-head attention with explicit probabilities (hookable via `self.probs`)."""

    def __init__(self, cfg: TinyMoEConfig):
        super().__init__()
        self.num_heads = cfg.num_heads
        self.head_dim = cfg.hidden_size // cfg.num_heads
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size, bias=False)
        self.out = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=False)
        self.probs = nn.Identity()

    def forward(self, x, cache: dict | None = None, key_mask=None):
        """x [B, S, D]. With `cache` (a dict this layer owns), keys and values of earlier calls are
        kept and the S new positions attend to them too; `key_mask` [B, P + S] (bool, False for
        left padding) hides padded keys. Without them: plain causal attention over x."""
        B, S, D = x.shape
        q, k, v = self.qkv(x).view(B, S, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        if cache is not None:
            if "k" in cache:
                k, v = torch.cat([cache["k"], k], dim=2), torch.cat([cache["v"], v], dim=2)
            cache["k"], cache["v"] = k, v
        P = k.shape[2] - S
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.head_dim)
        causal = torch.ones(S, P + S, dtype=torch.bool, device=x.device).tril(diagonal=P)
        if key_mask is not None:
            causal = causal[None, None] & key_mask[:, None, None, :].to(torch.bool)
        # with padding a query may see no key at all: a finite floor keeps its row finite (unused)
        scores = scores.masked_fill(~causal, float("-inf") if key_mask is None else torch.finfo(scores.dtype).min)
        probs = self.probs(torch.softmax(scores, dim=-1))
        y = (probs @ v).transpose(1, 2).reshape(B, S, D)
        return self.out(y)


class Expert(nn.Module):
    """SwiGLU feed-forward expert."""

    def __init__(self, hidden: int, inner: int):
        super().__init__()
        self.w_gate = nn.Linear(hidden, inner, bias=False)
        self.w_up = nn.Linear(hidden, inner, bias=False)
        self.w_down = nn.Linear(inner, hidden, bias=False)

    def forward(self, x):
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))


def _exporting() -> bool:
    """True while torch.export / torch.onnx capture the model (they need a static graph)."""
    return torch.compiler.is_exporting() or torch.onnx.is_in_onnx_export()


class MoELayer(nn.Module):
    """Softmax router, top-k experts with renormalised weights, optional shared experts."""

    def __init__(self, cfg: TinyMoEConfig):
        super().__init__()
        self.num_experts = cfg.num_experts
        self.top_k = cfg.top_k
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = nn.ModuleList(Expert(cfg.hidden_size, cfg.expert_hidden) for _ in range(cfg.num_experts))
        self.shared_experts = nn.ModuleList(
            Expert(cfg.hidden_size, cfg.expert_hidden) for _ in range(cfg.shared_experts)
        )
        self.routing = nn.Identity()
        self.last_router_probs = None  # kept during training for the balance loss

    def route(self, x):
        """Top-k expert ids (heaviest first) and renormalised weights for tokens x [N, D]."""
        probs = torch.softmax(self.gate(x), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return probs, ids, weights

    def forward(self, x):
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        probs, ids, weights = self.route(flat)
        ids, weights = self.routing((ids, weights))
        if self.training:
            self.last_router_probs, self.last_ids = probs, ids
        out = torch.zeros_like(flat)
        if _exporting():
            # Graph export cannot express data-dependent dispatch, so the exported graph runs
            # every expert on every token and weights it by a dense [N, E] matrix that is zero
            # outside the top-k: the same sums as below (unchosen experts add exact zeros).
            dense = torch.zeros_like(probs).scatter(1, ids, weights)
            for e, expert in enumerate(self.experts):
                out = out + expert(flat) * dense[:, e : e + 1]
        else:
            for e, expert in enumerate(self.experts):
                token_idx, slot = torch.where(ids == e)
                if token_idx.numel() == 0:
                    continue
                y = expert(flat[token_idx]) * weights[token_idx, slot].unsqueeze(-1)
                out = out.index_add(0, token_idx, y)
        for shared in self.shared_experts:
            out = out + shared(flat)
        return out.reshape(shape)


class Block(nn.Module):
    def __init__(self, cfg: TinyMoEConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.moe_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.moe = MoELayer(cfg)

    def forward(self, x, cache: dict | None = None, key_mask=None):
        x = x + self.attn(self.attn_norm(x), cache=cache, key_mask=key_mask)
        return x + self.moe(self.moe_norm(x))


class TinyMoE(nn.Module):
    """Decoder-only byte-level MoE language model: logits [B, S, 256] from byte ids [B, S]."""

    def __init__(self, cfg: TinyMoEConfig | None = None):
        super().__init__()
        self.config = cfg or TinyMoEConfig()
        c = self.config
        self.embed = nn.Embedding(c.vocab_size, c.hidden_size)
        self.pos_embed = nn.Embedding(c.max_positions, c.hidden_size)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.num_layers))
        self.final_norm = RMSNorm(c.hidden_size, c.norm_eps)
        self.head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)

    def forward(self, input_ids):
        S = input_ids.shape[1]
        positions = torch.arange(S, device=input_ids.device)
        return self._run(input_ids, positions, None, None)

    def forward_incremental(self, input_ids, positions, cache: list, key_mask):
        """Logits [B, S, 256] of S new tokens at `positions` [B, S], attending to what earlier calls
        left in `cache` (a list, one dict per block, filled on the first call); `key_mask`
        [B, P + S] is False for left padding (see Attention). Used by moeplan's runtime."""
        if not cache:
            cache.extend({} for _ in self.blocks)
        return self._run(input_ids, positions, cache, key_mask)

    def _run(self, input_ids, positions, cache, key_mask):
        x = self.embed(input_ids) + self.pos_embed(positions)
        for i, block in enumerate(self.blocks):
            x = block(x, cache=None if cache is None else cache[i], key_mask=key_mask)
        return self.head(self.final_norm(x))

    def balance_loss(self) -> torch.Tensor:
        """Switch-style auxiliary loss E * sum_e f_e * p_e, averaged over MoE layers."""
        losses = []
        for block in self.blocks:
            moe = block.moe
            probs, ids = moe.last_router_probs, moe.last_ids
            frac = F.one_hot(ids, moe.num_experts).float().sum(1).mean(0) / moe.top_k
            losses.append(moe.num_experts * (frac * probs.mean(0)).sum())
        return torch.stack(losses).mean()


CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"


def load(directory: str | Path) -> TinyMoE:
    """Build TinyMoE from a directory holding config.json (+ model.safetensors if trained)."""
    directory = Path(directory)
    config = json.loads((directory / CONFIG_FILE).read_text())
    model = TinyMoE(TinyMoEConfig.from_dict(config))
    weights = directory / WEIGHTS_FILE
    if weights.is_file():
        from safetensors.torch import load_file

        state = {k: v.float() for k, v in load_file(str(weights)).items()}
        model.load_state_dict(state)
    return model.eval()
