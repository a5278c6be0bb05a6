"""Kernel times measured on real GPUs: aiconfigurator-core's database, through its per-op API.

aiconfigurator-core 0.12.0 (NVIDIA, Apache-2.0; `pip install 'moeplan[gpu]'`) ships kernel timings
of SGLang, vLLM and TensorRT-LLM collected on H100, H200 and other GPUs, and answers one op at a time:
`get_database(system, backend, version)`, `EngineHandle.for_database(db).evaluate_ops_json(ops,
is_context, batch_size, s, prefix, x)` -> [(name, ms, energy, source)] (aiconfigurator_core/sdk/
perf_database.py, sdk/engine.py). It is optional: imported on first use and kept for the process;
where it is absent every op is priced by the roofline.

Each of our ops (`ops.py`) becomes the database's op of the same kernel, with the token count as `x`
(GEMMs, MoE, collectives), or batch and KV length (attention). The database's answer is used where
the op lies inside the measured range of its key (`grid.py`); `MeasuredPrice.source` says which
database it came from and whether the database called it measured (`silicon`, `mixed`) or analytic
(`empirical`, `sol`: its element-wise and embedding ops are a bandwidth formula).
"""
from __future__ import annotations

import functools
import importlib.metadata
import json
import logging
from dataclasses import dataclass
from pathlib import Path

from moeplan.passes.cost.engine import ops as O

PACKAGE = "aiconfigurator-core"
PINNED = "0.12.0"
MEASURED_TAGS = ("silicon", "mixed")
# our precision names -> the database's enum names (GEMMs and the fused MoE); absent: not measured
GEMM_QUANT = {"bfloat16": "bfloat16", "float16": "bfloat16", "fp8": "fp8", "fp8_block": "fp8_block"}
MOE_QUANT = {"bfloat16": "bfloat16", "float16": "bfloat16", "fp8_block": "fp8_block", "mxfp4": "w4a16_mxfp4",
             "int4": "int4_wo", "fp8": "fp8"}
KV_QUANT = {"bfloat16": "bfloat16", "float16": "bfloat16", "fp8": "fp8"}
# DeepSeek's MLA is what the mla tables measured: latent 512 + rotary 64, 128 + 64 qk, 128 v
MLA_MEASURED = (512, 64, 128, 128)


@dataclass(frozen=True)
class MeasuredPrice:
    seconds: float
    tag: str        # the database's source tag


