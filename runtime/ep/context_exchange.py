"""Context-coherent mode's context exchange: what a token's current rank sends every other rank at
each decoder block (after the first MoE block), so that every rank's library KV cache holds every
token and a later token can attend on whichever rank it lands.

Two ways, chosen per block by size (elements per token; the smaller wins, the hidden state on ties):
* `hidden`: the attention module's input (the normed hidden state, D elements); every rank runs the
  library's attention on it and so projects K/V itself;
* `kv`: what the library's cache stores, swapped in at the cache's own `update(key, value,
  layer_idx)` call (a proxy for the cache is handed to the attention module; the attention code is
  the library's, unchanged): post-rotary K plus V, 2 x KV heads x head dim for GQA models; for MLA
  (DeepSeek-V2/V3 in transformers 5, whose cache stores the compressed latent) the normed latent
  plus the rotated shared key, kv_lora_rank + qk_rope_head_dim. A rank's other rows of that
  attention (queries of tokens current elsewhere) compute on placeholder zeros and are discarded,
  as every non-current row is.

The width of a block's `kv` row is read off the attention module's projections
(`kv_elements`), so the planner prices the same choice from a model built on the meta device
(`context_plan`), and the runtime checks every cache update against it.
"""
from __future__ import annotations

import torch

from .exchange import pack, unpack

HIDDEN, KV = "hidden", "kv"
# the keyword a decoder block hands its attention module the cache under: `cache` from transformers
# 5.24 on (models/*/modeling_*.py: `@deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")`),
# `past_key_values` before
CACHE_KWARGS = ("cache", "past_key_values")
# auto: the smaller per block; hidden: always the hidden state (the old way); kv: K/V wherever the
# cache allows, even when larger (tests run every architecture's cache path with it)
CHOICES = ("auto", HIDDEN, KV)


def kv_elements(attention) -> int | None:
    """Elements per token the library's cache stores for this attention module (K + V, or the MLA
    latent + rotated key), from its projection shapes; None when it is not a K/V cache attention
    (linear attention, moeplan's TinyMoE) or the layout is not one this runtime knows."""
    if attention is None:
        return None
    latent = getattr(attention, "kv_a_proj_with_mqa", None)
    if latent is not None:
        return int(latent.out_features)
    k, v = getattr(attention, "k_proj", None), getattr(attention, "v_proj", None)
    if k is not None and v is not None and hasattr(k, "out_features") and hasattr(v, "out_features"):
        return int(k.out_features) + int(v.out_features)
    kv = getattr(attention, "kv_proj", None)  # JetMoE: one projection, chunked into K and V
    if kv is not None and hasattr(kv, "out_features"):
        return int(kv.out_features)
    heads, dim = getattr(attention, "num_key_value_heads", None), getattr(attention, "head_dim", None)
    if getattr(attention, "Wqkv", None) is not None and isinstance(heads, int) and isinstance(dim, int):
        return 2 * heads * dim  # DBRX: fused QKV, K and V of kv heads x head dim each
    return None


def context_plan(attention_modules: list, hidden: int, choice: str = "auto") -> list:
    """[(HIDDEN or KV, elements per token)] per decoder block."""
    if choice not in CHOICES:
        raise ValueError(f"context must be one of {CHOICES}, got {choice!r}")
    out = []
    for attention in attention_modules:
        kv = kv_elements(attention) if choice != HIDDEN else None
        out.append((KV, kv) if kv is not None and (kv < hidden or choice == KV) else (HIDDEN, hidden))
    return out


def model_context_plan(model, choice: str = "auto") -> list:
    """`context_plan` for a whole library model (built on any device, meta included)."""
    from ..model.library_model import ATTENTION_NAMES, _first_submodule, decoder_layers

    _, layers = decoder_layers(model)
    return context_plan([_first_submodule(layer, ATTENTION_NAMES) for layer in layers], hidden_size(model), choice)


def hidden_size(model) -> int:
    """D: the width of the model's token embedding (the hidden state the blocks carry)."""
    get = getattr(model, "get_input_embeddings", None)
    embedding = get() if get is not None else next(m for m in model.modules() if isinstance(m, torch.nn.Embedding))
    return int(embedding.embedding_dim)


class _ExchangingCache:
    """The library's cache as the attention module sees it: `update` first swaps in the rows other
    ranks sent; everything else is the cache itself."""

    def __init__(self, cache, swap):
        self._cache, self._swap = cache, swap

    def update(self, key, value, layer_idx, *args, **kwargs):
        key, value = self._swap(key, value)
        return self._cache.update(key, value, layer_idx, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._cache, name)


