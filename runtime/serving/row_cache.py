"""This rank's running sequences as the rows of the library's own KV cache, so that a sequence can
join or leave a running batch.

The library's cache (transformers' `DynamicCache`, its full-attention layers with spare columns,
`model/growable_cache.py`; TinyMoE's list of per-block dicts) holds K/V as [B, H, W, d] tensors, one row
per sequence, columns shared by every row (the library's masks count causality in columns). Each row keeps its tokens right-aligned: row b's n_b tokens fill the last
n_b of the W columns, the columns before them are padding hidden by the key mask (the layout of a
left-padded batch, which the library's attention already runs: transformers' `generate` pads so).
Every decode step appends one column to every row, so a row's tokens stay contiguous.

* `leave(rows)`: the rows that stay are selected along the batch dimension, then columns that are
  padding in every remaining row are cut from the left (W = the longest remaining row).
* `join(other)`: the rows of a cache just filled by a prefill forward are appended; the narrower
  of the two is padded on the left to the other's width.
Both touch each K/V tensor once; they run only at the steps where sequences join or leave.

Sliding-window layers (transformers' `DynamicSlidingWindowLayer`: Mixtral or Phi-3.5-MoE with a
window, gpt-oss's alternate layers) keep only the last window - 1 columns and count every column
they saw (`cumulative_length`, from which the library places its masks); the same cuts and pads
apply to their last columns and their count follows W. A row's tokens sit in consecutive columns,
so a window in columns is the window in positions. Refused: linear attention (recurrent state,
no columns) and chunked attention (Llama-4: chunk borders are counted in columns, which padding
shifts).

Why not transformers' own continuous batching (`transformers/generation/continuous_batching/`,
5.24: `ContinuousBatchingManager` over a `PagedAttentionCache`): see `engine_loop.py`'s docstring.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


class UnsupportedCache(Exception):
    """The model's cache has layers whose rows cannot be moved by column (sliding window, linear attention)."""


def check_cache_layers(model, kind: str) -> None:
    """Raise UnsupportedCache unless every layer of the cache the library builds for `model` is a
    full-attention or sliding-window layer this module moves (TinyMoE's dict cache always is)."""
    if kind == "tiny_moe":
        return
    from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer

    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    if getattr(text, "attention_chunk_size", None):
        raise UnsupportedCache("continuous batching cannot move rows of chunked-attention caches (the library counts "
                               "chunk borders in cache columns, which a batch's padding shifts)")
    layers = DynamicCache(config=model.config).layers
    other = sorted({type(layer).__name__ for layer in layers
                    if type(layer) not in (DynamicLayer, DynamicSlidingWindowLayer)})
    if other:
        raise UnsupportedCache(f"continuous batching moves full-attention and sliding-window KV cache rows only; this "
                               f"model's cache has {', '.join(other)} layers (linear attention)")


def _tensors(cache, kind: str):
    """(holder, attribute, columns kept at most or None) of every K/V tensor [B, H, W, d] of the cache."""
    if kind == "tiny_moe":
        return [(block, name, None) for block in cache for name in ("k", "v") if name in block]
    out = []
    for layer in cache.layers:
        if getattr(layer, "is_initialized", False) and layer.keys is not None and layer.keys.numel():
            cap = layer.sliding_window - 1 if getattr(layer, "is_sliding", False) else None
            out += [(layer, "keys", cap), (layer, "values", cap)]
    return out


def _count_columns(cache, kind: str, width: int) -> None:
    """Sliding-window layers count every column they saw: W after a cut or a pad."""
    if kind != "tiny_moe":
        for layer in cache.layers:
            if hasattr(layer, "cumulative_length"):
                layer.cumulative_length = width


def _kept(width: int, cap) -> int:
    return width if cap is None else min(width, cap)


def _get(holder, name):
    return holder[name] if isinstance(holder, dict) else getattr(holder, name)


def _set(holder, name, value) -> None:
    if isinstance(holder, dict):
        holder[name] = value
    else:
        setattr(holder, name, value)


