"""Build a rank's model with the library's own code: transformers for Hugging Face models,
the shipped `model/model.py` for moeplan model directories (TinyMoE).

The model class named by the config is built as the library builds it; dense weights load as
they are, and each MoE block keeps only this rank's experts (`moe_adapter.MoEAdapter`). The
engine then calls one `forward` per step (batched, left-padded, with the library's own KV cache)
and reaches into three places per decoder block by hooks: the attention module (its input, for
context-coherent mode), the norm before the feed-forward block, and the block's output.
"""
from __future__ import annotations

import importlib.util
import inspect
import json
from pathlib import Path

import torch
import torch.nn as nn

from ..fp8_blocks import SCALE_SUFFIX
from . import grouped_attention
from .growable_cache import growable_cache
from .moe_adapter import ModelError, MoEAdapter, find_containers

ATTENTION_NAMES = ("self_attn", "linear_attn", "self_attention", "attn", "norm_attn_norm.attn")
FFN_NORM_NAMES = ("post_attention_layernorm", "norm_attn_norm.norm_2", "moe_norm")


def transformers_config(config_dir: Path):
    import transformers

    transformers.utils.logging.set_verbosity_error()
    config = transformers.AutoConfig.from_pretrained(str(config_dir))
    config._attn_implementation = grouped_attention.register()
    config._experts_implementation = "eager"
    return config


def build_transformers(config_dir: Path, device: str = "cpu", buffers: str | None = None, dtype=torch.float32):
    """The transformers causal LM named by the config (at `dtype`, eval: the library keeps the
    parameters it must in float32, e.g. DeepSeek-V3's router); meta device builds no weights.

    `buffers="cpu"` with `device="meta"`: parameters on meta (a rank loads its own tensors into
    them with `assign=True`), buffers computed at construction (rotary frequencies) on the CPU.
    """
    import transformers

    from transformers.initialization import no_init_weights

    config = transformers_config(config_dir)
    placing = _parameters_on_meta() if device == "meta" and buffers == "cpu" else torch.device(device)
    with placing, no_init_weights():
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.config._experts_implementation = "eager"
    return model.eval()


class _parameters_on_meta:
    """Every parameter registered while active goes to `meta` (its storage is never kept);
    buffers stay where they were made. Same idea as accelerate's init_empty_weights(include_buffers=False)."""

    def __enter__(self):
        self._register = original = nn.Module.register_parameter

        def register(module, name, param):
            original(module, name, param)
            if param is not None:
                kept = module._parameters[name]
                module._parameters[name] = type(kept)(kept.to("meta"), requires_grad=kept.requires_grad)
        nn.Module.register_parameter = register
        return self

    def __exit__(self, *exc):
        nn.Module.register_parameter = self._register
        return False


def transformers_top_k(config) -> int:
    """Experts per token, under the name each transformers config uses."""
    ffn = getattr(config, "ffn_config", None)
    for source, name in ((config, "num_experts_per_tok"), (config, "moe_topk"), (ffn, "moe_top_k"),
                         (config, "moe_k"), (config, "experts_per_token")):
        value = getattr(source, name, None) if source is not None else None
        if value:
            return int(value[0] if isinstance(value, (list, tuple)) else value)
    raise ModelError(f"{type(config).__name__} names no experts-per-token setting this runtime knows")


def load_source_module(path: Path):
    """Import a model source file by path (bundles carry it as model/model.py)."""
    import hashlib
    import sys

    name = "moeplan_model_" + hashlib.sha256(str(Path(path).resolve()).encode()).hexdigest()[:16]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the file executes
    spec.loader.exec_module(module)
    return module


def build_tiny_moe(config_path: Path, source: Path):
    module = load_source_module(source)
    config = json.loads(Path(config_path).read_text())
    return module.TinyMoE(module.TinyMoEConfig.from_dict(config)).eval()


def decoder_layers(model) -> tuple:
    """(module path, ModuleList) of the model's decoder blocks: the longest ModuleList holding an MoE block."""
    best = None
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) and find_containers(module, name):
            if best is None or len(module) > len(best[1]):
                best = (name, module)
    if best is None:
        raise ModelError(f"{type(model).__name__} has no MoE block this runtime recognises")
    return best


def _first_submodule(layer, names):
    for n in names:
        try:
            return layer.get_submodule(n)
        except AttributeError:
            continue
    return None


def _expert_names(containers: list) -> list:
    return [f"{c.path}.{e}.{p}" for c in containers for e in range(c.num_experts) for p, _ in c.params]


def expert_tensor_names(model) -> list:
    """Bundle names `<container>.<e>.<param>` of a library model's per-expert tensors (`moe_adapter`)."""
    prefix, layers = decoder_layers(model)
    return _expert_names(find_containers(layers, prefix))


