"""Host compute on a miss (issue 33): a missed expert's rows computed by the host CPU where its
weights are, instead of copying the weights to the device (Fiddler, KTransformers, llama.cpp's
--n-cpu-moe). Which requests go to the host is the stepper's decision (the plan's rule "cheaper":
the host finishes before the copy would arrive); this module does it for real.

Only activations move: the rows' hidden states [m, D] go to the CPU, the library's own experts
module runs there on the expert's CPU tensors (`torch.func.functional_call` with that one expert's
weights in place of the module's device slots: TinyMoE's `Expert`, a transformers `*Experts`
module with index 0), and the weighted outputs [m, D] come back. The weights come from the store's
host tier (no copy, not counted) or are read from disk (counted as a disk read, as the simulator
counts it). On a CPU-only machine the "device" is the bounded pool and the host the same CPU: the
arithmetic and the decisions are the same, only the speed is not shown.
Nothing here imports moeplan: bundles run without it.
"""
from __future__ import annotations

import torch
from torch.func import functional_call

SUPPORTED = ("experts", "tiny_moe")


class HostExperts:
    """Computes one expert's rows on the host from `store`'s CPU weights, through `pool`'s modules."""

    def __init__(self, pool, store, num_experts: int):
        if pool.kind not in SUPPORTED:
            raise ValueError(f"host compute runs the library's experts module on one expert; blocks of kind "
                             f"'{pool.kind}' are not supported (plan with --host-compute never)")
        self.pool, self.store, self.E = pool, store, num_experts
        if pool.kind == "experts":  # one expert's shape of each stacked parameter: [1, ...] ([r, ...] for DBRX)
            self.shapes = {p: (t.shape[0] // pool.capacity, *t.shape[1:]) for p, t in pool.tensors.items()}

    def output(self, adapter, key: int, h: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Weighted outputs [m, D] (on h's device) of expert `key` for rows h [m, D] with gate weights [m]."""
        tensors = self.store.host_weights(key // self.E, key % self.E)
        x, w = h.detach().to("cpu"), weights.detach().to("cpu", h.dtype)
        with torch.no_grad():
            if self.pool.kind == "tiny_moe":
                y = functional_call(self.pool.modules[0], dict(tensors), (x,)) * w[:, None]
            else:
                params = {p: t.reshape(self.shapes[p]) for p, t in tensors.items()}
                zeros = torch.zeros(x.shape[0], 1, dtype=torch.int64)
                y = functional_call(adapter.library_experts, params, (x, zeros, w[:, None])).reshape(x.shape)
        return y.to(h.device, h.dtype)