class ContextExchange:
    """Installs the context hooks of coherent mode on an engine's model, one way per block."""

    def __init__(self, engine, plan: list):
        self.engine, self.plan = engine, plan
        self.updated = None

    def install(self) -> list:
        handles = []
        for layer, (kind, _) in enumerate(self.plan):
            attention = self.engine.model.attention[layer]
            if kind == HIDDEN:
                handles.append(attention.register_forward_pre_hook(self._hidden_input(layer), with_kwargs=True))
            else:
                handles.append(attention.register_forward_pre_hook(self._kv_input(layer), with_kwargs=True))
                handles.append(attention.register_forward_hook(self._kv_done(layer)))
        return handles

    # --- hidden: the attention input -------------------------------------------------------
    def _hidden_input(self, layer: int):
        def hook(module, args, kwargs):
            """Placeholder rows get the current rank's normed hidden state before attention."""
            e = self.engine
            if e.replicated:
                return None
            in_kwargs = "hidden_states" in kwargs
            h = kwargs["hidden_states"] if in_kwargs else args[0]
            flat = h.reshape(-1, h.shape[-1])
            new = self._swap_rows(layer, [flat])[0].view(h.shape)
            if in_kwargs:
                return args, {**kwargs, "hidden_states": new}
            return (new,) + tuple(args[1:]), kwargs
        return hook

    # --- kv: the cache update --------------------------------------------------------------
    def _kv_input(self, layer: int):
        def hook(module, args, kwargs):
            e = self.engine
            if e.replicated:
                return None
            name = next((n for n in CACHE_KWARGS if kwargs.get(n) is not None), None)
            if name is None:
                raise RuntimeError(f"attention of block {layer} was called without a KV cache (keywords {CACHE_KWARGS}); "
                                   "its K/V cannot be exchanged (serve with --context hidden)")
            self.updated = layer
            return args, {**kwargs, name: _ExchangingCache(kwargs[name], self._kv_swap(layer))}
        return hook

    def _kv_done(self, layer: int):
        def hook(module, args, output):
            if self.updated == layer:
                raise RuntimeError(f"attention of block {layer} did not update its cache; its K/V were not exchanged")
            return None
        return hook

    def _kv_swap(self, layer: int):
        def swap(key, value):
            """key [B, Hk, S, dk], value [B, Hv, S, dv] -> the same with other ranks' rows swapped in."""
            n = self.engine.keys.shape[0]
            B, S = key.shape[0], key.shape[2]
            if B * S != n or value.shape[0] * value.shape[2] != n:
                raise RuntimeError(f"block {layer}: cache update of shape {tuple(key.shape)} does not hold the step's {n} rows")
            k = key.transpose(1, 2).reshape(n, -1)
            v = value.transpose(1, 2).reshape(n, -1)
            expected = self.plan[layer][1]
            if k.shape[1] + v.shape[1] != expected:
                raise RuntimeError(f"block {layer}: the cache stores {k.shape[1]} + {v.shape[1]} elements per token, "
                                   f"the context plan {expected}")
            k, v = self._swap_rows(layer, [k, v])
            self.updated = None
            return (k.view(B, S, key.shape[1], key.shape[3]).transpose(1, 2),
                    v.view(B, S, value.shape[1], value.shape[3]).transpose(1, 2))
        return swap

    # --- the exchange itself ----------------------------------------------------------------
    def _swap_rows(self, layer: int, parts: list) -> list:
        """parts: [n, w_i] row blocks; the rows current here go to every other rank, the rows they
        send replace the placeholders. Returns new tensors (the inputs are not modified)."""
        e = self.engine
        widths = [p.shape[1] for p in parts]
        mine = e.mine.nonzero().flatten()
        dev_mine = mine.to(parts[0].device)
        rows = pack(torch.cat([p[dev_mine].to(torch.float32) for p in parts], dim=1), e.keys[mine][:, None])
        got = e.ex.exchange(e._to_all_others(rows), rows.shape[1], layer, "context")
        out = [p.clone() for p in parts]
        for g in got:
            if g.shape[0] == 0:
                continue
            payload, meta = unpack(g, sum(widths))
            idx = e._rows_of(meta[:, 0].cpu()).to(out[0].device)
            start = 0
            for o, w in zip(out, widths):
                o[idx] = payload[:, start:start + w].to(o.device, o.dtype)
                start += w
        return out