class RankModel:
    """A library model holding this rank's experts, with the engine's hook points."""

    def __init__(self, model, kind: str, route_fn, local_experts: dict, weights: dict, max_positions: int,
                 fp8_block: tuple | None = None):
        """`fp8_block`: hold the routed experts as FP8 in blocks of that size (`fp8_experts.py`)."""
        self.model, self.kind, self.max_positions = model, kind, max_positions
        self.cache_columns = max_positions  # at most this many KV cache columns (a service: its max context)
        prefix, self.layers = decoder_layers(model)
        self.containers = find_containers(self.layers, prefix)
        expert_names = set(_expert_names(self.containers))
        if kind == "tiny_moe":
            expert_names = {f"{c.path}.{p}" for c in self.containers for p, _ in c.params}
        expert_names |= {n + SCALE_SUFFIX for n in expert_names}  # an expert's FP8 scales (`fp8_experts.py`)
        dense = {k: v for k, v in weights.items() if k not in expert_names}
        missing, unexpected = _load_dense(model, dense, self.containers, kind)
        if unexpected:
            raise ModelError(f"shard tensors {unexpected[:3]} are not parameters of {type(model).__name__}")
        if missing:
            raise ModelError(f"shard lacks tensors {missing[:3]} of {type(model).__name__}")
        self.adapters = [MoEAdapter(model, c, local_experts.get(c.moe, []), weights, route_fn, fp8_block)
                         for c in self.containers]
        self.moe_of = {c.layer: c.moe for c in self.containers}
        self.num_layers = len(self.layers)
        self.attention = [_first_submodule(layer, ATTENTION_NAMES) for layer in self.layers]
        left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
        if left:
            raise ModelError(f"the rank's weights leave {left[:3]} of {type(model).__name__} unset")
        self.ffn_norm = {c.layer: _first_submodule(self.layers[c.layer], FFN_NORM_NAMES) for c in self.containers}
        for layer, norm in self.ffn_norm.items():
            if norm is None:
                raise ModelError(f"decoder block {layer} has no norm before its MoE block among {FFN_NORM_NAMES}")
        if any(a is None for a in self.attention):
            raise ModelError(f"a decoder block has no attention module among {ATTENTION_NAMES}")
        self.cache_kwarg = cache_kwarg(model) if kind != "tiny_moe" else "past_key_values"
        self.compiled_decode = None  # a CompiledDecode (compiled_decode.py) its decode steps run through, once enabled
        self.prefill_compiles = True  # whether the next prefill may run compiled (the engine says, per forward)

    def forward(self, ids, positions, key_mask, cache):
        """Logits [B, S, V] and the cache to pass next time, for ids/positions [B, S], key_mask [B, P + S]."""
        if self.kind == "tiny_moe":
            cache = [] if cache is None else cache
            return self.model.forward_incremental(ids, positions, cache, key_mask), cache
        if cache is None:  # the library's cache, its full-attention layers with spare columns (growable_cache.py)
            cache = growable_cache(self.model.config, self.cache_columns, latents=self.compiled_decode is not None)
            if self.compiled_decode is not None and self.prefill_compiles and self.compiled_decode.prefills_into(cache, ids):
                return self.compiled_decode.prefill(ids, positions, key_mask, cache), cache
        elif ids.shape[1] == 1 and self.compiled_decode is not None and self.compiled_decode.applies(cache):
            return self.compiled_decode(ids, positions, key_mask, cache), cache
        out = self.model(input_ids=ids, attention_mask=key_mask.to(torch.int64), position_ids=positions,
                         use_cache=True, **{self.cache_kwarg: cache})
        return out.logits, getattr(out, self.cache_kwarg)


def cache_kwarg(model) -> str:
    """The keyword the model's forward takes its cache by: transformers 5.24 renamed
    `past_key_values` to `cache` (the old name still works there, with a warning, until 5.40)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _load_dense(model, dense: dict, containers: list, kind: str) -> tuple:
    """Load non-expert weights; returns (missing dense names, unexpected names)."""
    expert_params = set()
    for c in containers:
        expert_params |= {f"{c.path}.{p}" for p, _ in c.params}
    own = dict(model.named_parameters())
    own.update(model.named_buffers())
    for name, tensor in dense.items():  # each at the dtype the model holds it (`precision.py`; fp32-kept parameters)
        if name in own and tensor.is_floating_point() and tensor.dtype != own[name].dtype:
            dense[name] = tensor.to(own[name].dtype)
    result = model.load_state_dict(dense, strict=False, assign=True)
    missing = [k for k in result.missing_keys if k not in expert_params]
    if kind != "tiny_moe":
        tied = getattr(model.config, "tie_word_embeddings", False)
        if tied:
            missing = [k for k in missing if k != "lm_head.weight"]
            model.tie_weights()
    return missing, list(result.unexpected_keys)
