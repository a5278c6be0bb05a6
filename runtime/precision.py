"""The precision the runtime holds a model's weights at, and the bytes they take: one rule for the
runtime, which casts as it loads, and for the planner, which sizes serving capacity
(`passes/cost/capacity.py`), Kubernetes pod memory (`backends/kubernetes/pod_memory.py`) and
expert caches (`passes/optimize/offload/`) with it.

Weights stay at the checkpoint's precision where the device computes at it, never above it:

| checkpoint stores          | device `fp8` (GPU sm89+)             | `bf16` (GPU sm80+; CPU with AMX)     | `fp32` (other CPUs, older GPUs) |
| -------------------------- | ------------------------------------ | ------------------------------------ | ------------------------------- |
| float32                    | float32                              | float32                              | float32                         |
| bfloat16                   | bfloat16                             | bfloat16                             | float32                         |
| float16                    | float16                              | float16 on GPUs, bfloat16 on CPUs    | float32                         |
| fp8 with block scales      | experts fp8 + scales, dense bfloat16 | bfloat16                             | float32                         |
| mxfp4 / int4 (dequantized) | bfloat16                             | bfloat16                             | float32                         |

Dense weights of an fp8 checkpoint are held at bfloat16: they run in the library's own modules,
which compute in bfloat16. Why CPUs without AMX hold float32: measured on the runtime's real step on this AVX2 CPU
(benchmarks/weight_precision.py; docs/models.md, "Weight precision"), bfloat16 weights ran at 0.35x,
0.87x and 0.43x of float32's tokens/s at batch 1, 16 and 64 (qwen3_moe_hd32, 1 rank), as every bf16
matmul there converts its operands.

A device's precision is `device_precision(torch.device)` in a rank and the hardware profile's
`weight_precision` in the planner (`core/hardware.py`); MOEPLAN_WEIGHT_PRECISION overrides the
rank's (fp8 | bf16 | fp32: measurement, never a default).
Nothing here imports moeplan: bundles run without it.
"""
from __future__ import annotations

import os

import torch

PRECISIONS = ("fp8", "bf16", "fp32")
PRECISION_ENV = "MOEPLAN_WEIGHT_PRECISION"
FP8 = "float8_e4m3fn"
ITEMSIZE = {"float32": 4, "float64": 8, "bfloat16": 2, "float16": 2, FP8: 1, "float8_e5m2": 1}


def device_precision(device) -> str:
    """The narrowest weights `device` computes at speed: fp8 (CUDA sm89+ with `torch._scaled_mm`),
    bf16 (CUDA sm80+; a CPU with AMX tiles, whose oneDNN GEMMs run bf16 natively), else fp32 (an
    AVX2 or AVX512 CPU converts every bf16 operand: measured slower, docs/models.md)."""
    forced = os.environ.get(PRECISION_ENV)
    if forced:
        if forced not in PRECISIONS:
            raise ValueError(f"MOEPLAN_WEIGHT_PRECISION must be one of {', '.join(PRECISIONS)}, got {forced!r}")
        return forced
    device = torch.device(device)
    if device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if capability >= (8, 9) and hasattr(torch, "_scaled_mm"):
            return "fp8"
        return "bf16" if capability >= (8, 0) else "fp32"
    amx = getattr(getattr(torch, "cpu", None), "_is_amx_tile_supported", None)
    return "bf16" if amx is not None and amx() else "fp32"


def held_dtypes(stored: str, quantization: str, on_gpu: bool, precision: str, expert_cache: bool = False) -> dict:
    """{"dense": dtype name, "experts": dtype name} the runtime holds for a checkpoint whose weights
    are `stored` (the model's dtype) with `quantization` ("" or the importer's description, e.g.
    "fp8 blocks 128x128", "mxfp4"), on a GPU or not, at the device's `precision` (table above).
    With an `expert_cache` (offloading) FP8 experts are held at bfloat16: the cache's slots are not FP8."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    stored = str(stored).replace("torch.", "")
    if precision == "fp32" or ITEMSIZE.get(stored, 4) >= 4 and not quantization:
        return {"dense": "float32", "experts": "float32"}
    if quantization.startswith("fp8") or stored.startswith("float8"):
        return {"dense": "bfloat16", "experts": FP8 if precision == "fp8" and not expert_cache else "bfloat16"}
    if stored == "float16" and on_gpu:
        return {"dense": "float16", "experts": "float16"}
    return {"dense": "bfloat16", "experts": "bfloat16"}


def held_bytes(params: float, stored_bytes: float, stored: str, quantization: str, held: str) -> float:
    """Bytes `params` weights take as held: their stored bytes (fp8 with its scales) where held as
    stored, else params x the held dtype's size."""
    stored = str(stored).replace("torch.", "")
    as_stored = (held == FP8 and quantization.startswith("fp8")) or (held == stored and not quantization)
    return float(stored_bytes) if as_stored else float(params) * ITEMSIZE[held]


def torch_dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def model_weight_bytes(ir, on_gpu: bool, precision: str, expert_cache: bool = False) -> dict:
    """What a planned model's weights take as the runtime holds them: {"dense": bytes of the dense
    weights (every rank holds them), "expert": bytes of one routed expert, "dtypes": held_dtypes(...)}.
    `ir` is a ModelIR (read by attribute: dtype, quantization, dense_params, total_param_bytes, moe_stages)."""
    dtypes = held_dtypes(ir.dtype, ir.quantization, on_gpu, precision, expert_cache)
    moe = ir.moe_stages
    routed = sum(s.num_experts * s.expert_param_bytes for s in moe)
    dense = held_bytes(ir.dense_params, ir.total_param_bytes - routed, ir.dtype, ir.quantization, dtypes["dense"])
    expert = held_bytes(moe[0].expert_params, moe[0].expert_param_bytes, ir.dtype, ir.quantization, dtypes["experts"])
    return {"dense": int(round(dense)), "expert": int(round(expert)), "dtypes": dtypes}
