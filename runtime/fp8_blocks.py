"""Fine-grained FP8 weights back to full precision: w = q * scale_inv, one scale per block.

The format of DeepSeek-V3's and Qwen3's `-FP8` checkpoints (transformers 5.24
`integrations/finegrained_fp8.py`, `Fp8Dequantize` and `_dequantize_fp8_weight`): a weight q
[..., N, K] stored as float8_e4m3fn (or e5m2), beside `<name>_scale_inv` float32 (or E8M0 exponents
as uint8, 2 ** (byte - 127)) [..., ceil(N / bn), ceil(K / bk)], where [bn, bk] is the config's
`quantization_config.weight_block_size`; a checkpoint without blocks has one scale per tensor.
Edge blocks may be partial (N or K not a multiple of the block). Runtime code: torch only.
"""
from __future__ import annotations

import torch

FP8_DTYPES = {"F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
SCALE_SUFFIX = "_scale_inv"
FP8_MAX = 448.0  # the largest finite float8_e4m3fn


def scale_values(scale_inv: torch.Tensor) -> torch.Tensor:
    """float32 scales of a checkpoint's scale tensor (E8M0 exponents stored as uint8 decoded)."""
    if scale_inv.dtype == torch.uint8:
        return (scale_inv.to(torch.float32) - 127.0).exp2()
    return scale_inv.to(torch.float32)


def dequantize(q: torch.Tensor, scale_inv: torch.Tensor, block: tuple | None) -> torch.Tensor:
    """float32 [..., N, K] of FP8 weights q [..., N, K] with scales [..., ceil(N/bn), ceil(K/bk)]
    (`block` (bn, bk)), or one scale for the tensor (`block` None, or a scale of one element)."""
    w = q.to(torch.float32)
    s = scale_values(scale_inv)
    if block is None or s.numel() == 1:
        return w.mul_(s.reshape(()))
    bn, bk = int(block[0]), int(block[1])
    n, k = w.shape[-2:]
    grid = (-(-n // bn), -(-k // bk))
    if tuple(s.shape[-2:]) != grid or s.shape[:-2] != w.shape[:-2]:
        raise ValueError(f"FP8 scales of shape {list(s.shape)} do not cover weights {list(w.shape)} in blocks of {bn}x{bk} "
                         f"(expected [..., {grid[0]}, {grid[1]}])")
    if n % bn == 0 and k % bk == 0:  # whole blocks (real checkpoints): scales broadcast, never expanded
        return w.view(*w.shape[:-2], grid[0], bn, grid[1], bk).mul_(s[..., :, None, :, None]).view(w.shape)
    expanded = s.repeat_interleave(bn, dim=-2)[..., :n, :].repeat_interleave(bk, dim=-1)[..., :k]
    return w.mul_(expanded)


def quantize(w: torch.Tensor, block: tuple) -> tuple:
    """(q float8_e4m3fn [..., N, K], scale_inv float32 [..., ceil(N/bn), ceil(K/bk)]) of weights
    w [..., N, K]: each block's scale maps its largest magnitude to FP8_MAX (how DeepSeek-V3's and
    Qwen3's FP8 checkpoints were made). Weights that are an FP8 checkpoint's dequantized values come
    back as the checkpoint's FP8 values wherever a block's largest value was FP8_MAX there."""
    bn, bk = int(block[0]), int(block[1])
    n, k = w.shape[-2:]
    rows, cols = -(-n // bn), -(-k // bk)
    padded = w.new_zeros(*w.shape[:-2], rows * bn, cols * bk, dtype=torch.float32)
    padded[..., :n, :k] = w
    blocks = padded.unflatten(-1, (cols, bk)).unflatten(-3, (rows, bn))           # [..., rows, bn, cols, bk]
    scale = blocks.abs().amax(dim=(-3, -1)).clamp(min=1e-12) / FP8_MAX           # [..., rows, cols]
    q = (blocks / scale[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).flatten(-2).flatten(-3, -2)[..., :n, :k]
    return q.to(torch.float8_e4m3fn), scale
