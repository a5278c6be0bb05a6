"""Speculative routing: which experts the routers of later MoE layers would pick from a hidden state
that is available earlier (issue 33). An offloaded deployment that knows, while MoE layer l runs,
which experts layer l+1 (or l+d) will ask for can start copying them before that layer's router.

The speculation runs the model's own router modules (a transformers `*TopKRouter`, TinyMoE's
`MoELayer.route`), never a re-implementation, on a stand-in for the input they would see. Three
stand-ins are offered (`SOURCES`), each a hidden state of MoE layer l's decoder block:

* `block-output`: the block's output (the residual stream after layer l's experts), through the
  norm that feeds layer l+d's MoE block (transformers' `post_attention_layernorm`, TinyMoE's
  `moe_norm`), then layer l+d's router. It skips only the attention of layers l+1..l+d. Known
  once layer l's experts have computed.
* `residual`: the residual stream after layer l's attention (the input of layer l's own norm), through
  layer l+d's norm and router. Known when layer l's router runs.
* `router-input`: layer l's router input as is (Fate's "gate input of the previous layer"), into
  layer l+d's router without its norm. Known when layer l's router runs.

`benchmarks/speculation.py` measures the recall of each on held-out traces of trained models;
`block-output` is the default (the highest recall on every model measured, docs/offload.md).

Speculation [T, L, D, K]: at [t, l, d - 1] the top-k the router of MoE layer l + d picks for
token t from the stand-in at layer l, heaviest first; -1 where l + d is past the last MoE layer.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from collections.abc import Callable

import numpy as np

from moeplan.runtime.ep.expert_table import heaviest_first
from moeplan.passes.analysis.trace.format import SPECULATION_SOURCES as SOURCES
from moeplan.core.errors import UserError

DEFAULT_SOURCE = "block-output"
# when the stand-in is known: at layer l's router, or once layer l's experts have computed
KNOWN_AT_ROUTER = {"block-output": False, "residual": True, "router-input": True}
NORM_NAMES = ("post_attention_layernorm", "moe_norm", "ffn_norm", "pre_feedforward_layernorm")


@dataclass
class SpecLayer:
    """One MoE layer: its decoder block, the norm feeding its MoE block, its router and a function
    running that router on a stand-in x [N, D] -> ids [N, K] (heaviest first)."""

    block: object
    norm: object
    router_input: object  # the module whose first positional input is the router's input
    route: Callable


def _decoder_block_path(name: str) -> str:
    """The decoder block holding a router: the module path up to its first numeric component."""
    match = re.match(r"^(.*?\.\d+)(\.|$)", name)
    if match is None:
        raise UserError(f"cannot tell which decoder block holds the router '{name}'; speculation needs routers "
                        "inside a list of decoder blocks")
    return match.group(1)


def _norm_of(block, block_name: str):
    for name in NORM_NAMES:
        norm = getattr(block, name, None)
        if norm is not None:
            return norm
    raise UserError(f"decoder block '{block_name}' has no norm in front of its MoE block (looked for "
                    f"{', '.join(NORM_NAMES)}); speculation needs it to feed a later router")


def _hf_route(router):
    def route(x):
        _, weights, ids = router(x)
        return heaviest_first(ids.detach().cpu().numpy().astype(np.int64), weights.detach().float().cpu().numpy())[0]
    return route


def _tiny_route(moe):
    def route(x):
        _, ids, _ = moe.route(x)  # topk: already heaviest first
        return ids.detach().cpu().numpy().astype(np.int64)
    return route


def find_spec_layers(module) -> list:
    """[SpecLayer] in MoE-layer order for TinyMoE-convention and transformers TopKRouter models."""
    names = dict(module.named_modules())
    layers = []
    for name, sub in module.named_modules():
        cls = type(sub).__name__
        if cls.lower().endswith("topkrouter"):
            route, router_input = _hf_route(sub), sub
        elif name.rsplit(".", 1)[-1] == "routing" and hasattr(names.get(name.rsplit(".", 1)[0]), "route"):
            moe = names[name.rsplit(".", 1)[0]]
            route, router_input = _tiny_route(moe), moe.gate
        else:
            continue
        block_name = _decoder_block_path(name)
        block = names[block_name]
        layers.append(SpecLayer(block=block, norm=_norm_of(block, block_name), router_input=router_input, route=route))
    if not layers:
        raise UserError(f"{type(module).__name__} has no router that speculation can run (it needs TinyMoE's 'routing' "
                        "convention or a transformers *TopKRouter); record the trace without --speculate")
    return layers


class Speculator:
    """Captures each MoE layer's stand-in during a forward (hooks), then runs the later layers'
    routers on them: `with spec: model(ids)`, then `spec.speculation(n)` -> int [n, L, depth, K]."""

    def __init__(self, layers: list, depth: int, source: str = DEFAULT_SOURCE):
        if source not in SOURCES:
            raise UserError(f"unknown speculation source '{source}'; use one of {', '.join(SOURCES)}")
        if depth < 1:
            raise UserError(f"--speculate must be at least 1 (MoE layers ahead), got {depth}")
        self.layers, self.depth, self.source = layers, int(depth), source
        self.handles, self.captured = [], {}

    def __enter__(self):
        self.captured = {}
        for i, layer in enumerate(self.layers):
            if self.source == "block-output":
                self.handles.append(layer.block.register_forward_hook(self._keep(i, output=True)))
            elif self.source == "residual":
                self.handles.append(layer.norm.register_forward_pre_hook(self._keep(i, output=False)))
            else:
                self.handles.append(layer.router_input.register_forward_pre_hook(self._keep(i, output=False)))
        return self

    def __exit__(self, *exc):
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def _keep(self, i: int, output: bool):
        def pre_hook(_module, inputs):
            self.captured[i] = inputs[0].detach()

        def hook(_module, _inputs, out):
            self.captured[i] = (out[0] if isinstance(out, tuple) else out).detach()
        return hook if output else pre_hook

    def speculation(self, num_rows: int, top_k: int) -> np.ndarray:
        """int64 [num_rows, L, depth, top_k] from the stand-ins of the last forward (module doc)."""
        import torch

        L = len(self.layers)
        missing = [i for i in range(L) if i not in self.captured]
        if missing:
            raise UserError(f"MoE layer {missing[0]} ran no forward that speculation could observe")
        out = np.full((num_rows, L, self.depth, top_k), -1, dtype=np.int64)
        with torch.no_grad():
            for l in range(L):
                x = self.captured[l].reshape(-1, self.captured[l].shape[-1])
                for d in range(1, self.depth + 1):
                    if l + d >= L:
                        break
                    target = self.layers[l + d]
                    ids = target.route(x if self.source == "router-input" else target.norm(x))
                    if ids.shape != (num_rows, top_k):
                        raise UserError(f"MoE layer {l + d}'s router gave {ids.shape[1]} choices for {ids.shape[0]} "
                                        f"rows; speculation expected top-{top_k} for {num_rows}")
                    out[:, l, d - 1] = ids
        return out


def named_share(real: np.ndarray, guess: np.ndarray) -> float:
    """Share of the real experts (int [..., K], -1 = none) that the guess (int [..., K'], same leading
    shape) names; order does not matter."""
    named = (real[..., :, None] == guess[..., None, :]).any(-1) & (real >= 0)
    total = int((real >= 0).sum())
    return float(named.sum() / total) if total else 0.0


def speculation_recall(experts: np.ndarray, speculation: np.ndarray) -> dict:
    """{"d": share of the real experts at layer l + d (experts [T, L, K]) that the speculation from
    layer l named (speculation [T, L, D, K])}, over all tokens and layers l with l + d a MoE layer
    (0.0 where there is none)."""
    L = experts.shape[1]
    return {str(d): named_share(experts[:, d:, :], speculation[:, : L - d, d - 1, :]) if d < L else 0.0
            for d in range(1, speculation.shape[2] + 1)}
