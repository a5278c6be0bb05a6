"""Hugging Face Mixtral and Qwen2-MoE math written against their weights, split for expert parallelism.

Same contract as `tiny_moe.py`. It follows transformers 5's modelling code: RMSNorm in float32,
rotary position embeddings (default RoPE), grouped-query attention, softmax router over all
experts then top-k (renormalised for Mixtral, and for Qwen2-MoE when `norm_topk_prob`), SwiGLU
experts, and Qwen2-MoE's sigmoid-gated shared expert and optional dense blocks. transformers
stores each layer's experts fused ([E, 2I, D] gate_up and [E, D, I] down); bundles store them
per expert (`...mlp.experts.<e>.gate_up_proj`), so a rank holds only its experts' slices.
"""
from __future__ import annotations

import re

import torch
import torch.nn.functional as F

MODEL_TYPES = ("mixtral", "qwen2_moe")
FUSED = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")
SPLIT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_up_proj|down_proj)$")


def _rope_theta(config: dict) -> float:
    params = config.get("rope_parameters") or {}
    if params.get("rope_type", "default") != "default":
        raise ValueError(f"rope type {params.get('rope_type')!r} is not supported by this runtime (default RoPE only)")
    return float(params.get("rope_theta", config.get("rope_theta", 10000.0)))


def moe_blocks(config: dict) -> list:
    """Block indices that are MoE blocks, in order (Qwen2-MoE may interleave dense MLP blocks)."""
    n = int(config["num_hidden_layers"])
    if config["model_type"] == "qwen2_moe":
        step = int(config.get("decoder_sparse_step", 1))
        dense = set(config.get("mlp_only_layers") or [])
        return [l for l in range(n) if l not in dense and (l + 1) % step == 0]
    return list(range(n))


