"""The shape of a model as a serving engine runs it: per decoder layer, what attention and what MLP.

Why not the ModelIR: the IR counts parameters and FLOPs per stage, but an engine's kernels are keyed
by other things: heads, KV heads and head dim (GQA), the MLA ranks, the sliding window, the expert
width and top-k, the checkpoint's weight format (an FP8-block checkpoint runs FP8-block GEMMs and
stores 1 byte per weight). These come from the Hugging Face config; `tests/test_engine_cost.py`
checks them against the IR's parameter counts on every config of examples/configs/.

Which decoder layers are MoE follows each architecture's config keys as transformers builds them:
`first_k_dense_replace` / `moe_layer_freq` (DeepSeek, GLM-4.5), `decoder_sparse_step` /
`mlp_only_layers` (Qwen MoE), `moe_layer_start_index` / `_end_index` / `_interval` (ERNIE 4.5),
`interleave_moe_layer_step` (Llama 4); every layer otherwise. Attention per layer: `layer_types`
(gpt-oss: sliding / full), `full_attention_interval` (Qwen3-Next: Gated DeltaNet in between),
`attention_chunk_size` (Llama 4: chunked local attention, priced as a window, on 3 layers of 4),
`sliding_window` when set and `use_sliding_window` is not false.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from moeplan.core.errors import UserError
from moeplan.passes.importers.quantization import checkpoint_storage

FULL, SLIDING, LINEAR = "full", "sliding", "linear"
# bytes a stored weight element takes, per precision (scales included: FP8 blocks of 128 x 128 carry one
# float32 scale, MXFP4 one 8-bit scale per 32 values; passes/importers/quantization.py)
WEIGHT_BYTES = {"float32": 4.0, "bfloat16": 2.0, "float16": 2.0, "fp8": 1.0, "fp8_block": 1.0 + 4 / (128 * 128),
                "mxfp4": 4.25 / 8, "int4": 4.16 / 8, "int8": 1.0 + 2 / 128}
KV_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "fp8": 1}


@dataclass(frozen=True)
class MlaShape:
    """Multi-head latent attention (DeepSeek-V2/V3): q through a rank-`q_lora_rank` bottleneck (0: a
    plain q projection), K/V from a cached latent of `kv_lora_rank` + a rotary key of `qk_rope_head_dim`."""

    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def cached_elements(self) -> int:
        """Elements one token's KV cache holds per layer: the latent and the rotary key (shared by heads)."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class LinearAttentionShape:
    """Gated DeltaNet (Qwen3-Next): a fixed-size state per sequence instead of a KV cache."""

    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    conv_kernel: int

    @property
    def state_elements(self) -> int:
        """float32 state per sequence and layer: value heads x key dim x value dim, plus the conv window."""
        conv = (2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim) * (self.conv_kernel - 1)
        return self.value_heads * self.key_dim * self.value_dim + conv


@dataclass(frozen=True)
class EngineModel:
    """What the engine's kernels for one model are keyed by. Sizes are elements; `*_quant` are the
    precisions of the stored weights (`WEIGHT_BYTES`): attention projections, routed experts, dense and
    shared MLPs; the embedding, the router and the LM head stay at `compute_dtype`."""

    name: str
    architecture: str
    hidden: int
    vocab: int
    tied_embeddings: bool
    moe_layers: tuple            # bool per decoder layer
    attention_kinds: tuple       # FULL / SLIDING / LINEAR per decoder layer
    windows: tuple               # per decoder layer: the window in tokens (0: the whole context)
    q_heads: int
    kv_heads: int
    head_dim: int
    qk_norm: bool
    mla: MlaShape | None
    linear: LinearAttentionShape | None
    num_experts: int
    top_k: int
    moe_inter: int               # one routed expert's intermediate width
    shared_inter: int            # all shared experts' intermediate width together (0: none)
    dense_inter: int             # a dense layer's MLP width
    compute_dtype: str
    attention_quant: str
    moe_quant: str
    dense_quant: str
    kv_dtype: str                # what the engine's KV cache holds by default (the compute dtype)

    @property
    def num_layers(self) -> int:
        return len(self.moe_layers)

    @property
    def num_moe_layers(self) -> int:
        return sum(self.moe_layers)

    @property
    def num_dense_layers(self) -> int:
        return self.num_layers - self.num_moe_layers

    def count(self, kind: str) -> int:
        """Decoder layers whose attention is `kind`."""
        return sum(1 for k in self.attention_kinds if k == kind)

    # --- parameters (elements) per unit, for weight memory ---------------------------------------

    @property
    def attention_params(self) -> int:
        """One softmax-attention layer's projections."""
        h = self.hidden
        if self.mla is not None:
            m = self.mla
            q = (h * m.q_lora_rank + m.q_lora_rank * self.q_heads * m.qk_head_dim) if m.q_lora_rank else \
                h * self.q_heads * m.qk_head_dim
            kv = h * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank * self.q_heads * (m.qk_nope_head_dim + m.v_head_dim)
            return q + kv + self.q_heads * m.v_head_dim * h
        return h * self.head_dim * (self.q_heads + 2 * self.kv_heads) + self.q_heads * self.head_dim * h

    @property
    def linear_attention_params(self) -> int:
        """One Gated DeltaNet layer's projections (q, k, v, z, gates in; out)."""
        a = self.linear
        if a is None:
            return 0
        inner = 2 * a.key_heads * a.key_dim + 2 * a.value_heads * a.value_dim + 2 * a.value_heads
        return self.hidden * inner + a.value_heads * a.value_dim * self.hidden

    @property
    def expert_params(self) -> int:
        return 3 * self.hidden * self.moe_inter

    @property
    def shared_params(self) -> int:
        return 3 * self.hidden * self.shared_inter

    @property
    def dense_mlp_params(self) -> int:
        return 3 * self.hidden * self.dense_inter

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    def kv_elements_per_token(self, layer: int, tp: int) -> int:
        """Elements one token's cache holds in decoder layer `layer` on one of `tp` attention ranks:
        K and V of its ceil(kv heads / tp) heads (KV heads are replicated where tp exceeds them), or the
        MLA latent and rotary key (every rank holds them whole); 0 for linear attention (a state)."""
        if self.attention_kinds[layer] == LINEAR:
            return 0
        if self.mla is not None:
            return self.mla.cached_elements
        return 2 * math.ceil(self.kv_heads / tp) * self.head_dim


