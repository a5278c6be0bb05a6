"""A service's decode steps captured as CUDA graphs over the KV pools, for a GPU rank alone or GPU ranks of several
whose decode steps gather.

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
* inputs are copied into the graph's own tensors (ids, positions [Bb, 1], key_mask [Bb, Wb], real [Bb]: which rows
  are the step's); every graph writes its logits into the first Bb rows of one buffer [R, 1, V], so no graph keeps
  an output of its own: the buckets' graphs share one memory pool, which holds one step's working set at a time,
  and however many buckets a service captures, their memory is that pool and the buffer (R x V x 2 bytes at bf16:
  19 MB at 64 rows of Qwen3's 151,936 tokens).
The captured function is `CompiledDecode._forward` run eager: the library's forward under the additive mask
(inductor's kernels inside a graph are not measured on a GPU yet). While a bucket's step runs, the engine lets the
MoE blocks see the padding rows (`Engine.padded`); after each step it counts the real rows' slots.

Ranks of several (`ep/gathered_moe.py`: every rank sends every other the same number of rows, two exchanges of fixed
shape per MoE block, inside the graph) must capture, replay and run their exchanges in step. So the worker gives
every rank the same bucket (`share`: the fullest rank's rows and the longest context of any rank, which every rank
knows from the step plans); a rank with no row that step joins the exchanges eager with the bucket's rows. After the
service's warm-up (where every rank captures together) a new bucket is captured with no eager runs before it
(`warm_runs` 0): capture, then replay, is one forward's exchanges on every rank, whoever captures. The padding rows
route nowhere (the static `real`). An exchange counts its bytes as it is traced, which a replay does not do: the
counts of the capture are added again at each later replay. A capture that fails leaves its bucket to run
uncaptured (the same exchanges); `failure` says why.
Without CUDA (tests on CPU ranks) a step runs the same function over the same buckets and pools, uncaptured.

Nothing here imports moeplan: bundles run without it.
"""
from __future__ import annotations

import os
import sys

import torch

from .compiled_decode import CompiledDecode, mark_dynamic

ENV = "MOEPLAN_CUDA_GRAPHS"
FUSED_ENV = "MOEPLAN_GRAPH_INDUCTOR"  # 1: capture inductor's fused kernels instead of the eager ones (not yet measured)
WARM_RUNS = 2  # eager runs of a bucket's step before its capture (on a side stream, as torch.cuda.graph asks)
MIN_COLUMNS = 64


def graphs_wanted() -> bool:
    """`MOEPLAN_CUDA_GRAPHS` is not 0/false/no/off (default: on)."""
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def fused_wanted() -> bool:
    """`MOEPLAN_GRAPH_INDUCTOR` is 1/true/yes/on (default: off, until a GPU has measured it)."""
    return os.environ.get(FUSED_ENV, "0").strip().lower() in ("1", "true", "yes", "on")


