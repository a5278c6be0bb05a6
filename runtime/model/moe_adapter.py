"""The one piece of a model the runtime replaces: each MoE block's routed-expert computation.

Everything else (embeddings, attention, norms, rotary, routers with their grouped top-k, biases
and scaling, shared experts, dense blocks, the head) is the library's own module, run as is.
Where the library routes, the adapter takes over: the token rows, their top-k expert ids
(heaviest first) and weights go to `route_fn(adapter, h [n, D], ids [n, k], weights [n, k])`,
which returns the routed sum [n, D] (the engine's dispatch/compute/combine). The local part of
that computation, `local_expert_output`, runs the library's own experts module on the subset of
experts this rank holds.

Block kinds (how the library hands over routing):
* `experts`: a `...Experts` module called as `experts(h, top_k_index, top_k_weights)` (transformers
  5: Mixtral, Qwen2/3-MoE, Qwen3-Next, OLMoE, DeepSeek-V2/V3, gpt-oss, GLM-4.5, Phi-3.5-MoE,
  Granite-MoE, ERNIE-4.5, Hunyuan, DBRX); the adapter module replaces it.
* `llama4`: `Llama4TextMoe` folds the sigmoid router scores into the experts' input (weights on the
  input, not the output); the router's output is read by a hook, the experts module replaced.
* `jetmoe`: `JetMoeMoE` routes and computes inline; its forward is replaced by one that calls its
  own router, activation, expert linears and bias.
* `tiny_moe`: moeplan's `MoELayer` (route() + a ModuleList of experts + shared experts).

Expert tensors: a parameter of an experts container whose leading dimension is E (or E x r, as
DBRX stores [E * ffn, D]) holds one slice per expert; bundles store the slices apart as
`<container>.<e>.<param>` so that a rank's shard holds only its experts.
"""
from __future__ import annotations

import types
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..fp8_blocks import SCALE_SUFFIX, dequantize
from .fp8_experts import fp8_supported, hold_fp8, holds_fp8, touched_experts
from .grouped_experts import ExpertGroups, gated_experts, grouped_linear, stacked_expert_weights


class ModelError(Exception):
    """The model cannot run under this runtime: one line naming why."""


class Captured(Exception):
    """Raised through the library's forward to stop it once routing is known (capture mode)."""

    def __init__(self, ids, weights):
        super().__init__("routing captured")
        self.ids, self.weights = ids, weights


@dataclass(frozen=True)
class ExpertContainer:
    """Where one MoE layer's experts live in the model."""

    layer: int        # decoder block index
    moe: int          # MoE layer ordinal (placement and trace index)
    block: str        # module path of the MoE block (its output is the feed-forward output)
    path: str         # module path whose per-expert parameters are split
    params: tuple     # (name relative to path, full shape) of each per-expert parameter
    num_experts: int
    kind: str


def _kind(module) -> str | None:
    name = type(module).__name__
    if name == "MoELayer" and isinstance(getattr(module, "experts", None), nn.ModuleList):
        return "tiny_moe"
    if name == "JetMoeMoE":
        return "jetmoe"
    if name == "Llama4TextMoe":
        return "llama4"
    experts = getattr(module, "experts", None)
    if isinstance(experts, nn.Module) and not isinstance(experts, nn.ModuleList) and type(experts).__name__.endswith("Experts"):
        return "experts"
    return None


def find_containers(layers, prefix: str) -> list:
    """One ExpertContainer per MoE block of the decoder `layers` (module path `prefix`), in order."""
    out = []
    for index, layer in enumerate(layers):
        for name, module in layer.named_modules():
            kind = _kind(module)
            if kind is None:
                continue
            block = f"{prefix}.{index}.{name}"
            if kind == "tiny_moe":
                path, sub = f"{block}.experts", module.experts
                params = tuple((f"{e}.{p}", tuple(t.shape)) for e, ex in enumerate(sub) for p, t in ex.named_parameters())
                count = len(sub)
            elif kind == "jetmoe":
                path, count = block, module.input_linear.num_experts
                params = tuple((p, tuple(t.shape)) for p, t in module.named_parameters() if p.split(".")[0] in ("input_linear", "output_linear"))
            else:
                path, count = f"{block}.experts", int(module.experts.num_experts)
                params = tuple((p, tuple(t.shape)) for p, t in module.experts.named_parameters())
            out.append(ExpertContainer(index, len(out), block, path, params, count, kind))
            break
    return out