class RowCache:
    """The library cache of this rank's rows, with per-row sequence ids and token counts."""

    def __init__(self, kind: str):
        self.kind = kind
        self.cache = None
        self.seqs: list = []     # sequence id per row
        self.lengths: list = []  # tokens held per row (right-aligned)
        self.width = 0           # columns W

    def __len__(self) -> int:
        return len(self.seqs)

    def leave(self, seqs) -> None:
        """Drop the rows of `seqs` (ids not held here are ignored) and the columns nobody needs."""
        gone = set(seqs) & set(self.seqs)
        if not gone:
            return
        keep = [i for i, s in enumerate(self.seqs) if s not in gone]
        self.seqs = [self.seqs[i] for i in keep]
        self.lengths = [self.lengths[i] for i in keep]
        if not keep:
            self.cache, self.width = None, 0
            return
        index = torch.tensor(keep, dtype=torch.int64)
        width = max(self.lengths)
        for holder, name, cap in _tensors(self.cache, self.kind):
            t = _get(holder, name)
            kept = _kept(width, cap)
            _set(holder, name, t.index_select(0, index.to(t.device))[..., t.shape[-2] - kept:, :].contiguous())
        _count_columns(self.cache, self.kind, width)
        self.width = width

    def join(self, other: RowCache) -> None:
        """Append `other`'s rows (a cache filled by a prefill forward) after this cache's rows."""
        if not other.seqs:
            return
        if not self.seqs:
            self.cache, self.seqs, self.lengths, self.width = other.cache, list(other.seqs), list(other.lengths), other.width
            return
        width = max(self.width, other.width)
        mine, theirs = _tensors(self.cache, self.kind), _tensors(other.cache, other.kind)
        if len(mine) != len(theirs):
            raise RuntimeError(f"caches to join hold {len(mine)} and {len(theirs)} K/V tensors")
        for (holder, name, cap), (o_holder, o_name, _) in zip(mine, theirs):
            a, b = _get(holder, name), _get(o_holder, o_name)
            kept = _kept(width, cap)
            a = F.pad(a, (0, 0, kept - a.shape[-2], 0)) if kept > a.shape[-2] else a
            b = F.pad(b, (0, 0, kept - b.shape[-2], 0)) if kept > b.shape[-2] else b
            _set(holder, name, torch.cat([a, b.to(a.device, a.dtype)], dim=0))
        _count_columns(self.cache, self.kind, width)
        self.seqs += other.seqs
        self.lengths += other.lengths
        self.width = width

    # --- step inputs ----------------------------------------------------------------------------
    def decode_mask(self) -> torch.Tensor:
        """key_mask [B, W + 1] of a decode step: each row's tokens and its new one."""
        cols = torch.arange(self.width + 1)
        start = torch.tensor([self.width - n for n in self.lengths])
        return cols[None, :] >= start[:, None]

    def advanced(self, cache, columns: int) -> None:
        """After a forward that appended `columns` columns to every row (all of them real tokens)."""
        self.cache = cache
        self.width += columns
        self.lengths = [n + columns for n in self.lengths]


def left_pad_mask(lens: list) -> torch.Tensor:
    """bool [n, max(lens)]: True on each row's last lens[b] columns, its tokens (left padding is False).
    The prefill's key mask here and in a Lambda execution's steps (`lambda_/decode.py`)."""
    width = max(lens)
    return torch.arange(width)[None, :] >= (width - torch.tensor(lens))[:, None]


def prefill_inputs(prompts: list) -> tuple:
    """Left-padded prompts: ids, positions, key_mask [n, S] (S = the longest prompt)."""
    mask = left_pad_mask([len(p) for p in prompts])
    ids = torch.zeros(mask.shape, dtype=torch.int64)
    pos = torch.zeros(mask.shape, dtype=torch.int64)
    for b, p in enumerate(prompts):
        n = len(p)
        ids[b, mask.shape[1] - n:] = torch.tensor(p, dtype=torch.int64)
        pos[b, mask.shape[1] - n:] = torch.arange(n)
    return ids, pos, mask
