"""A decode step of the library's model as one compiled graph (torch.compile, inductor) over the KV cache's
fixed buffers, for CPU ranks: alone, or several whose decode steps gather.

Why: eager, the runtime's decode step of qwen3_moe_hd32 at batch 1 is ~300 aten ops at ~20 us each on a
2-core CPU (about 6 ms a token); its tensors are tiny, so the time is dispatch. Compiled, inductor fuses
the step into a few C++ loops (docs/serving.md "Compiled decode steps" has the figures).

What makes the step one graph of fixed shapes:
* K/V: views [B, H, W + 1, d] of the spare-column cache's buffers (`growable_cache.py`: W columns held, room
  for one more), handed to the library's own `StaticLayer` (transformers' cache layer built for
  torch.compile), which writes the step's column in place (`index_copy_` at a 0-d tensor) and returns them;
  attention reads them under an additive mask [B, 1, 1, W + 1] hiding each row's left padding;
* routing stays on the device (a world of one: `Engine._one_rank`; several ranks: `gathered_moe.py`); the
  engine counts the step's slots after the forward, outside the graph;
* batch B and columns W + 1 are dynamic dimensions (the views' strides, which the buffers' capacities set,
  are symbolic with them): one graph serves every batch and context (a batch of one gets its own, as torch
  specialises sizes 0 and 1); tests/test_compiled_decode.py checks that joins, departures and regrown
  buffers recompile nothing.
The library's modules run unchanged inside the graph: inductor compiles their own code.

Where it runs (`CompiledDecode.applies`): transformers models whose every cache layer is a plain
full-attention layer with spare columns (MLA's latents too, `growable_cache.py`; not sliding windows), decode
steps (one token per row) of an engine that records nothing (a service) on the CPU, alone or over several ranks
whose decode steps gather (`ep/gathered_moe.py`: their exchanges are one op of fixed shapes inside the graph),
with a C++ compiler at hand (inductor builds its kernels with it). Everything else, and `MOEPLAN_COMPILE=0`, stays eager.

Nothing here imports moeplan: bundles run without it.
"""
from __future__ import annotations

import os
import shutil
import warnings

import torch
import torch.fx.experimental._config  # use_duck_shape (below)

ENV = "MOEPLAN_COMPILE"


def compile_wanted() -> bool:
    """`MOEPLAN_COMPILE` is not 0/false/no/off (default: on)."""
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def compiler_missing() -> str | None:
    """Why inductor cannot build CPU kernels here (no C++ compiler on PATH), or None."""
    name = os.environ.get("CXX", "g++")
    return None if shutil.which(name) else f"no C++ compiler ({name}) on PATH for torch.compile's CPU kernels"


