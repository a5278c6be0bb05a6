"""nn.Module -> ModelIR: read the parameters (real or meta) and apply the shared stage rules.

Only parameter names, shapes and dtypes decide the stages (`stages.py`), so that an ONNX import of
the same model reproduces them. The module itself is consulted for two things the parameters
cannot say: the order stages run in (`forward_order.py`, read from the forward code) and how
many experts each token picks (top-k), read from the MoE block, its router, or the config.
"""
from __future__ import annotations

from typing import Any

from moeplan.core.errors import UserError
from moeplan.passes.importers.forward_order import module_ranks, rank_of
from moeplan.passes.importers.stages import Param, build_model_ir, classify_parameter_groups
from moeplan.core.ir import ModelIR

TOP_K_NAMES = ("top_k", "num_experts_per_tok", "num_selected_experts", "moe_top_k", "moe_topk", "topk", "k")


def module_params(module) -> list:
    """`Param`s in registration order; a parameter reachable twice (tied) is marked as an alias."""
    first_name: dict = {}
    out = []
    for name, tensor in module.named_parameters(remove_duplicate=False):
        owner = first_name.setdefault(id(tensor), name)
        dtype = str(tensor.dtype).replace("torch.", "")
        out.append(Param(name, tuple(int(d) for d in tensor.shape), dtype, "" if owner == name else owner))
    return out


def _int_attr(obj: Any, names=TOP_K_NAMES) -> int | None:
    if obj is None:
        return None
    for attr in names:
        value = obj.get(attr) if isinstance(obj, dict) else getattr(obj, attr, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def find_top_k(module, moe_path: str, router_path: str, config: Any = None) -> int:
    """Experts per token for the MoE block at `moe_path`: block, then router, then config."""
    found = (
        _int_attr(module.get_submodule(moe_path) if moe_path else module)
        or _int_attr(module.get_submodule(router_path))
        or _int_attr(config)
        or _int_attr(getattr(module, "config", None))
    )
    if found is None:
        raise UserError(
            f"cannot tell how many experts a token uses in MoE layer {moe_path!r}; "
            "give the MoE module (or its router) a `top_k` attribute"
        )
    return found


def import_module(
    module,
    *,
    name: str | None = None,
    config: Any = None,
    source_format: str = "torch",
    storage=None,
) -> ModelIR:
    """The IR of `module`; raises UserError if it has no MoE layer or its top-k is unknowable.

    `storage` (a `quantization.Quantization` or `Float8Storage`) gives weights the size the checkpoint stores
    them at, when that differs from the module's dtype.
    """
    architecture = type(module).__name__
    name = name or architecture
    groups = classify_parameter_groups(module_params(module))
    ranks = module_ranks(module)
    groups = sorted(groups, key=lambda g: rank_of(g.name, ranks))  # stable: ties keep parameter order
    moe = [g for g in groups if g.is_moe]
    if not moe:
        raise UserError(f"model {name} has no Mixture-of-Experts layer; moeplan plans MoE models only")
    routed = moe + [inner for g in groups for inner in g.attention_experts]
    top_k = {g.name: find_top_k(module, g.name, g.router, config) for g in routed}
    label = ""
    if storage is not None:
        groups, label = storage.apply(groups), storage.label()
    return build_model_ir(
        groups, name=name, architecture=architecture, top_k=top_k, source_format=source_format,
        quantization=label,
    )