@functools.cache
def installed_version() -> str | None:
    """The installed aiconfigurator-core's version, or None (read once per process)."""
    try:
        return importlib.metadata.version(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return None


@functools.cache
def tables(system: str, backend: str, version: str):
    """The measured tables of (system, backend, version), loaded once per process; None where
    aiconfigurator-core is not installed or has no such database."""
    if installed_version() is None:
        return None
    logging.disable(logging.WARNING)  # the database logs "Loading low-fidelity fallback rows ..." per family
    try:
        from aiconfigurator_core.sdk.engine import EngineHandle
        from aiconfigurator_core.sdk.perf_database import get_database

        db = get_database(system, backend, version)
        if db is None:
            return None
        return MeasuredTables(system, backend, version, EngineHandle.for_database(db))
    finally:
        logging.disable(logging.NOTSET)


class MeasuredTables:
    """One database: prices ops through its engine handle, and knows its measured grid."""

    def __init__(self, system: str, backend: str, version: str, handle):
        import aiconfigurator_core

        from moeplan.passes.cost.engine.grid import Grid

        self.system, self.backend, self.version, self.handle = system, backend, version, handle
        root = Path(aiconfigurator_core.__file__).parent / "systems" / "data" / system
        self.grid = Grid(root, backend, version)
        self._cache = {}

    @property
    def label(self) -> str:
        return f"{PACKAGE} {installed_version()} {self.backend} {self.version} {self.system}"

    def price(self, op) -> MeasuredPrice | None:
        """The database's time of one run of `op`, or None where it has none (a key never measured, a
        precision it does not know, an op kind it does not time)."""
        key = op.__class__, *(v for k, v in vars(op).items() if k not in ("name", "count"))
        if key not in self._cache:
            self._cache[key] = self._query(op)
        return self._cache[key]

    def _query(self, op) -> MeasuredPrice | None:
        spec = _spec(op)
        if spec is None:
            return None
        import aiconfigurator_core

        database_op, kwargs = spec
        text = database_op if isinstance(database_op, str) else aiconfigurator_core.ops_json_from_ops([database_op])
        try:
            result = self.handle.evaluate_ops_json(text, **kwargs)
        except (RuntimeError, ValueError, KeyError):  # PerfDataNotAvailableError, MissingSystemFlopsError, ...
            return None
        if not result:
            return None
        _, ms, _, tag = result[0]
        return MeasuredPrice(float(ms) / 1e3, str(tag))


def _decode(x: int) -> dict:
    return {"is_context": False, "batch_size": 1, "s": 1, "x": int(max(x, 1))}


def _spec(op):
    """(the database's op object, or its JSON list as text; evaluate keyword arguments) for `op`, or None."""
    import aiconfigurator_core.sdk.operations as A
    from aiconfigurator_core.sdk import common as Q

    if isinstance(op, O.Gemm):
        quant = GEMM_QUANT.get(op.quant)
        return None if quant is None else (A.GEMM(op.name, 1, op.n, op.k, getattr(Q.GEMMQuantMode, quant)), _decode(op.tokens))
    if isinstance(op, O.Attention):
        kv = KV_QUANT.get(op.kv_dtype)
        if kv is None:
            return None
        if op.phase == O.DECODE:
            spec = A.GenerationAttention(op.name, 1, op.q_heads, op.kv_heads, getattr(Q.KVCacheQuantMode, kv),
                                         window_size=op.window, head_size=op.head_dim, use_qk_norm=op.qk_norm)
            return spec, {"is_context": False, "batch_size": op.batch, "s": op.kv_len}
        spec = A.ContextAttention(op.name, 1, op.q_heads, op.kv_heads, getattr(Q.KVCacheQuantMode, kv),
                                  Q.FMHAQuantMode.bfloat16, window_size=op.window, head_size=op.head_dim,
                                  use_qk_norm=op.qk_norm)
        return spec, {"is_context": True, "batch_size": op.batch, "s": op.new_tokens, "prefix": op.kv_len}
    if isinstance(op, O.MlaAttention):
        kv = KV_QUANT.get(op.kv_dtype)
        if kv is None or (op.kv_lora_rank, op.rope_dim, op.nope_dim, op.v_dim) != MLA_MEASURED:
            return None
        if op.phase == O.DECODE:
            return (A.GenerationMLA(op.name, 1, op.heads, getattr(Q.KVCacheQuantMode, kv)),
                    {"is_context": False, "batch_size": op.batch, "s": op.kv_len})
        return (A.ContextMLA(op.name, 1, op.heads, getattr(Q.KVCacheQuantMode, kv), Q.FMHAQuantMode.bfloat16),
                {"is_context": True, "batch_size": op.batch, "s": op.new_tokens, "prefix": op.kv_len})
    if isinstance(op, O.MlaModule):
        kv = KV_QUANT.get(op.kv_dtype)
        core = [p for p in op.parts if isinstance(p, O.MlaAttention)]
        if kv is None or not core or (core[0].kv_lora_rank, core[0].rope_dim, core[0].nope_dim, core[0].v_dim) != MLA_MEASURED:
            return None
        # SGLang's wide-EP MLA as the database measured it: flashinfer, FP8 attention (what AIConfigurator assumes there)
        make = A.WideEPGenerationMLA if op.phase == O.DECODE else A.WideEPContextMLA
        spec = make(op.name, 1, op.tp, getattr(Q.KVCacheQuantMode, kv), Q.FMHAQuantMode.fp8_block, attn_backend="flashinfer")
        if op.phase == O.DECODE:
            return spec, {"is_context": False, "batch_size": op.batch, "s": op.kv_len}
        return spec, {"is_context": True, "batch_size": op.batch, "s": op.new_tokens, "prefix": op.kv_len}
    if isinstance(op, O.MlaBmm):
        if (op.kv_lora_rank, op.nope_dim, op.v_dim) != (MLA_MEASURED[0], MLA_MEASURED[2], MLA_MEASURED[3]):
            return None
        quant = Q.GEMMQuantMode.fp8 if op.quant in ("fp8", "fp8_block") else Q.GEMMQuantMode.bfloat16
        return A.MLABmm(op.name, 1, op.heads, quant, if_pre=op.pre), _decode(op.tokens)
    if isinstance(op, O.FusedMoe):
        quant = MOE_QUANT.get(op.quant)
        if quant is None:
            return None
        spec = A.MoE(op.name, 1, op.hidden, op.inter, op.top_k, op.experts, op.moe_tp, op.moe_ep,
                     getattr(Q.MoEQuantMode, quant), op.distribution, 1)
        return spec, _decode(op.tokens)
    if isinstance(op, O.ExpertCompute):
        quant = MOE_QUANT.get(op.quant)
        if quant is None:
            return None
        spec = A.MoEExpertCompute(op.name, 1, hidden_size=op.hidden, inter_size=op.inter, topk=op.top_k,
                                  num_experts=op.experts, moe_ep_size=op.moe_ep, quant_mode=getattr(Q.MoEQuantMode, quant),
                                  workload_distribution=op.distribution, attention_dp_size=1,
                                  inference_phase="generation" if op.phase == O.DECODE else "context", num_slots=op.slots)
        return spec, _decode(op.tokens)
    if isinstance(op, O.MoeGather):
        quant = MOE_QUANT.get(op.quant, "bfloat16")
        spec = A.MoEDispatch(op.name, 1, op.hidden, op.top_k, op.experts, op.moe_tp, op.moe_ep, op.attention_dp, op.pre,
                             quant_mode=getattr(Q.MoEQuantMode, quant), backend="sglang")
        return spec, _decode(op.tokens)
    if isinstance(op, O.AllReduce):
        return A.CustomAllReduce(op.name, 1, op.elements, op.ranks), _decode(op.tokens)
    if isinstance(op, O.Collective):
        return A.NCCL(op.name, 1, op.op, op.elements, op.ranks, Q.CommQuantMode.half), _decode(op.tokens)
    if isinstance(op, O.DeepEp):
        kernel = "deepep_ll" if op.step == O.DECODE else "deepep_ht"
        spec = A.MoEAllToAll(op.name, 1, phase=op.phase, comm_backend=kernel, hidden_size=op.hidden, topk=op.top_k,
                             num_experts=op.experts, moe_ep_size=op.moe_ep, node_num=op.nodes,
                             sms=20 if kernel == "deepep_ht" else 0)
        return spec, _decode(op.tokens)
    if isinstance(op, O.MemoryBound):
        spec = json.dumps([{"Elementwise": {"name": op.name, "scale_factor": 1.0, "bytes_per_token": float(op.bytes_per_token),
                                            "scale_num_tokens": 1, "seq_split": 1}}])
        return spec, _decode(op.tokens)
    return None