def _per_expert_view(tensor: torch.Tensor, count: int) -> torch.Tensor:
    """[E, ...] or [E * r, ...] -> [E, ...] (a view)."""
    if tensor.shape[0] == count:
        return tensor
    if tensor.shape[0] % count:
        raise ValueError(f"expert tensor of shape {tuple(tensor.shape)} does not split into {count} experts")
    return tensor.view(count, tensor.shape[0] // count, *tensor.shape[1:])


def split_expert_state(state: dict, containers: list) -> dict:
    """Library state dict -> bundle names: each per-expert tensor cut into `<path>.<e>.<param>`."""
    out = dict(state)
    for c in containers:
        if c.kind == "tiny_moe":
            continue  # TinyMoE already names experts one by one
        for p, _ in c.params:
            full = out.pop(f"{c.path}.{p}")
            per = _per_expert_view(full, c.num_experts)
            for e in range(c.num_experts):
                out[f"{c.path}.{e}.{p}"] = per[e].contiguous()
    return out


def join_expert_state(state: dict, containers: list) -> dict:
    """Inverse of `split_expert_state` (rebuilds the library's state dict)."""
    out = dict(state)
    for c in containers:
        if c.kind == "tiny_moe":
            continue
        for p, shape in c.params:
            parts = [out.pop(f"{c.path}.{e}.{p}") for e in range(c.num_experts)]
            out[f"{c.path}.{p}"] = torch.stack(parts).reshape(shape)
    return out


def expert_owner(containers: list):
    """name -> (MoE layer, expert) for bundle names of per-expert tensors, None for dense ones."""
    owners = {}
    for c in containers:
        for p, _ in c.params:
            if c.kind == "tiny_moe":
                owners[f"{c.path}.{p}"] = (c.moe, int(p.split(".")[0]))
            else:
                for e in range(c.num_experts):
                    owners[f"{c.path}.{e}.{p}"] = (c.moe, e)
    return owners.get


def _module(root, path: str):
    return root.get_submodule(path)


class MoEAdapter:
    """Holds one MoE block's local experts and hands its routing to the engine (not a module:
    the model keeps owning every parameter, so `model.to(device)` moves them all)."""

    def __init__(self, root, container: ExpertContainer, local: list, weights: dict, route_fn,
                 fp8_block: tuple | None = None):
        self.container, self.layer, self.moe = container, container.layer, container.moe
        self.fp8_block = fp8_block  # hold the experts as FP8 in blocks of this size (`fp8_experts.py`)
        self._set_local(local)
        self.route_fn = route_fn
        self.num_slots = len(self.local)  # expert slots of the library module (an expert cache's pool: C)
        self.expert_cache = None
        self.block = _module(root, container.block)
        kind = container.kind
        self._install_local_weights(root, weights)
        if kind in ("experts", "llama4"):
            self.block.experts = _ExpertsSlot(self, self.block.experts)
            if kind == "llama4":
                self._scores = None
                self.block.router.register_forward_hook(self._keep_scores)
                self.block.register_forward_pre_hook(self._keep_input)
        elif kind == "jetmoe":
            self.block.forward = types.MethodType(_jetmoe_forward, self.block)
            self.block.__dict__["_moeplan_adapter"] = self
        elif kind == "tiny_moe":
            self.block.forward = types.MethodType(_tiny_moe_forward, self.block)
            self.block.__dict__["_moeplan_adapter"] = self

    def _set_local(self, local: list) -> None:
        self.local = list(local)                      # global expert ids held here, ascending
        self._lut = torch.full((self.container.num_experts,), -1, dtype=torch.int64)  # expert id -> local index
        self._lut[self.local] = torch.arange(len(self.local))
        self._identity = self.local == list(range(self.container.num_experts))  # every expert, in order
        self._luts = {}

    def local_slots(self, ids: torch.Tensor) -> torch.Tensor:
        """Local indices (position in `self.local`, -1: not held here) of expert ids, on ids' device;
        where the block holds every expert in order, the ids themselves (no lookup kernel)."""
        if self._identity:
            return ids
        if ids.device not in self._luts:
            self._luts[ids.device] = self._lut.to(ids.device)
        return self._luts[ids.device][ids]

    def served_slots(self, tags: torch.Tensor) -> torch.Tensor:
        """Slots of the library module for expert tags [M, K] (expert id + 1; 0: no expert): an expert held here
        its local index, any other the library's expert-parallel sentinel (`num_slots`, a slot grouped_mm skips).
        One lookup kernel (a gathered block's, `gathered_moe.py`) in an [E + 1] table whose entry 0 is sentinel."""
        key = ("served", tags.device)
        if key not in self._luts:
            table = torch.where(self._lut < 0, self.num_slots, self._lut)
            self._luts[key] = torch.cat([table.new_tensor([self.num_slots]), table]).to(tags.device)  # [E + 1]
        return self._luts[key][tags]

    # --- weights ---------------------------------------------------------------------------
    def _install_local_weights(self, root, weights: dict) -> None:
        c = self.container
        n = len(self.local)
        if c.kind == "tiny_moe":
            experts = self.block.experts
            kept = nn.ModuleList(experts[e] for e in self.local)
            for i, e in enumerate(self.local):
                for p, t in kept[i].named_parameters():
                    t.data = weights.pop(f"{c.path}.{e}.{p}").to(t.dtype)
            self.block.experts = kept
            return
        owner = _module(root, c.path)
        given = self._fp8_pairs(weights) if self.fp8_block is not None else {}
        for p, shape in c.params:
            dtype = owner.get_parameter(p).dtype  # as the library module was built (`precision.py`)
            if p in given:  # the checkpoint's own FP8 values and scales (a reference bundle): held as they are
                self._set_param(owner, p, torch.empty(0, dtype=dtype))
                continue
            if n:  # each expert cast as it is stacked, then freed
                stacked = torch.stack([weights.pop(f"{c.path}.{e}.{p}").to(dtype) for e in self.local])
            else:
                per = shape[1:] if shape[0] == c.num_experts else (shape[0] // c.num_experts, *shape[1:])
                stacked = torch.zeros(0, *per, dtype=dtype)
            if shape[0] != c.num_experts:  # DBRX: [E * r, ...]
                stacked = stacked.reshape(n * (shape[0] // c.num_experts), *shape[1:])
            self._set_param(owner, p, stacked)
        self._set_expert_count(owner, n)
        if self.fp8_block is not None:
            if not fp8_supported(c, owner):
                raise ModelError(f"this runtime holds FP8 experts for transformers' grouped experts modules only, not "
                                 f"{type(owner).__name__}; set MOEPLAN_WEIGHT_PRECISION=bf16 to hold them at bfloat16")
            hold_fp8(owner, [p for p, shape in c.params if len(shape) == 3], self.fp8_block, given)

    def _fp8_pairs(self, weights: dict) -> dict:
        """{param: (FP8 values [n, N, K], scales [n, ...])} of the params whose every local expert arrived as
        FP8 beside its scales; a param only some of whose experts did has those dequantized in `weights`."""
        c, given = self.container, {}
        for p, _ in c.params:
            names = [f"{c.path}.{e}.{p}" for e in self.local]
            if names and all(name + SCALE_SUFFIX in weights for name in names):
                given[p] = (torch.stack([weights.pop(name) for name in names]),
                            torch.stack([weights.pop(name + SCALE_SUFFIX) for name in names]))
                continue
            for name in names:
                if name + SCALE_SUFFIX in weights:
                    weights[name] = dequantize(weights[name], weights.pop(name + SCALE_SUFFIX), self.fp8_block)
        return given

    @staticmethod
    def _set_param(owner, p: str, tensor) -> None:
        module_path, _, leaf = p.rpartition(".")
        target = owner.get_submodule(module_path) if module_path else owner
        setattr(target, leaf, nn.Parameter(tensor, requires_grad=False))

    def _set_expert_count(self, owner, n: int) -> None:
        if self.container.kind == "jetmoe":  # its router keeps counting all experts
            self.block.input_linear.num_experts = self.block.output_linear.num_experts = n
            return
        for m in owner.modules():  # experts modules size their loops by num_experts
            if hasattr(m, "num_experts"):
                m.num_experts = n

    def use_pool(self, root, pool, local: list, cache) -> None:
        """Run this block's experts from an expert cache's pool (runtime/offload/expert_cache.py):
        the library module's expert parameters become the pool's slots, shared by every MoE layer."""
        self._set_local(local)
        self.num_slots, self.expert_cache = pool.capacity, cache
        if self.container.kind == "tiny_moe":
            self.block.experts = pool.modules
            return
        owner = self.library_experts if self.container.kind in ("experts", "llama4") else _module(root, self.container.path)
        for p in pool.params:
            self._set_param(owner, p, pool.tensors[p])
        self._set_expert_count(owner, pool.capacity)

    @property
    def library_experts(self):
        """The library's experts module, holding this rank's experts only."""
        return self.block.experts.library

    # --- the local computation (an expert cache can wrap this one function) -----------------
    def local_expert_output(self, h: torch.Tensor, local_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Weighted sums [M, D] over K slots: token rows h [M, D], each slot routed to local expert
        index local_ids [M, K] (position in `self.local`) with gate weight weights [M, K]."""
        if self.expert_cache is not None:  # offloading: the cache loads each expert into a slot first
            return self.expert_cache.output(self, h, local_ids, weights)
        return self.slot_output(h, local_ids, weights)

    def slot_output(self, h: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """As `local_expert_output`, with slots [M, K] indexing the library module's experts directly:
        grouped GEMMs (`grouped_experts.py`), a fixed number of kernels for any number of experts."""
        kind = self.container.kind
        if h.shape[0] == 0:
            return torch.zeros_like(h)
        weights = weights.to(h.dtype)
        if kind == "experts":
            experts = self.library_experts
            if hasattr(experts, "has_gate"):  # decorated by transformers: the library's own grouped backend
                from transformers.integrations.moe import grouped_mm_experts_forward

                if holds_fp8(experts):  # the touched experts dequantized for this call
                    with touched_experts(experts, [p for p, _ in self.container.params], slots) as renumbered:
                        return grouped_mm_experts_forward(experts, h, renumbered, weights).reshape(h.shape)
                return grouped_mm_experts_forward(experts, h, slots, weights).reshape(h.shape)
            if type(experts).__name__ == "DbrxExperts":  # [E * ffn, D] slabs, looped over by the library
                mlp, n = experts.mlp, self.num_slots
                per = (n, mlp.w1.shape[0] // max(n, 1), mlp.w1.shape[1])
                return gated_experts(h, ExpertGroups(slots, weights, n), mlp.w1.view(per), mlp.v1.view(per),
                                     mlp.w2.view(per), mlp.activation_fn, down_transposed=True)
            return experts(h, slots, weights).reshape(h.shape)  # an experts module the runtime does not know: its own loop
        if kind == "llama4":  # the library's experts take [E_local * m, D] inputs, weight folded in
            rows, local_ids, w = _pairs(slots, weights)
            # at the experts' dtype: rows received from other ranks arrive as float32 (the exchange's rows)
            x = h[rows].to(self.library_experts.gate_up_proj.dtype)
            w = w.to(x.dtype)
            n, pos = self.num_slots, torch.arange(x.shape[0], device=h.device)
            inp = x.new_zeros(n, x.shape[0], x.shape[1])
            inp[local_ids, pos] = x * w[:, None]
            y = self.library_experts(inp.reshape(-1, x.shape[1])).view(n, x.shape[0], -1)[local_ids, pos]
            return torch.zeros_like(h).index_add_(0, rows, y.to(h.dtype))
        groups = ExpertGroups(slots, weights, self.num_slots)
        if kind == "jetmoe":
            block = self.block
            hidden = grouped_linear(groups.gather(h), block.input_linear.weight, groups)
            a, b = hidden.chunk(2, dim=-1)
            return groups.combine(grouped_linear(block.activation(a) * b, block.output_linear.weight, groups))
        # tiny_moe: a ModuleList of local experts (examples/tiny_moe/model.py: Expert, w_down(silu(w_gate x) * w_up x))
        w = stacked_expert_weights(self.block.experts, ("w_gate", "w_up", "w_down"))
        return gated_experts(h, groups, w["w_gate"], w["w_up"], w["w_down"], F.silu)

    # --- llama4 hooks ----------------------------------------------------------------------
    def _keep_scores(self, module, args, output):
        self._scores = output[0]

    def _keep_input(self, module, args):
        self._input = args[0].reshape(-1, args[0].shape[-1])

    def routed(self, h, ids, weights):
        """The engine's routed sum for rows h [n, D] with the library's top-k ids and weights [n, k],
        handed over heaviest first: routers need not sort them (DeepSeek-V2/V3 and GLM-4.5 take
        `torch.topk(..., sorted=False)`), and slot 0 is the primary of the replica rule."""
        if ids.shape[-1] > 1:  # `expert_table.heaviest_order` on the device: stable, ties keep the router's order
            weights, order = torch.sort(weights, dim=-1, descending=True, stable=True)
            ids = ids.gather(1, order)
        return self.route_fn(self, h, ids, weights)


def _pairs(slots: torch.Tensor, weights: torch.Tensor) -> tuple:
    """(token row int64 [M * K], slot int64 [M * K], weight [M * K]) of rows [M, K], row by row."""
    m, k = slots.shape
    return torch.arange(m, device=slots.device).repeat_interleave(k), slots.reshape(-1), weights.reshape(-1)


class _ExpertsSlot(nn.Module):
    """Stands where the library's experts module stood; calls the engine instead."""

    def __init__(self, adapter: MoEAdapter, library: nn.Module):
        super().__init__()
        self.__dict__["adapter"] = adapter
        self.library = library  # the library's experts module (local experts), still in the model

    def forward(self, hidden_states, top_k_index=None, top_k_weights=None):
        a = self.adapter
        if a.container.kind == "llama4":
            scores = a._scores  # [n, E], sigmoid of the top-k logits, 0 elsewhere
            k = int(a.block.top_k)
            weights, ids = torch.topk(scores, k, dim=-1)
            routed = a.routed(a._input, ids, weights)
            out = hidden_states.new_zeros(hidden_states.shape)
            out[: routed.shape[0]] = routed  # the block sums the E chunks of [E * n, D]
            return out
        shape = hidden_states.shape
        flat = hidden_states.reshape(-1, shape[-1])
        return a.routed(flat, top_k_index.reshape(flat.shape[0], -1), top_k_weights.reshape(flat.shape[0], -1)).reshape(shape)


def _jetmoe_forward(self, layer_input):
    """JetMoeMoE.forward with the routed computation handed to the engine (router, bias: the library's)."""
    bsz, length, emb = layer_input.size()
    flat = layer_input.reshape(-1, emb)
    index_sorted, _, batch_gates, expert_size, _ = self.router(flat)
    k = self.router.top_k
    n = flat.shape[0]
    expert_of = torch.repeat_interleave(torch.arange(len(expert_size), device=flat.device),
                                        torch.tensor(expert_size, device=flat.device))
    ids = torch.empty(n * k, dtype=torch.int64, device=flat.device)
    gates = torch.empty(n * k, dtype=batch_gates.dtype, device=flat.device)
    ids[index_sorted], gates[index_sorted] = expert_of, batch_gates
    routed = self._moeplan_adapter.routed(flat, ids.view(n, k), gates.view(n, k))
    return (routed + self.bias).view(bsz, length, emb)


def _tiny_moe_forward(self, x):
    """MoELayer.forward with the routed computation handed to the engine (router, shared: the module's)."""
    shape = x.shape
    flat = x.reshape(-1, shape[-1])
    _, ids, weights = self.route(flat)
    ids, weights = self.routing((ids, weights))
    out = self._moeplan_adapter.routed(flat, ids, weights)
    for shared in self.shared_experts:
        out = out + shared(flat)
    return out.reshape(shape)