class HFMoEArch:
    """The pieces the expert-parallel engine calls, for one rank's weights."""

    def __init__(self, config: dict, weights: dict):
        if config.get("model_type") not in MODEL_TYPES:
            raise ValueError(f"model_type {config.get('model_type')!r} is not one of {MODEL_TYPES}")
        if config.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {config['hidden_act']!r} is not supported (silu only)")
        window = config.get("sliding_window") if config.get("use_sliding_window", True) else None
        self.window = int(window) if window else None
        self.w = weights
        self.type = config["model_type"]
        self.hidden = int(config["hidden_size"])
        self.num_heads = int(config["num_attention_heads"])
        self.num_kv_heads = int(config.get("num_key_value_heads") or self.num_heads)
        self.head_dim = int(config.get("head_dim") or self.hidden // self.num_heads)
        self.num_layers = int(config["num_hidden_layers"])
        self.num_experts = int(config.get("num_local_experts") or config["num_experts"])
        self.top_k = int(config["num_experts_per_tok"])
        self.renormalise = self.type == "mixtral" or bool(config.get("norm_topk_prob", False))
        # no sliding-window masking here: refuse contexts longer than the window instead
        self.max_positions = min(int(config["max_position_embeddings"]), self.window or 1 << 62)
        self.eps = float(config["rms_norm_eps"])
        self.attention_scale = self.head_dim ** -0.5
        self.blocks = moe_blocks(config)
        self._moe_of = {b: i for i, b in enumerate(self.blocks)}
        theta = _rope_theta(config)
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float) / self.head_dim))
        self.head_weight = weights.get("lm_head.weight", weights["model.embed_tokens.weight"])

    def _norm(self, x, name):
        x32 = x.to(torch.float32)
        return self.w[name] * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)

    def _linear(self, x, prefix):
        return F.linear(x, self.w[f"{prefix}.weight"], self.w.get(f"{prefix}.bias"))

    def embed(self, token_ids, positions):
        return self.w["model.embed_tokens.weight"][token_ids]

    def attention_input(self, layer, x):
        return self._norm(x, f"model.layers.{layer}.input_layernorm.weight")

    def _rotate(self, t, positions):
        freqs = positions[:, None].float() * self.inv_freq.to(t.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos()[:, None, :].to(t.dtype), emb.sin()[:, None, :].to(t.dtype)
        half = t.shape[-1] // 2
        rotated = torch.cat((-t[..., half:], t[..., :half]), dim=-1)
        return t * cos + rotated * sin

    def qkv(self, layer, h, positions):
        p = f"model.layers.{layer}.self_attn"
        q = self._linear(h, f"{p}.q_proj").view(-1, self.num_heads, self.head_dim)
        k = self._linear(h, f"{p}.k_proj").view(-1, self.num_kv_heads, self.head_dim)
        v = self._linear(h, f"{p}.v_proj").view(-1, self.num_kv_heads, self.head_dim)
        return self._rotate(q, positions), self._rotate(k, positions), v

    def attention_output(self, layer, y):
        return self._linear(y.reshape(y.shape[0], self.num_heads * self.head_dim), f"model.layers.{layer}.self_attn.o_proj")

    def moe_index(self, layer):
        return self._moe_of.get(layer)

    def _post_norm(self, layer, x):
        return self._norm(x, f"model.layers.{layer}.post_attention_layernorm.weight")

    def _mlp(self, prefix, g):
        return self._linear(F.silu(self._linear(g, f"{prefix}.gate_proj")) * self._linear(g, f"{prefix}.up_proj"),
                            f"{prefix}.down_proj")

    def dense_mlp(self, layer, x):
        return self._mlp(f"model.layers.{layer}.mlp", self._post_norm(layer, x))

    def route(self, layer, x):
        g = self._post_norm(layer, x)
        logits = F.linear(g, self.w[f"model.layers.{layer}.mlp.gate.weight"])
        probs = torch.softmax(logits.float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalise:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return ids, weights.to(x.dtype)

    def expert(self, layer, expert, x):
        g = self._post_norm(layer, x)
        p = f"model.layers.{layer}.mlp.experts.{expert}"
        gate, up = F.linear(g, self.w[f"{p}.gate_up_proj"]).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.w[f"{p}.down_proj"])

    def shared(self, layer, x):
        if self.type != "qwen2_moe":
            return torch.zeros_like(x)
        g = self._post_norm(layer, x)
        out = self._mlp(f"model.layers.{layer}.mlp.shared_expert", g)
        return torch.sigmoid(F.linear(g, self.w[f"model.layers.{layer}.mlp.shared_expert_gate.weight"])) * out

    def logits(self, x):
        return F.linear(self._norm(x, "model.norm.weight"), self.head_weight)


Arch = HFMoEArch


def split_experts(state: dict) -> dict:
    """Fused [E, ...] expert tensors -> one tensor per expert, named `...experts.<e>.<kind>`."""
    out = {}
    for name, tensor in state.items():
        m = FUSED.match(name)
        if m:
            for e in range(tensor.shape[0]):
                out[f"model.layers.{m[1]}.mlp.experts.{e}.{m[2]}"] = tensor[e]
        else:
            out[name] = tensor
    return out


def fuse_experts(state: dict) -> dict:
    """Inverse of `split_experts` (for rebuilding the transformers model)."""
    out, parts = {}, {}
    for name, tensor in state.items():
        m = SPLIT.match(name)
        if m:
            parts.setdefault((m[1], m[3]), {})[int(m[2])] = tensor
        else:
            out[name] = tensor
    for (layer, kind), per in parts.items():
        out[f"model.layers.{layer}.mlp.experts.{kind}"] = torch.stack([per[e] for e in sorted(per)])
    return out


def expert_tensor_owner(config: dict):
    """A function name -> (MoE layer index, expert) for per-expert tensors, None for dense ones."""
    index = {b: i for i, b in enumerate(moe_blocks(config))}

    def owner(name: str):
        m = SPLIT.match(name)
        return (index[int(m[1])], int(m[2])) if m else None

    return owner


def encode(text: str) -> list:
    """Bundles ship no tokenizer: a prompt line is space-separated token ids."""
    try:
        return [int(t) for t in text.split()]
    except ValueError:
        raise ValueError("this bundle takes token ids: give --prompts a file of space-separated ids, one prompt per line") from None


def decode(ids: list) -> str:
    return " ".join(str(int(i)) for i in ids)
