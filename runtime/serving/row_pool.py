"""The running rows' KV cache in buffers allocated once, for decode steps captured as CUDA graphs
(`model/graph_decode.py`).

Why: a captured graph reads and writes the addresses it was captured at. `RowCache` joins and leaves by making new
tensors (select, pad, concatenate) and the spare-column cache regrows its buffers, so a graph of a decode step
would go stale at the first change of the batch. Here every layer's keys and values live in one pool each,
[R, H, C, d] (R: the most sequences the service runs, C: its context), allocated at the first join and
zero-filled (a padding column is hidden by an additive mask, and 0 x NaN would not be). The library cache's layers
(`growable_cache.GrowableLayer`) hold views of the pools: buffers [B, H, C, d] (the first B rows) and keys, values
[B, H, W, d] (their first W columns); a decode step writes column W in place, eager or captured.

Rows keep `RowCache`'s layout (right-aligned tokens, one width W = the longest row); joins and leaves move rows
and columns inside the pools, touching each row's K/V once, as `RowCache` does:
* leave: the staying rows move to the first rows, in order, and left by the columns none of them needs;
* join: the new rows go after the running ones, right-aligned at width max(W, S) (S: the prefill's columns); the
  running rows first move right by S - W where S > W.
Only caches whose every layer is a full-attention layer with spare columns (`growable_cache.py`) pool; the others
stay with `RowCache`.

Nothing here imports moeplan: bundles run without it.
"""
from __future__ import annotations

import torch

from .row_cache import RowCache


class PoolFull(RuntimeError):
    """A join or a step needs more rows or columns than the pools hold (the scheduler's limits prevent it)."""


class PooledRows(RowCache):
    """`RowCache` over pools of `rows` rows and `columns` columns per layer (module docstring)."""

    def __init__(self, kind: str, rows: int, columns: int):
        super().__init__(kind)
        self.capacity_rows, self.capacity_columns = int(rows), int(columns)
        self.pools = None  # per layer (keys, values) [R, H, C, d], made at the first join

    def pooled(self, cache) -> bool:
        """Whether `cache`'s layers hold views of these pools (a decode step over them keeps its addresses)."""
        return self.pools is not None and cache is self.cache

    def leave(self, seqs) -> None:
        gone = set(seqs) & set(self.seqs)
        if not gone:
            return
        keep = [i for i, s in enumerate(self.seqs) if s not in gone]
        old_width = self.width
        self.seqs = [self.seqs[i] for i in keep]
        self.lengths = [self.lengths[i] for i in keep]
        width = max(self.lengths, default=0)
        if keep:
            index = torch.tensor(keep, dtype=torch.int64, device=self.pools[0][0].device)
            for pool in self._all_pools():  # the staying rows' tokens, gathered first: the moves may overlap
                pool[:len(keep), :, :width].copy_(pool[index, :, old_width - width:old_width])
        self.width = width
        self._bind()

    def join(self, other: RowCache) -> None:
        if not other.seqs:
            return
        layers = other.cache.layers
        if self.pools is None:
            self._allocate(layers)
        B, n = len(self.seqs), len(other.seqs)
        width = max(self.width, other.width)
        if B + n > self.capacity_rows or width > self.capacity_columns:
            raise PoolFull(f"{B + n} rows of {width} columns exceed the KV pools' {self.capacity_rows} rows of "
                           f"{self.capacity_columns} columns")
        if width > self.width and B:
            for pool in self._all_pools():
                pool[:B, :, width - self.width:width].copy_(pool[:B, :, :self.width].clone())
        for (keys, values), layer in zip(self.pools, layers):
            keys[B:B + n, :, width - other.width:width].copy_(layer.keys)
            values[B:B + n, :, width - other.width:width].copy_(layer.values)
        if self.cache is None:
            self.cache = other.cache  # its layers now take views of the pools
        self.seqs += other.seqs
        self.lengths += other.lengths
        self.width = width
        self._bind()

    def advanced(self, cache, columns: int) -> None:
        if self.width + columns > self.capacity_columns:
            raise PoolFull(f"a step to {self.width + columns} columns exceeds the KV pools' {self.capacity_columns}")
        super().advanced(cache, columns)

    def _allocate(self, layers) -> None:
        from ..model.growable_cache import growable_layer_class

        growable = growable_layer_class()
        if not all(type(layer) is growable and layer.is_initialized for layer in layers):
            raise TypeError("KV pools hold full-attention layers with spare columns only (growable_cache.py)")
        R, C = self.capacity_rows, self.capacity_columns
        self.pools = [tuple(t.new_zeros(R, t.shape[1], C, t.shape[3]) for t in (layer.keys, layer.values))
                      for layer in layers]

    def _all_pools(self):
        return [t for pair in self.pools for t in pair]

    def _bind(self) -> None:
        """The cache's layers view the pools' first B rows and W columns (no rows: no cache)."""
        B, W = len(self.seqs), self.width
        if not B:
            self.cache = None
            return
        for layer, (keys, values) in zip(self.cache.layers, self.pools):
            layer._key_buffer, layer._value_buffer = keys[:B], values[:B]
            layer.keys, layer.values = keys[:B, :, :W], values[:B, :, :W]
            layer.pool = (keys, values)
