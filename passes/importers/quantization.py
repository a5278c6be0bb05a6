"""Checkpoint storage from a Hugging Face `quantization_config`: the bytes each weight really takes.

A quantized checkpoint stores its linear weights in 4 or 8 bits plus scales, so planning it at its
compute dtype (bf16) overstates memory 2-4x: gpt-oss-120b is a 61 GiB MXFP4 checkpoint, not a
218 GiB bf16 one. The model is still built on `meta` at its compute dtype (shapes are the same);
this module gives each quantized weight its storage size, in bits per element, scales included:

| `quant_method` | a quantized weight [.., out, in] stores | bits per element |
| --- | --- | --- |
| `mxfp4` | 4-bit FP4 (E2M1) values + one 8-bit E8M0 scale per 32 along `in` | 4 + 8/32 = 4.25 |
| `fp8` (blockwise) | 1 byte + one float32 scale per `weight_block_size` block of [out, in] | 8 + 32/(b0 b1) |
| `fp8` (per tensor) | 1 byte + one float32 scale per matrix | ~8 |
| `gptq`, `awq` | `bits` per value + one fp16 scale and one packed `bits` zero point per `group_size` along `in`; GPTQ also an int32 `g_idx` per input | ~4.16 at 4 bits, group 128 |

(OCP Microscaling spec v1.0 for MXFP4; DeepSeek-V3's `weight_scale_inv` for FP8 blocks;
AutoGPTQ/AutoAWQ `qweight/scales/qzeros[/g_idx]` layouts.)

Which weights are quantized is decided by structure, as the quantizers do: weights of linear
maps (two or more dimensions, not a bias) in attention, MLP and expert stages. Embeddings, the
output head, norms, biases and MoE routers stay at the compute dtype (every published checkpoint
of these formats keeps them so; a GPTQ config with `"lm_head": true` quantizes the head), and so
does any module `modules_to_not_convert` names (a module path, `*` matching one path component).
"""
from __future__ import annotations

import math
import re
from dataclasses import replace

from moeplan.core.errors import UserError

FLOAT8_DTYPES = ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
SUPPORTED = ("mxfp4", "fp8", "gptq", "awq")


def checkpoint_storage(data: dict, dtype_name: str, source: str) -> tuple:
    """(storage or None, notes) for a config: its `quantization_config`, else a float8 dtype.

    A quantization method this module does not model is planned at the compute dtype, with a
    note saying so (the plan is then an upper bound on memory, never an underestimate).
    """
    qconfig = data.get("quantization_config")
    if isinstance(qconfig, dict) and qconfig:
        method = str(qconfig.get("quant_method", "")).lower()
        if method in SUPPORTED:
            return Quantization(qconfig, source), ()
        return None, (
            f"quantization_config quant_method {qconfig.get('quant_method')!r} is not modelled (moeplan sizes "
            f"{', '.join(SUPPORTED)}): weights are planned at {dtype_name}, an upper bound on their bytes",
        )
    if dtype_name in FLOAT8_DTYPES:
        return Float8Storage(dtype_name), ()
    return None, ()


def _matrix(shape: tuple) -> tuple:
    """(matrices, out, in) of a weight [.., out, in]."""
    count = 1
    for d in shape[:-2]:
        count *= int(d)
    return count, int(shape[-2]), int(shape[-1])


def _fp8_bytes(shape: tuple, block: list | None) -> float:
    matrices, out, inp = _matrix(shape)
    scales = math.ceil(out / block[0]) * math.ceil(inp / block[1]) if block else 1
    return matrices * (out * inp + 4 * scales)


def _int_bytes(shape: tuple, bits: int, group: int, g_idx: bool) -> float:
    matrices, out, inp = _matrix(shape)
    groups = math.ceil(inp / group) if group and group > 0 else 1
    per_matrix = out * inp * bits / 8 + out * groups * (2 + bits / 8) + (4 * inp if g_idx else 0)
    return matrices * per_matrix


def _pattern(entry: str):
    """A `modules_to_not_convert` entry as a regex over module paths (`*` = one path component)."""
    body = ".".join(r"[^.]+" if part == "*" else re.escape(part) for part in entry.split("."))
    return re.compile(rf"(^|\.){body}(\.|$)")


class Quantization:
    """One checkpoint's quantization scheme: which weights it quantizes and their stored bytes."""

    def __init__(self, qconfig: dict, source: str):
        method = str(qconfig.get("quant_method", "")).lower()
        self.method = method
        self.config = qconfig
        self.skip = [_pattern(str(m)) for m in (qconfig.get("modules_to_not_convert") or [])]
        self.quantize_head = bool(qconfig.get("lm_head", False))
        if method in ("gptq", "awq"):
            self.bits = int(qconfig.get("bits", qconfig.get("w_bit", 4)))
            self.group = int(qconfig.get("group_size", qconfig.get("q_group_size", 128)))
            if self.bits not in (2, 3, 4, 8):
                raise UserError(f"{source}: quantization_config bits {self.bits} is not 2, 3, 4 or 8")

    def label(self) -> str:
        if self.method == "fp8":
            block = self.config.get("weight_block_size")
            return f"fp8 blocks {block[0]}x{block[1]}" if block else "fp8"
        if self.method in ("gptq", "awq"):
            return f"{self.method} int{self.bits} group {self.group}"
        return self.method

    def stored_bytes(self, shape: tuple) -> float:
        """Bytes a quantized weight of torch shape [.., out, in] takes in the checkpoint."""
        if self.method == "mxfp4":
            n = 1
            for d in shape:
                n *= int(d)
            return n * 4.25 / 8
        if self.method == "fp8":
            return _fp8_bytes(shape, self.config.get("weight_block_size"))
        return _int_bytes(shape, self.bits, self.group, g_idx=self.method == "gptq")

    def quantizes(self, param, kind: str, is_router: bool) -> bool:
        leaf = param.name.rpartition(".")[2]
        if len(param.shape) < 2 or "bias" in leaf or is_router or kind in ("embedding", "norm"):
            return False
        if kind == "head" and not self.quantize_head:
            return False
        module = param.name.rpartition(".")[0]
        return not any(p.search(module) or p.search(param.name) for p in self.skip)


    def apply(self, groups) -> list:
        """`groups` with every quantized weight's `Param.bits` set to its stored bits per element."""
        out = []
        for g in groups:
            router = g.router + "." if g.is_moe else None
            params = []
            for p in g.params:
                is_router = router is not None and p.name.startswith(router)
                if not p.tied_to and self.quantizes(p, g.kind, is_router):
                    p = replace(p, bits=8 * self.stored_bytes(p.shape) / p.numel)
                params.append(p)
            out.append(replace(g, params=tuple(params)))
        return out


class Float8Storage:
    """A config whose `torch_dtype` is a float8 type: every weight stored in 1 byte.

    torch cannot allocate float8 tensors on `meta`, so the model is built at bfloat16 (its
    compute dtype) and each parameter is charged the float8 byte it is stored in.
    """

    def __init__(self, dtype_name: str):
        self.dtype_name = dtype_name

    def label(self) -> str:
        return self.dtype_name

    def apply(self, groups) -> list:
        return [replace(g, params=tuple(replace(p, bits=8) for p in g.params)) for g in groups]
