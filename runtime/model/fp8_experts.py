"""Routed experts held as FP8 with block scales, computed at the dense dtype (W8A16).

On a GPU that computes FP8 (`precision.py`: sm89+), an FP8 checkpoint's routed experts stay FP8:
one byte per weight plus a float32 scale per block, what the planner counts (`precision.held_bytes`)
and what lets DeepSeek-V3 fit 64 H100s. From a `--weights reference` bundle the ranks read the
checkpoint's own FP8 values and scales (`checkpoint_reader.read_recipe_fp8`) and hold them as they are.
A copy bundle's weights arrive dequantized (`fp8_blocks.py`, read with their block scales); they are
quantized again with the checkpoint's block grid, which gives back the checkpoint's FP8 values
wherever a block's largest weight was FP8's largest (`fp8_blocks.quantize`). A forward dequantizes only the experts its rows touch, into the module's
own parameters for that call, and runs the library's grouped experts on them: the memory of FP8,
not yet its GEMM speed (FP8 GEMMs, `torch._scaled_mm`, are not used).

Only transformers' grouped experts modules (`has_gate`: Qwen3-MoE, DeepSeek-V3, Mixtral, ...) are
held so; `fp8_supported` tells the loader, which refuses the rest in one line.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

from ..fp8_blocks import dequantize, quantize

QUANT, SCALE = "_fp8", "_fp8_scale_inv"


def fp8_supported(container, module) -> bool:
    """True where this experts module can hold FP8 experts (transformers' grouped experts)."""
    return container.kind == "experts" and hasattr(module, "has_gate")


def hold_fp8(module: nn.Module, params: list, block: tuple, given: dict | None = None) -> None:
    """Replace the stacked expert weights `params` ([n, N, K] each) of `module` by FP8 values and
    block scales (non-persistent buffers, so they move with the model), leaving empty placeholders;
    `given` {param: (values, scales)}: the checkpoint's own, held as they are."""
    module.__dict__["_moeplan_fp8_block"] = tuple(block)
    for p in params:
        if given and p in given:
            module.register_buffer(p + QUANT, given[p][0], persistent=False)
            module.register_buffer(p + SCALE, given[p][1], persistent=False)  # float32, or E8M0 as uint8
            continue
        w = getattr(module, p)
        pieces = [quantize(w[e].float(), block) for e in range(w.shape[0])]  # one expert at a time: float32 of one
        q = torch.stack([piece[0] for piece in pieces]) if pieces else torch.empty(w.shape, dtype=torch.float8_e4m3fn)
        s = torch.stack([piece[1] for piece in pieces]) if pieces else torch.empty(0, dtype=torch.float32)
        module.register_buffer(p + QUANT, q, persistent=False)
        module.register_buffer(p + SCALE, s, persistent=False)
        setattr(module, p, nn.Parameter(torch.empty(0, dtype=w.dtype, device=w.device), requires_grad=False))


def holds_fp8(module: nn.Module) -> bool:
    return "_moeplan_fp8_block" in module.__dict__


@contextlib.contextmanager
def touched_experts(module: nn.Module, params: list, slots: torch.Tensor):
    """For one call: the module's per-expert parameters become those of the experts `slots` [M, K]
    touch (FP8 ones dequantized at the placeholder's dtype, others indexed), and its expert count
    theirs; yields the slots renumbered over them."""
    touched, renumbered = torch.unique(slots, return_inverse=True)
    block = module.__dict__["_moeplan_fp8_block"]
    saved = {p: module._parameters[p] for p in params}
    count = module.num_experts
    try:
        for p in params:
            if hasattr(module, p + QUANT):
                q, s = getattr(module, p + QUANT)[touched], getattr(module, p + SCALE)[touched]
                module._parameters[p] = dequantize(q, s, block).to(saved[p].dtype)
            else:
                module._parameters[p] = saved[p][touched]
        module.num_experts = int(touched.numel())
        yield renumbered.view(slots.shape)
    finally:
        module._parameters.update(saved)
        module.num_experts = count
