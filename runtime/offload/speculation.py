"""Live speculation in a bundle's runtime (issue 33): after each MoE layer's decoder block, the
routers of the next D MoE layers run on its output, through each one's own feed-forward norm,
for the rows whose hidden state is real on this rank; the keys they pick go to the expert cache,
whose stepper then decides the speculative prefetcher's copies.

The construction is `moeplan trace --speculate D` with its default stand-in, the block output
(passes/analysis/trace/speculate.py): the library's own norm and router modules on the library's
own hidden state, so a bundle speculates what the planning trace recorded. Modules are called
through `.forward` so that no hook (the engine's, the trace's) sees these extra calls. Which rows
are real is the engine's to say (`install(real_rows)`): a rank's own requests in standard EP, the
rows current here in context-coherent EP; left padding never.
Nothing here imports moeplan: bundles run without it.
"""
from __future__ import annotations

import torch


def _router_ids(adapter, x: torch.Tensor) -> torch.Tensor:
    """Expert ids [n, K] (heaviest first) the MoE block of `adapter` routes rows x [n, D] to."""
    block = adapter.block
    if adapter.container.kind == "tiny_moe":
        return block.route(x)[1]
    gate = getattr(block, "gate", None)
    if gate is None or not type(gate).__name__.lower().endswith("topkrouter"):
        raise ValueError(f"MoE layer {adapter.moe} has no *TopKRouter gate to speculate with")
    _, weights, ids = gate.forward(x)
    return torch.gather(ids, 1, torch.argsort(-weights.float(), dim=-1, stable=True))


class LiveSpeculation:
    """Speculates after every MoE layer's block (block-output stand-in) into `cache.speculate`."""

    def __init__(self, rank_model, cache, depth: int, source: str = "block-output"):
        if source != "block-output":
            raise ValueError(f"the runtime speculates from the block output; the plan asks for '{source}' "
                             "(record the trace with --speculate-from block-output)")
        self.model, self.cache, self.depth = rank_model, cache, int(depth)
        self.adapters = list(rank_model.adapters)  # MoE order
        self.E = self.adapters[0].container.num_experts

    def install(self, real_rows) -> list:
        """Forward hooks on the MoE decoder blocks; `real_rows()` -> bool [n] rows real here."""
        self.real_rows = real_rows
        return [self.model.layers[a.layer].register_forward_hook(self._after(a.moe)) for a in self.adapters]

    def _after(self, moe: int):
        def hook(_module, _args, output):
            out = output[0] if isinstance(output, tuple) else output
            self.cache.speculate(moe, self.speculate(moe, out.reshape(-1, out.shape[-1])))
        return hook

    def speculate(self, moe: int, hidden: torch.Tensor) -> list:
        """Per distance 1..D, the distinct keys (row order, then choice order) the routers of MoE
        layers moe + d pick from the real rows of `hidden` [n, D] (the block output of layer moe)."""
        rows = self.real_rows().to(hidden.device)
        x = hidden[rows]
        groups = []
        with torch.no_grad():
            for d in range(1, self.depth + 1):
                if moe + d >= len(self.adapters) or x.shape[0] == 0:
                    groups.append([])
                    continue
                target = self.adapters[moe + d]
                ids = _router_ids(target, self.model.ffn_norm[target.layer].forward(x))
                keys = ((moe + d) * self.E + ids.reshape(-1)).tolist()
                groups.append(list(dict.fromkeys(keys)))
        return groups