def bucket(n: int, cap: int, least: int = 1) -> int:
    """The smallest of least, 1.5 x least, 2 x least, 3 x least, 4 x least, ... (powers of two times `least`, a
    power of two, and 1.5 x them) that holds n, at most `cap`."""
    size = least
    while size < n:
        size = max(size + 1, size * 3 // 2 if size & (size - 1) == 0 else size * 4 // 3)
    return min(size, cap)


class _BucketStep:
    """One bucket's static inputs, its library StaticCache over the pools' views, and its graph."""

    def __init__(self, rows: int, columns: int, pools: list, static_cache, column: torch.Tensor, device):
        self.rows, self.columns = rows, columns
        self.ids = torch.zeros(rows, 1, dtype=torch.int64, device=device)
        self.positions = torch.zeros(rows, 1, dtype=torch.int64, device=device)
        self.key_mask = torch.zeros(rows, columns, dtype=torch.bool, device=device)
        self.real = torch.zeros(rows, dtype=torch.bool, device=device)
        self.pool_rows = pools[0][0].shape[0]
        self.column = column
        self.static = static_cache
        for l, (layer, (keys, values)) in enumerate(zip(static_cache.layers, pools)):
            layer.keys, layer.values = keys[:rows, :, :columns], values[:rows, :, :columns]
            layer.device, layer.is_initialized = keys.device, True
            layer.cumulative_length = column[l]  # a view: one fill sets every layer's write column
        self.graph = None
        self.counts = None  # the exchanges' counts of one step (counted at the capture), added at each later replay

    def fill(self, ids, positions, key_mask, write_column: int) -> None:
        """The step's inputs (B <= rows rows, key_mask [B, W + 1]) into the static tensors; the rest zero."""
        B, width = key_mask.shape
        self.ids.zero_()
        self.positions.zero_()
        self.key_mask.zero_()
        self.real.zero_()
        self.real[:B] = True
        self.ids[:B].copy_(ids)
        self.positions[:B].copy_(positions)
        self.key_mask[:B, :width].copy_(key_mask)
        self.column.fill_(write_column)


class GraphDecode(CompiledDecode):
    """Decode steps over the KV pools, one graph per bucket (module docstring); `padded(rows, real)`: the engine's
    context in which the MoE blocks accept `rows` rows, `real` [rows] saying which are the step's (`Engine.padded`);
    `counters`: the engine's exchange counters (`runtime/counters.py`), where the step exchanges (ranks of several)."""

    def __init__(self, model, cache_kwarg: str, padded, counters=None):
        super().__init__(model, cache_kwarg)
        self.padded, self.counters = padded, counters
        self.buckets: dict = {}
        self.captures = 0  # graphs captured (or, without CUDA, buckets built)
        self.warm_runs = WARM_RUNS
        self.fused = fused_wanted()  # the step's function: inductor's (`_fn`, one graph for every bucket) or eager
        self.shared = None  # (rows, columns) of the bucket every rank's step runs in, where ranks exchange in it
        self._mempool = None
        self._logits = None  # [R, 1, V]: every bucket's step writes its rows' logits here (module docstring)

    def applies(self, cache) -> bool:
        layers = getattr(cache, "layers", None)
        return bool(layers) and all(getattr(layer, "pool", None) is not None for layer in layers)

    def prefills_into(self, cache, ids) -> bool:
        return False  # prefills run eager on a GPU

    def share(self, rows: int, width: int, pool_rows: int, pool_columns: int) -> int:
        """Ranks of several: the next decode step runs in the bucket of `rows` rows (the fullest rank's) and `width`
        columns (the longest row of any rank, plus the step's), on every rank; returns the bucket's rows, which every
        rank sends each other in its exchanges."""
        self.shared = (bucket(rows, pool_rows), bucket(width, pool_columns, MIN_COLUMNS))
        return self.shared[0]

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, key_mask: torch.Tensor, cache) -> torch.Tensor:
        """Logits [B, 1, V] of one decode step (ids, positions [B, 1], key_mask bool [B, W + 1]) over the pools of
        `cache`'s layers, whose views then hold W + 1 columns."""
        B, width = key_mask.shape
        pools = [layer.pool for layer in cache.layers]
        R, C = pools[0][0].shape[0], pools[0][0].shape[2]
        key, self.shared = self.shared or (bucket(B, R), bucket(width, C, MIN_COLUMNS)), None
        step = self.buckets.get(key)
        captured_now = step is None
        if captured_now:
            step = self.buckets[key] = self._build(*key, pools, ids.device)
            self._capture(step, ids, positions, key_mask, width - 1)
        step.fill(ids, positions, key_mask, width - 1)
        if step.graph is not None:
            step.graph.replay()
            if not captured_now and step.counts is not None:
                self.counters.add_counts(step.counts)
        else:
            with self.padded(step.rows, step.real):
                self._step_into_logits(step)
        for layer in cache.layers:
            layer.advance(width)
        self.steps += 1
        return self._logits[:B].clone()

    def _step_into_logits(self, step: _BucketStep) -> None:
        """The bucket's step, its logits [Bb, 1, V] copied into the shared buffer (made at the first step)."""
        logits = self._step(step)
        if self._logits is None:
            self._logits = logits.new_empty((step.pool_rows, *logits.shape[1:]))
        self._logits[:step.rows].copy_(logits)

    def _step(self, step: _BucketStep) -> torch.Tensor:
        """The bucket's forward over its static tensors: inductor's (`fused`; rows and columns dynamic, so one graph
        serves every bucket) or eager. A compiler that raises leaves this step, and every later one, eager."""
        if self.fused:
            mark_dynamic(step.ids, step.positions, step.key_mask, step.static.layers)
            try:
                return self._fn(step.ids, step.positions, step.key_mask, step.static)
            except torch._dynamo.exc.TorchDynamoException as exc:
                self.failure = self.failure or f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
                self.fused = False
        return self._forward(step.ids, step.positions, step.key_mask, step.static)

    def _build(self, rows: int, columns: int, pools: list, device) -> _BucketStep:
        from transformers import StaticCache

        static = StaticCache(config=self.model.config, max_cache_len=1)
        column = torch.zeros(len(pools), dtype=torch.int64, device=device)
        return _BucketStep(rows, columns, pools, static, column, device)

    def _capture(self, step: _BucketStep, ids, positions, key_mask, write_column: int) -> None:
        """On CUDA: `warm_runs` eager runs, then the capture (which runs nothing). They write the step's own column W
        of the pools' first Bb rows, which the replay writes again; rows past B are nobody's. A capture that raises
        leaves the bucket uncaptured."""
        self.captures += 1
        if step.ids.device.type != "cuda":
            return
        with self.padded(step.rows, step.real), torch.no_grad():
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(self.warm_runs):
                    step.fill(ids, positions, key_mask, write_column)
                    self._step_into_logits(step)
            torch.cuda.current_stream().wait_stream(side)
            step.fill(ids, positions, key_mask, write_column)
            if self._mempool is None:
                self._mempool = torch.cuda.graph_pool_handle()  # every bucket's graph shares one memory pool
            before = self.counters.snapshot() if self.counters is not None else None
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph, pool=self._mempool):
                    self._step_into_logits(step)
            except Exception as exc:  # this bucket runs uncaptured: the same exchanges, so ranks stay paired
                if before is not None:
                    self.counters.restore(before)  # what the failed tracing counted moved nothing
                self.failure = self.failure or f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
                print(f"CUDA graph capture of decode bucket ({step.rows} rows, {step.columns} columns) failed, "
                      f"running it uncaptured: {self.failure}", file=sys.stderr, flush=True)
                return
            if before is not None:
                step.counts = self.counters.since(before)
            step.graph = graph
