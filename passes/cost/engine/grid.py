"""Which queries aiconfigurator-core's measured tables cover, read from the tables themselves.

Why: beyond a table's measured range the database extrapolates (it holds the edge's efficiency and
scales the speed-of-light time) and still tags the result `silicon`, so a price must not be called
measured just because the database answered. This module reads the measured axes of each table
(pyarrow, columns only, once per process) and gives, for an op, the op clamped to the measured range
of its own key (heads, head dim, KV dtype, window for attention; the full MoE key for the fused MoE).
`pricing.py` prices an op whose clamp changed it as the roofline scaled by the measured efficiency at
the edge, and says so in its source.

Tables (aiconfigurator-core 0.12.0, `systems/data/<system>/<family>/<backend>/<version>/*.parquet`;
older version folders fill in what the named version lacks, as the database's shared layer does, so
every version up to the named one is read):
gemm_perf (m, n, k per gemm_dtype), moe_perf (num_tokens per key), generation_attention_perf and
context_attention_perf (batch_size, isl + step per heads/kv heads/head dim/KV dtype/window),
generation_mla_perf and context_mla_perf (batch_size, isl + step per heads/KV dtype), mla_bmm_perf
(num_tokens), custom_allreduce_perf and nccl_perf (num_gpus).
"""
from __future__ import annotations

import functools
from dataclasses import replace
from pathlib import Path

from moeplan.passes.cost.engine import ops as O

KV_NAMES = {"bfloat16": "bfloat16", "float16": "bfloat16", "fp8": "fp8"}


def _version_key(text: str):
    from packaging.version import Version

    return Version(text)


class Grid:
    """Axis ranges of the measured tables of one (system, backend, version)."""

    def __init__(self, root: Path, backend: str, version: str):
        self.root, self.backend, self.version = Path(root), backend, version

    def _files(self, family: str, name: str, backend: str | None = None) -> list:
        """The table `name` of `family` in every version folder up to the named version."""
        folder = self.root / family / (backend or self.backend)
        if not folder.is_dir():
            return []
        limit = _version_key(self.version) if backend is None else None
        out = []
        for sub in sorted(folder.iterdir()):
            try:
                newer = limit is not None and _version_key(sub.name) > limit
            except ValueError:
                continue
            if not newer and (sub / name).is_file():
                out.append(sub / name)
        return out

    @functools.cache  # noqa: B019 (one Grid per database, kept for the process)
    def _table(self, family: str, name: str, columns: tuple, backend: str | None = None) -> list:
        """Rows (tuples of `columns`) of every version's table."""
        import pyarrow.parquet as pq

        rows = []
        for path in self._files(family, name, backend):
            table = pq.read_table(path, columns=list(columns)).to_pydict()
            rows += list(zip(*(table[c] for c in columns)))
        return rows

    @functools.cache  # noqa: B019
    def _maxima(self, family: str, name: str, key: tuple, axes: tuple, backend: str | None = None) -> dict:
        """{key values: (max of each axis)} over the table's rows."""
        out = {}
        for row in self._table(family, name, key + axes, backend):
            k, values = row[:len(key)], row[len(key):]
            old = out.get(k)
            out[k] = values if old is None else tuple(max(a, b) for a, b in zip(old, values))
        return out

    def _nccl_root(self) -> Path:
        return self.root / "comm" / "nccl"

    def clamp(self, op):
        """`op` with its interpolated axes clamped into the measured range of its key; `op` itself where it
        lies inside; None where the key was never measured (the database raises for those, or, for keys
        this module does not read, answers as it does)."""
        if isinstance(op, O.Gemm):
            table = self._maxima("gemm", "gemm_perf.parquet", ("gemm_dtype",), ("m", "n", "k"))
            top = table.get((op.quant,))
            return None if top is None else replace(op, tokens=min(op.tokens, top[0]), n=min(op.n, top[1]), k=min(op.k, top[2]))
        if isinstance(op, O.FusedMoe):
            key = (op.quant, op.hidden, op.inter, op.top_k, op.experts, op.moe_tp, op.moe_ep, op.distribution)
            table = self._maxima("moe", "moe_perf.parquet", ("moe_dtype", "hidden_size", "inter_size", "topk", "num_experts",
                                                              "moe_tp_size", "moe_ep_size", "distribution"), ("num_tokens",))
            top = table.get(key)
            return None if top is None else replace(op, tokens=min(op.tokens, top[0]))
        if isinstance(op, O.Attention):
            name = "generation_attention_perf.parquet" if op.phase == O.DECODE else "context_attention_perf.parquet"
            table = self._maxima("attention", name, ("num_heads", "num_key_value_heads", "head_dim", "kv_cache_dtype",
                                                     "window_size"), ("batch_size", "isl", "step"))
            top = table.get((op.q_heads, op.kv_heads, op.head_dim, KV_NAMES.get(op.kv_dtype), op.window))
            if top is None:
                return None
            if op.phase == O.DECODE:
                return replace(op, batch=min(op.batch, top[0]), kv_len=min(op.kv_len, top[1] + top[2]))
            return replace(op, batch=min(op.batch, top[0]), new_tokens=min(op.new_tokens, top[1]),
                           kv_len=min(op.kv_len, top[2]))
        if isinstance(op, O.MlaAttention):
            name = "generation_mla_perf.parquet" if op.phase == O.DECODE else "context_mla_perf.parquet"
            table = self._maxima("mla", name, ("num_heads", "kv_cache_dtype"), ("batch_size", "isl", "step"))
            top = table.get((op.heads, KV_NAMES.get(op.kv_dtype)))
            if top is None:
                return None
            if op.phase == O.DECODE:
                return replace(op, batch=min(op.batch, top[0]), kv_len=min(op.kv_len, top[1] + top[2]))
            return replace(op, batch=min(op.batch, top[0]), new_tokens=min(op.new_tokens, top[1]))
        if isinstance(op, O.MlaBmm):
            table = self._maxima("mla_bmm", "mla_bmm_perf.parquet", ("num_heads",), ("num_tokens",))
            top = table.get((op.heads,))
            return None if top is None else replace(op, tokens=min(op.tokens, top[0]))
        if isinstance(op, O.AllReduce) or (isinstance(op, O.MoeGather) and op.attention_dp == 1):
            ranks = op.ranks if isinstance(op, O.AllReduce) else op.moe_tp * op.moe_ep
            table = self._maxima("comm", "custom_allreduce_perf.parquet", (), ("num_gpus",))
            top = table.get(())
            return op if top is None or ranks <= top[0] else None
        if isinstance(op, O.Collective) or isinstance(op, O.MoeGather):
            ranks = op.ranks if isinstance(op, O.Collective) else op.moe_tp * op.moe_ep
            most = _nccl_max_gpus(self._nccl_root())
            return op if most is None or ranks <= most else None
        return op


@functools.cache
def _nccl_max_gpus(root: Path) -> int | None:
    """The most GPUs any NCCL table of the system measured (read once)."""
    import pyarrow.parquet as pq

    counts = [n for path in sorted(root.glob("*/nccl_perf.parquet"))
              for n in pq.read_table(path, columns=["num_gpus"]).column("num_gpus").to_pylist()]
    return max(counts) if counts else None
