"""The library's full-attention KV cache layer with spare columns, so a decode step writes its column
instead of copying the whole cache.

transformers' `DynamicLayer.update` (5.24, `cache_utils.py`) appends a step's K/V with `torch.cat`, which
copies every cached key and value of the layer at every step: O(context) bytes per step and layer, the
cache read and written once more than attention reads it. `GrowableLayer` keeps `keys`/`values` as views
[B, H, n, d] of buffers [B, H, capacity, d] and writes a step's columns into the spare ones; when they run
out (or when the rows were replaced from outside: `row_cache.py` selects, pads and concatenates rows when
sequences join or leave) it moves the rows into a new buffer with a quarter more columns (at least
`MIN_SPARE`), so the copies are amortised to a fraction of a column per step. Everything else (masks,
lengths, reordering, cropping) is the library's `DynamicLayer`, reading the views. Sliding-window and
other layer types stay the library's own. The layers of multi-head latent attention (DeepSeek-V2/V3, configs with
`kv_lora_rank`: transformers 5 caches the latent [B, 1, n, kv_lora_rank] as keys and the rotary key
[B, 1, n, rope dim] as values) stay the library's in eager steps: every step projects the whole latent
(`kv_b_proj`), and a linear layer copies a view of a buffer into a contiguous tensor first, so the concatenation's
copy comes back as a clone and the spare columns save nothing (counted: 2 aten ops more per block). Where decode
steps are compiled or captured (`latents=True`: a service's `compiled_decode.py` / `graph_decode.py`), they are
spare-column layers too: those steps need K/V at fixed addresses, which the library's concatenation never gives.

Nothing here imports moeplan: bundles run without it.
"""
from __future__ import annotations

from functools import lru_cache

import torch

MIN_SPARE = 64  # columns added at least when a buffer grows


def growable_cache(config, max_columns: int, latents: bool = False):
    """transformers' `DynamicCache` for `config` with every plain full-attention layer a `GrowableLayer` whose
    buffers hold at most `max_columns` columns (more only when the rows themselves need them): a service passes
    its planned max context, so the spare columns never take memory the plan's capacity did not count.
    `latents`: MLA's layers too (module docstring), for compiled or captured decode steps."""
    from transformers.cache_utils import DynamicCache, DynamicLayer

    cache = DynamicCache(config=config)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if getattr(text, "kv_lora_rank", None) and not latents:  # MLA in eager steps (module docstring): the library's
        return cache
    growable = growable_layer_class()
    cache.layers = [growable(max_columns) if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


def growable_throughout(config) -> bool:
    """Whether every layer of the cache `growable_cache` builds for `config`'s compiled or captured decode steps is a
    `GrowableLayer` (no sliding windows, chunked or linear attention): what KV pools and those steps hold."""
    growable, layers = growable_layer_class(), growable_cache(config, 1, latents=True).layers
    return bool(layers) and all(type(layer) is growable for layer in layers)


def _spare_columns(needed: int) -> int:
    return max(MIN_SPARE, needed // 4)


@lru_cache(maxsize=1)
def growable_layer_class():
    """The `GrowableLayer` class (made on first use: transformers loads only where a library model runs)."""
    from transformers.cache_utils import DynamicLayer

    class GrowableLayer(DynamicLayer):
        """`DynamicLayer` over buffers with spare columns (module docstring)."""

        def __init__(self, max_columns: int):
            super().__init__()
            self.max_columns = int(max_columns)

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
            """key_states, value_states [B, H, s, d] -> all of the layer's keys, values [B, H, n + s, d]."""
            if not self.is_initialized or self.keys is None or self.keys.numel() == 0:
                return super().update(key_states, value_states, *args, **kwargs)
            n, s = self.keys.shape[-2], key_states.shape[-2]
            if not self._fits(n + s):
                self._regrow(n + s)
            self._key_buffer[..., n:n + s, :].copy_(key_states)
            self._value_buffer[..., n:n + s, :].copy_(value_states)
            self.keys = self._key_buffer[..., :n + s, :]
            self.values = self._value_buffer[..., :n + s, :]
            return self.keys, self.values

        def reserve(self, columns: int) -> tuple:
            """The layer's buffers (keys, values [B, H, capacity, d]) with room for `columns` columns and at least
            one more, the current ones first: where a compiled decode step (`compiled_decode.py`) writes its column
            itself. The spare column keeps the step's views [B, H, columns, d] of the buffers never contiguous: a
            view that is (capacity = columns) takes another path through the library's matmul, which dynamo guards
            on, and the graph would be compiled again mid-service (1.5-8 s on a 2-core CPU) the first time a step
            filled its buffers."""
            if not self._fits(columns + 1):
                self._regrow(columns + 1)
            return self._key_buffer, self._value_buffer

        def adopt(self, batch: int, heads: int, key_dim: int, value_dim: int, dtype, device, columns: int) -> tuple:
            """Fresh buffers (keys [B, H, capacity, dk], values [B, H, capacity, dv]) with room for `columns` columns
            and spare ones, for a compiled prefill (`compiled_decode.py`) to write; `advance` then takes them."""
            capacity = max(columns + 1, min(columns + _spare_columns(columns), self.max_columns))  # see `reserve`
            self._key_buffer = torch.empty(batch, heads, capacity, key_dim, dtype=dtype, device=device)
            self._value_buffer = torch.empty(batch, heads, capacity, value_dim, dtype=dtype, device=device)
            self.device, self.is_initialized = device, True
            return self._key_buffer, self._value_buffer

        def advance(self, columns: int) -> None:
            """The views after a step wrote into the buffers directly: the first `columns` columns."""
            self.keys = self._key_buffer[..., :columns, :]
            self.values = self._value_buffer[..., :columns, :]

        def _fits(self, columns: int) -> bool:
            """The views are still the first columns of this layer's buffers, which hold `columns`."""
            buffers = getattr(self, "_key_buffer", None), getattr(self, "_value_buffer", None)
            for view, buffer in zip((self.keys, self.values), buffers):
                if (buffer is None or view.data_ptr() != buffer.data_ptr() or view.shape[:2] != buffer.shape[:2]
                        or view.shape[-1] != buffer.shape[-1] or view.stride() != buffer.stride()
                        or view.dtype != buffer.dtype or buffer.shape[-2] < columns):
                    return False
            return True

        def _regrow(self, columns: int) -> None:
            """New buffers of `columns` + spare columns, the current rows copied into their first columns."""
            capacity = max(columns, min(columns + _spare_columns(columns), self.max_columns))
            n = self.keys.shape[-2]
            for name in ("keys", "values"):
                view = getattr(self, name)
                b, h, _, d = view.shape
                buffer = view.new_empty((b, h, capacity, d))
                buffer[..., :n, :].copy_(view)
                setattr(self, f"_{name[:-1]}_buffer", buffer)
                setattr(self, name, buffer[..., :n, :])

    return GrowableLayer