class CompiledDecode:
    """The compiled decode step of one library model (module docstring)."""

    def __init__(self, model, cache_kwarg: str):
        from transformers import StaticCache

        self.model, self.kwarg = model, cache_kwarg
        self.dtype = next(model.parameters()).dtype
        self._static = StaticCache(config=model.config, max_cache_len=1)  # the library's layers, given our buffers
        # batch and columns are marked dynamic one by one (`mark_dynamic`); the other sizes stay constants.
        # Duck sizing would make equal sizes one symbol (a batch of 2 and 2 K/V heads) and recompile when they part.
        torch.fx.experimental._config.use_duck_shape = False
        # grouped_attention's functools caches hold pure functions of a module's class (its eager function's bytecode):
        # tracing through them, as dynamo warns it does, gives what they hold
        warnings.filterwarnings("ignore", message="Dynamo detected a call to a `functools.lru_cache`")
        self._fn = torch.compile(self._forward)
        self._prefill_fn = torch.compile(self._prefill_forward)
        self.steps = 0  # decode steps it ran (a test's and a benchmark's witness)
        self.prefills = 0  # prefills it ran
        self.failure = None  # what the compiler raised, if it did: the steps since run eager
        self._kv = None  # per layer (K/V heads, key dim, value dim, dtype), read off the first cache it ran

    def applies(self, cache) -> bool:
        """Whether `cache` (the library's, after a prefill) is one whose steps this graph can run."""
        from .growable_cache import growable_layer_class

        layers = getattr(cache, "layers", None)
        growable = growable_layer_class()
        runs = bool(layers) and len(layers) == len(self._static.layers) and all(
            type(layer) is growable and layer.is_initialized and layer.keys is not None and layer.keys.numel()
            for layer in layers)
        if runs and self._kv is None:
            self._kv = [(layer.keys.shape[1], layer.keys.shape[3], layer.values.shape[3], layer.keys.dtype)
                        for layer in layers]
        return runs

    def prefills_into(self, cache, ids: torch.Tensor) -> bool:
        """Whether a prefill of ids [B, S] into `cache` (a fresh one of the library's) runs compiled: its layers all
        full-attention ones with spare columns, the K/V shapes known from a cache it ran before, and S >= 2 (a
        prompt of one token prefills as eager as a decode step of one)."""
        from .growable_cache import growable_layer_class

        layers = getattr(cache, "layers", None)
        return (self._kv is not None and ids.shape[1] >= 2 and bool(layers) and len(layers) == len(self._kv)
                and all(type(layer) is growable_layer_class() and not layer.is_initialized for layer in layers))

    def prefill(self, ids: torch.Tensor, positions: torch.Tensor, key_mask: torch.Tensor, cache) -> torch.Tensor:
        """Logits [B, S, V] of a prefill into the fresh `cache`: ids, positions, key_mask bool [B, S] (prompts
        right-aligned). Its layers get buffers of S columns and spare ones, which the graph fills through the
        library's `StaticLayer` from column 0."""
        B, S = ids.shape
        buffers = [layer.adopt(B, heads, dk, dv, dtype, ids.device, S)
                   for layer, (heads, dk, dv, dtype) in zip(cache.layers, self._kv)]
        for tensor in (ids, positions):
            torch._dynamo.maybe_mark_dynamic(tensor, 1)
        logits = self._through_static(buffers, S, 0, "_prefill_fn", "_prefill_forward", ids, positions, key_mask, cache)
        self.prefills += 1
        return logits

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, key_mask: torch.Tensor, cache) -> torch.Tensor:
        """Logits [B, 1, V] of one decode step: ids, positions [B, 1], key_mask bool [B, W + 1] (each row's tokens,
        right-aligned, and the new one); the cache's layers hold W columns before, W + 1 after."""
        width = key_mask.shape[1]
        buffers = [layer.reserve(width) for layer in cache.layers]
        logits = self._through_static(buffers, width, width - 1, "_fn", "_forward", ids, positions, key_mask, cache)
        self.steps += 1
        return logits

    def _through_static(self, buffers: list, columns: int, first: int, compiled: str, eager: str, ids, positions,
                        key_mask, cache) -> torch.Tensor:
        """Run `compiled` (`_run`) with the library's `StaticLayer`s reading views of the first `columns` columns of
        the cache's buffers (per layer keys, values [B, H, capacity, d]) and writing the step's from column `first`;
        then the cache's layers take the columns written."""
        for mine, (keys, values) in zip(self._static.layers, buffers):
            mine.keys, mine.values = keys[..., :columns, :], values[..., :columns, :]  # views: attention reads these
            mine.device = keys.device
            mine.cumulative_length = torch.tensor(first, device=keys.device)  # where this step writes
            mine.is_initialized = True
        mark_dynamic(ids, positions, key_mask, self._static.layers)
        logits = self._run(compiled, eager, ids, positions, key_mask)
        for mine, layer in zip(self._static.layers, cache.layers):
            layer.advance(columns)
            mine.keys = mine.values = None  # the buffers belong to the cache
        return logits

    def _run(self, compiled: str, eager: str, ids, positions, key_mask) -> torch.Tensor:
        """The compiled function named `compiled` on the step; if the compiler raises (while tracing or compiling,
        before the step ran) the same step eager, and the eager function from then on, so that ranks whose exchanges
        pair up stay in step; the warm-up reads `failure` and turns compiled steps off."""
        try:
            return getattr(self, compiled)(ids, positions, key_mask, self._static)
        except torch._dynamo.exc.TorchDynamoException as exc:
            self.failure = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            setattr(self, compiled, getattr(self, eager))
            return getattr(self, compiled)(ids, positions, key_mask, self._static)

    def _prefill_forward(self, ids, positions, key_mask, static):
        """The traced prefill: the additive causal mask over the prompt's columns, a row with no key to see (left
        padding) seeing every column, as the library's own mask has it (no row all masked), then the library's
        forward."""
        S = ids.shape[1]
        index = torch.arange(S, device=ids.device)
        allowed = key_mask[:, None, :] & (index[None, :, None] >= index[None, None, :])          # [B, S, S]
        allowed = allowed | ~allowed.any(dim=-1, keepdim=True)
        mask = torch.zeros(allowed.shape, dtype=self.dtype, device=ids.device)
        mask = mask.masked_fill(~allowed, torch.finfo(self.dtype).min)[:, None]                    # [B, 1, S, S]
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                         **{self.kwarg: static})
        return out.logits

    def _forward(self, ids, positions, key_mask, static):
        """The traced step: the additive mask of the step's columns, then the library's forward."""
        mask = torch.zeros(key_mask.shape, dtype=self.dtype, device=key_mask.device)
        mask = mask.masked_fill(~key_mask, torch.finfo(self.dtype).min)[:, None, None, :]          # [B, 1, 1, W + 1]
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                         **{self.kwarg: static})
        return out.logits


def mark_dynamic(ids, positions, key_mask, layers) -> None:
    """Batch (every input's dim 0) and columns (key_mask's dim 1, the K/V views' dim 2) as dynamic sizes;
    `maybe_`: a batch of one may still get a graph of its own."""
    mark = torch._dynamo.maybe_mark_dynamic
    for tensor in (ids, positions, key_mask):
        mark(tensor, 0)
    mark(key_mask, 1)
    for layer in layers:
        for tensor in (layer.keys, layer.values):
            mark(tensor, 0)
            mark(tensor, 2)