def _get(config: dict, *keys, default=None):
    for key in keys:
        if config.get(key) is not None:
            return config[key]
    return default


def _moe_layers(config: dict, layers: int, num_experts: int) -> tuple:
    """bool per decoder layer: whether its MLP is a mixture of experts (see the module docstring)."""
    if num_experts <= 0:
        return (False,) * layers
    if "first_k_dense_replace" in config:
        k, freq = int(config.get("first_k_dense_replace") or 0), int(config.get("moe_layer_freq") or 1)
        return tuple(i >= k and i % freq == 0 for i in range(layers))
    if "moe_layer_start_index" in config:
        start = int(config["moe_layer_start_index"])
        end = int(_get(config, "moe_layer_end_index", default=layers - 1))
        end = layers - 1 if end < 0 else end
        step = int(config.get("moe_layer_interval") or 1)
        return tuple(start <= i <= end and (i - start) % step == 0 for i in range(layers))
    if "interleave_moe_layer_step" in config:
        step = int(config["interleave_moe_layer_step"])
        return tuple((i + 1) % step == 0 for i in range(layers))
    if "decoder_sparse_step" in config:
        step = int(config.get("decoder_sparse_step") or 1)
        only = set(config.get("mlp_only_layers") or ())
        return tuple(i not in only and (i + 1) % step == 0 for i in range(layers))
    return (True,) * layers


def _attention_kinds(config: dict, layers: int) -> tuple:
    """(kinds, windows) per decoder layer."""
    window = config.get("sliding_window") or config.get("attention_chunk_size")
    use_window = window is not None and config.get("use_sliding_window", True) is not False
    if config.get("layer_types"):
        types = list(config["layer_types"])[:layers]
        kinds = tuple(SLIDING if "sliding" in t or "chunked" in t else LINEAR if "linear" in t else FULL for t in types)
    elif config.get("full_attention_interval"):
        n = int(config["full_attention_interval"])
        kinds = tuple(FULL if (i + 1) % n == 0 else LINEAR for i in range(layers))
    elif config.get("attention_chunk_size"):
        window = int(config["attention_chunk_size"])
        kinds = tuple(FULL if (i + 1) % 4 == 0 else SLIDING for i in range(layers))
        use_window = True
    else:
        kinds = tuple(SLIDING if use_window else FULL for _ in range(layers))
    windows = tuple(int(window) if k == SLIDING and use_window else 0 for k in kinds)
    return tuple(FULL if k == SLIDING and not w else k for k, w in zip(kinds, windows)), windows


def _quant(config: dict, compute: str, name: str) -> tuple:
    """(attention, experts, dense) weight precisions from the checkpoint's `quantization_config`."""
    storage, _ = checkpoint_storage(config, compute, name)
    if storage is None:
        return (compute,) * 3
    method = getattr(storage, "method", None)
    if method is None:  # a float8 torch dtype: every weight in 1 byte
        return ("fp8",) * 3
    if method == "fp8":
        mode = "fp8_block" if storage.config.get("weight_block_size") else "fp8"
    elif method == "mxfp4":
        mode = "mxfp4"
    else:
        mode = "int8" if storage.bits == 8 else "int4"
    skipped = lambda module: any(p.search(module) for p in storage.skip)
    attention = compute if skipped("model.layers.0.self_attn") else mode
    experts = compute if skipped("model.layers.0.mlp.experts") else mode
    dense = compute if skipped("model.layers.0.mlp") else mode
    return attention, experts, dense


