"""A service's decode steps captured as CUDA graphs over the KV pools, for a GPU rank alone.

Why: eager, the runtime's decode step on an H200 is set by the host dispatching its aten ops (about 94 per decoder
block at 17-18 us each, docs/gpu_checks.md): Qwen3-30B-A3B's 48 blocks took 76 ms at batch 16, where the same step
captured once as a CUDA graph and replayed took 43.7 ms (5.5x less at batch 1, 16 blocks). A graph replays the
kernels it captured at the addresses and shapes it captured, so here:
* K/V: the pools of `serving/row_pool.py` (allocated once, rows right-aligned at one width W); the graph of bucket
  (Bb, Wb) reads their first Bb rows and Wb columns through the library's own `StaticLayer`s, which write the
  step's column W (`cumulative_length`: one entry each of an int64 [L] set before every replay);
* shapes: a step of B rows over W + 1 columns replays the graph of the smallest bucket holding it (`bucket`:
  1, 2, 3, 4, 6, 8, 12, 16, ... rows and 64, 96, 128, 192, ... columns: at most 1.5x of either, and at most the
  pools' sizes), captured the first time a step needs it; padding rows (token 0, no key) run and are dropped,
  padding columns are masked;
* inputs are copied into the graph's own tensors (ids, positions [Bb, 1], key_mask [Bb, Wb]) and the logits out of
  its output [Bb, 1, V].
The captured function is `CompiledDecode._forward` run eager: the library's forward under the additive mask
(inductor's kernels inside a graph are not measured on a GPU yet). Routing stays on the device (a world of one);
while a graph is captured the engine lets the MoE blocks see the padding rows (`Engine.padded`), and after each
step it counts the real rows' slots (`Engine.forward_rows`).
Without CUDA (tests on CPU ranks) a step runs the same function over the same buckets and pools, uncaptured.

Nothing here imports moeplan: bundles run without it.
"""
from __future__ import annotations

import os

import torch

from .compiled_decode import CompiledDecode

ENV = "MOEPLAN_CUDA_GRAPHS"
WARM_RUNS = 2  # eager runs of a bucket's step before its capture (on a side stream, as torch.cuda.graph asks)
MIN_COLUMNS = 64


def graphs_wanted() -> bool:
    """`MOEPLAN_CUDA_GRAPHS` is not 0/false/no/off (default: on)."""
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def bucket(n: int, cap: int, least: int = 1) -> int:
    """The smallest of least, 1.5 x least, 2 x least, 3 x least, 4 x least, ... (powers of two times `least`, a
    power of two, and 1.5 x them) that holds n, at most `cap`."""
    size = least
    while size < n:
        size = max(size + 1, size * 3 // 2 if size & (size - 1) == 0 else size * 4 // 3)
    return min(size, cap)


class _BucketStep:
    """One bucket's static inputs, its library StaticCache over the pools' views, and its graph and logits."""

    def __init__(self, rows: int, columns: int, pools: list, static_cache, column: torch.Tensor, device):
        self.rows, self.columns = rows, columns
        self.ids = torch.zeros(rows, 1, dtype=torch.int64, device=device)
        self.positions = torch.zeros(rows, 1, dtype=torch.int64, device=device)
        self.key_mask = torch.zeros(rows, columns, dtype=torch.bool, device=device)
        self.column = column
        self.static = static_cache
        for l, (layer, (keys, values)) in enumerate(zip(static_cache.layers, pools)):
            layer.keys, layer.values = keys[:rows, :, :columns], values[:rows, :, :columns]
            layer.device, layer.is_initialized = keys.device, True
            layer.cumulative_length = column[l]  # a view: one fill sets every layer's write column
        self.graph = None
        self.logits = None

    def fill(self, ids, positions, key_mask, write_column: int) -> None:
        """The step's inputs (B <= rows rows, key_mask [B, W + 1]) into the static tensors; the rest zero."""
        B, width = key_mask.shape
        self.ids.zero_()
        self.positions.zero_()
        self.key_mask.zero_()
        self.ids[:B].copy_(ids)
        self.positions[:B].copy_(positions)
        self.key_mask[:B, :width].copy_(key_mask)
        self.column.fill_(write_column)


class GraphDecode(CompiledDecode):
    """Decode steps over the KV pools, one graph per bucket (module docstring); `padded(rows)`: the engine's context
    in which the MoE blocks accept `rows` rows (`Engine.padded`)."""

    def __init__(self, model, cache_kwarg: str, padded):
        super().__init__(model, cache_kwarg)
        self.padded = padded
        self.buckets: dict = {}
        self.captures = 0  # graphs captured (or, without CUDA, buckets built)
        self._mempool = None

    def applies(self, cache) -> bool:
        layers = getattr(cache, "layers", None)
        return bool(layers) and all(getattr(layer, "pool", None) is not None for layer in layers)

    def prefills_into(self, cache, ids) -> bool:
        return False  # prefills run eager on a GPU

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, key_mask: torch.Tensor, cache) -> torch.Tensor:
        """Logits [B, 1, V] of one decode step (ids, positions [B, 1], key_mask bool [B, W + 1]) over the pools of
        `cache`'s layers, whose views then hold W + 1 columns."""
        B, width = key_mask.shape
        pools = [layer.pool for layer in cache.layers]
        R, C = pools[0][0].shape[0], pools[0][0].shape[2]
        key = (bucket(B, R), bucket(width, C, MIN_COLUMNS))
        step = self.buckets.get(key)
        if step is None:
            step = self.buckets[key] = self._build(*key, pools, ids.device)
            self._capture(step, ids, positions, key_mask, width - 1)
        step.fill(ids, positions, key_mask, width - 1)
        if step.graph is not None:
            step.graph.replay()
        else:
            with self.padded(step.rows):
                step.logits = self._forward(step.ids, step.positions, step.key_mask, step.static)
        for layer in cache.layers:
            layer.advance(width)
        self.steps += 1
        return step.logits[:B].clone()

    def _build(self, rows: int, columns: int, pools: list, device) -> _BucketStep:
        from transformers import StaticCache

        static = StaticCache(config=self.model.config, max_cache_len=1)
        column = torch.zeros(len(pools), dtype=torch.int64, device=device)
        return _BucketStep(rows, columns, pools, static, column, device)

    def _capture(self, step: _BucketStep, ids, positions, key_mask, write_column: int) -> None:
        """On CUDA: warm-up runs, then the capture (which runs nothing). They write the step's own column W of the
        pools' first Bb rows, which the replay writes again; rows past B are nobody's."""
        self.captures += 1
        if step.ids.device.type != "cuda":
            return
        with self.padded(step.rows), torch.no_grad():
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(WARM_RUNS):
                    step.fill(ids, positions, key_mask, write_column)
                    self._forward(step.ids, step.positions, step.key_mask, step.static)
            torch.cuda.current_stream().wait_stream(side)
            step.fill(ids, positions, key_mask, write_column)
            if self._mempool is None:
                self._mempool = torch.cuda.graph_pool_handle()  # every bucket's graph shares one memory pool
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._mempool):
                step.logits = self._forward(step.ids, step.positions, step.key_mask, step.static)
            step.graph = graph
