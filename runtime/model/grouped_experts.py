"""Routed experts as grouped GEMMs: a fixed number of kernels per MoE block, whatever the number
of experts its tokens touch.

Why: run expert by expert (the libraries' eager loops: `for e in experts_hit: ...`), a block costs
about ten kernels per expert touched, and a decode step of a 128-expert model touches most of
them. Sorted by expert once, each projection is ONE grouped GEMM over all the block's experts
(`torch.nn.functional.grouped_mm`, per-expert row offsets; CPU and CUDA sm80+ in torch 2.13),
the activation one kernel, and the weighted outputs are summed back per token by a reshape.

For the experts modules transformers decorates with `use_experts_implementation` (13 of the 16
architectures: Mixtral, Qwen2/3-MoE, Qwen3-Next, OLMoE, DeepSeek-V2/V3, gpt-oss, GLM-4.5, Phi-3.5-MoE,
Granite-MoE, ERNIE-4.5, Hunyuan) the runtime calls the library's own grouped backend
(transformers 5.24, `transformers/integrations/moe.py: grouped_mm_experts_forward`). This module is
the same computation, written from that published algorithm, for the experts the library only loops
over: DBRX's `DbrxExperts` ([E * ffn, D] slabs), JetMoE's `JetMoeParallelExperts` ([E, out, in],
split sizes) and TinyMoE's ModuleList (stacked once, see `stacked_expert_weights`).
Shapes: M token rows, K slots per row, E experts (the block's local slots), S = M x K.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def grouped_mm_runs_on(device: torch.device) -> bool:
    """Whether `torch.nn.functional.grouped_mm` has a kernel for `device`: CPU (torch >= 2.9) and
    CUDA from sm80 (transformers' `_can_use_grouped_mm` states the same conditions)."""
    if not hasattr(F, "grouped_mm"):
        return False
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device) >= (8, 0)
    return device.type == "cpu"


class ExpertGroups:
    """Rows [M, K] of (token, slot) pairs sorted by expert: the permutation, each sorted pair's
    token, its gate weight and the per-expert offsets (int32 [E], cumulative) grouped_mm takes."""

    def __init__(self, slots: torch.Tensor, weights: torch.Tensor, num_experts: int):
        self.rows, self.k = slots.shape
        flat = slots.reshape(-1)
        sorted_ids, self.order = torch.sort(flat, stable=True)
        self.token = self.order // self.k                        # [S]
        self.weight = weights.reshape(-1)[self.order]            # [S]
        # offsets[e] = pairs of experts <= e; searchsorted keeps the shapes static (no host sync, as
        # a CUDA graph needs), where bincount would read the largest id first
        self.offsets = torch.searchsorted(sorted_ids, _upper_bounds(num_experts, flat.device), out_int32=True)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, D] -> [S, D], one row per sorted pair."""
        return x[self.token]

    def combine(self, y: torch.Tensor) -> torch.Tensor:
        """Outputs [S, D] of the sorted pairs -> [M, D]: each weighted by its gate, summed per token."""
        weighted = y * self.weight[:, None].to(y.dtype)
        back = torch.empty_like(weighted).index_copy_(0, self.order, weighted)
        return back.view(self.rows, self.k, -1).sum(dim=1)


_BOUNDS: dict = {}


def _upper_bounds(num_experts: int, device) -> torch.Tensor:
    """int64 [E]: 1 .. E on `device` (made once per size and device)."""
    key = (num_experts, str(device))
    if key not in _BOUNDS:
        _BOUNDS[key] = torch.arange(1, num_experts + 1, device=device)
    return _BOUNDS[key]


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, groups: ExpertGroups, transposed: bool = False) -> torch.Tensor:
    """x [S, in] sorted by expert, weight [E, out, in] (`transposed`: [E, in, out]) -> [S, out]."""
    w = weight if transposed else weight.transpose(-2, -1)
    if torch.compiler.is_compiling() and w.dtype != torch.bfloat16:
        # in a compiled step (`compiled_decode.py`, transformers models only): inductor's grouped_mm takes bf16 only,
        # so the library's own fallback op (registered by transformers.integrations.moe) runs it, as its experts do
        import transformers.integrations.moe  # noqa: F401

        return torch.ops.transformers.grouped_mm_fallback(x.to(w.dtype), w, offs=groups.offsets)
    if grouped_mm_runs_on(x.device):
        return F.grouped_mm(x.to(w.dtype), w, offs=groups.offsets)
    out = x.new_empty(x.shape[0], w.shape[-1])  # CUDA before sm80: one GEMM per expert
    start = 0
    for e, end in enumerate(groups.offsets.tolist()):
        if end > start:
            out[start:end] = x[start:end] @ w[e]
        start = end
    return out


def gated_experts(x: torch.Tensor, groups: ExpertGroups, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
                  act, down_transposed: bool = False) -> torch.Tensor:
    """act(x W_gate^T) * (x W_up^T) W_down^T per expert, weighted and summed per token: x [M, D],
    gate/up [E, F, D], down [E, D, F] (`down_transposed`: [E, F, D]) -> [M, D]."""
    rows = groups.gather(x)
    inner = act(grouped_linear(rows, gate, groups)) * grouped_linear(rows, up, groups)
    return groups.combine(grouped_linear(inner, down, groups, transposed=down_transposed))


def stacked_expert_weights(experts, names: tuple) -> dict:
    """{name: [E, ...]} for a ModuleList of identical experts (TinyMoE's), stacked ONCE: each expert's
    parameter becomes a view into the stack (no second copy; writes into a module, as an expert
    cache's pool does, show in the stack). Rebuilt if the modules moved to another device."""
    first = getattr(experts[0], names[0]).weight
    cached = experts.__dict__.get("_moeplan_stacked")
    if cached is not None and cached[names[0]].device == first.device and cached[names[0]].dtype == first.dtype:
        return cached
    stacked = {}
    for name in names:
        stacked[name] = torch.stack([getattr(e, name).weight.detach() for e in experts])
        for i, e in enumerate(experts):
            getattr(e, name).weight.data = stacked[name][i]
    experts.__dict__["_moeplan_stacked"] = stacked
    return stacked