def engine_model(config: dict, name: str = "") -> EngineModel:
    """The engine shape of a Hugging Face config.json as read from disk (a multimodal config's
    `text_config` is its text model). The raw file, not the imported module's config: the importer drops
    `quantization_config` before transformers sees it (passes/importers/hf_config.py IGNORED_KEYS).

    Refuses (one line) a config without MoE layers or attention heads."""
    outer = config
    config = config.get("text_config") or config
    attn, ffn = config.get("attn_config") or {}, config.get("ffn_config") or {}
    layers = int(_get(config, "num_hidden_layers", "n_layers", default=0))
    hidden = int(_get(config, "hidden_size", "d_model", default=0))
    q_heads = int(_get(config, "num_attention_heads", "n_heads", default=0))
    num_experts = int(_get(config, "n_routed_experts", "num_local_experts", "num_experts", "moe_num_experts",
                           default=ffn.get("moe_num_experts", 0)) or 0)
    source = name or "the model config"
    if not layers or not hidden or num_experts <= 0:
        raise UserError(f"{source}: engine pricing needs a decoder config with layers, hidden size and routed experts "
                        f"(num_hidden_layers, hidden_size, num_experts or n_routed_experts); this one has "
                        f"{layers} layers, hidden {hidden}, {num_experts} experts")
    top_k = int(_get(config, "num_experts_per_tok", "moe_topk", "moe_k", "experts_per_token", default=ffn.get("moe_top_k", 1)))
    top_k = int(top_k[0]) if isinstance(top_k, list) else top_k
    kv_heads = int(_get(config, "num_key_value_heads", default=attn.get("kv_n_heads", q_heads)))
    if config.get("model_type") == "jetmoe":  # attention experts: top-k query experts share one set of KV heads
        q_heads = kv_heads * top_k
    head_dim = int(_get(config, "head_dim", "kv_channels", default=hidden // max(q_heads, 1)))
    mla = None
    if config.get("kv_lora_rank"):
        mla = MlaShape(int(config.get("q_lora_rank") or 0), int(config["kv_lora_rank"]), int(config["qk_nope_head_dim"]),
                       int(config["qk_rope_head_dim"]), int(config["v_head_dim"]))
        kv_heads, head_dim = q_heads, mla.qk_head_dim
    kinds, windows = _attention_kinds(config, layers)
    linear = None
    if LINEAR in kinds:
        linear = LinearAttentionShape(int(config["linear_num_key_heads"]), int(config["linear_num_value_heads"]),
                                      int(config["linear_key_head_dim"]), int(config["linear_value_head_dim"]),
                                      int(config.get("linear_conv_kernel_dim") or 4))
    inter = int(_get(config, "intermediate_size", default=ffn.get("ffn_hidden_size", 0)) or 0)
    moe_inter = int(_get(config, "moe_intermediate_size", default=ffn.get("ffn_hidden_size", inter)))
    shared_count = int(_get(config, "n_shared_experts", "moe_num_shared_experts", "num_shared_expert", default=0) or 0)
    if config.get("shared_expert_intermediate_size"):
        shared_inter = int(config["shared_expert_intermediate_size"])
    elif config.get("model_type") == "llama4_text":
        shared_inter = inter  # one shared expert of the routed experts' width
    elif config.get("model_type") == "hunyuan_v1_moe":
        shared_inter = shared_count * inter
    else:
        shared_inter = shared_count * moe_inter
    dense_inter = int(_get(config, "intermediate_size_mlp", default=inter))
    compute = str(_get(outer, "dtype", "torch_dtype", default=_get(config, "dtype", "torch_dtype", default="bfloat16"))).replace("torch.", "")
    compute = compute if compute in WEIGHT_BYTES else "bfloat16"
    attention_quant, moe_quant, dense_quant = _quant(outer, compute, source)
    kv = compute if compute in KV_BYTES else "bfloat16"
    return EngineModel(
        name=name or str(config.get("_name_or_path") or config.get("model_type") or "model"),
        architecture=str((outer.get("architectures") or [config.get("model_type", "")])[0]),
        hidden=hidden, vocab=int(config.get("vocab_size") or 0),
        tied_embeddings=bool(_get(config, "tie_word_embeddings", default=outer.get("tie_word_embeddings", False))),
        moe_layers=_moe_layers(config, layers, num_experts), attention_kinds=kinds, windows=windows,
        q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim,
        qk_norm=bool(config.get("use_qk_norm") or config.get("model_type") in ("qwen3_moe", "qwen3_next")),
        mla=mla, linear=linear, num_experts=num_experts, top_k=top_k, moe_inter=moe_inter, shared_inter=shared_inter,
        dense_inter=dense_inter, compute_dtype=compute, attention_quant=attention_quant, moe_quant=moe_quant,
        dense_quant=dense_quant, kv_dtype=kv)
