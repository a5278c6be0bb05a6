"""Coherent mode's context rows as the cost model prices them: per decoder block, what the runtime
sends per token (the hidden state or the cache's K/V; `runtime/ep/context_exchange.py` chooses),
read off a model or a bundle, and the model's shape with them and with its attention at context
(`attention_context.py`; recorded in plan.json `predicted.cost.attention_context`).
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from moeplan.passes.cost.attention_context import AttentionContext, runtime_attention_context
from moeplan.passes.cost.cost_model import FLOAT, ModelShape


def context_plan_of(module, choice: str = "auto") -> list:
    """[[hidden | kv, elements per token]] per decoder block: the runtime's own choice of coherent
    mode's context row (`runtime/ep/context_exchange.py`), read off the model's modules
    (meta device is enough); [] when the runtime cannot run the model."""
    from moeplan.runtime.ep.context_exchange import model_context_plan
    from moeplan.runtime.model.library_model import ModelError

    if module is None:
        return []
    try:
        return [[kind, int(n)] for kind, n in model_context_plan(module, choice)]
    except (ModelError, StopIteration):
        return []


def shape_with_context(ir, context: list, attention: AttentionContext | None = None, graphs: bool = False,
                       wire_bytes: int = FLOAT, held_dtype: str = "bfloat16") -> ModelShape:
    """The IR's shape with coherent mode's per-block context rows (when they cover every block), its attention at
    context (None: priced at a short context), whether the runtime can capture its decode steps as CUDA graphs
    (`runtime_ops.decode_graphs_possible`), the bytes of a gathered exchange's element (`gathered_wire_bytes`) and the
    dtype the runtime holds its dense weights at (whose op counts price it)."""
    shape = replace(ModelShape.from_ir(ir), attention_context=attention, decode_graphs=graphs, wire_bytes=wire_bytes,
                    held_dtype=held_dtype)
    if len(context) != shape.num_blocks:
        return shape
    return replace(shape, context_elements=tuple(n for _, n in context))


def priced_shape(ir, module, profile, context: list | None = None, graphs: bool = True) -> ModelShape:
    """The shape a plan on `profile` is priced with: the model's attention at context at the KV dtype held there
    (`attention_of`), whether its decode steps can be captured there (`runtime_ops.decode_graphs_possible`; never
    with `graphs` False), the bytes of its gathered rows (`gathered_wire_bytes`) and the dtype its dense weights are
    held at there, with coherent mode's context rows."""
    from moeplan.passes.cost.runtime_ops import decode_graphs_possible

    return shape_with_context(ir, context or [], attention_of(module, ir, profile),
                              graphs and decode_graphs_possible(module, ir, profile), gathered_wire_bytes(ir, profile),
                              held_dense_dtype(ir, profile))


def held_dense_dtype(ir, profile) -> str:
    """The dtype the runtime holds the model's dense weights (and so its hidden state and KV cache) at on `profile`
    (`capacity.held_weights`; None: float32)."""
    from moeplan.passes.cost.capacity import held_weights

    return held_weights(ir, profile)["dtypes"]["dense"] if profile is not None else "float32"


def attention_of(module, ir, profile=None) -> AttentionContext:
    """The model's attention at context as the runtime runs it, from its library config (none: the IR's), with
    its KV cache at the dtype the runtime holds the model at on `profile` (None: float32)."""
    config = getattr(module, "config", None) if module is not None else None
    return runtime_attention_context(config, ir, held_dense_dtype(ir, profile))


def gathered_wire_bytes(ir, profile) -> int:
    """Bytes of one element of a gathered exchange's rows on `profile` (runtime/ep/gathered_moe.py `wire_dtype`, at
    the dtype the runtime holds the model's dense weights, and so its hidden state, at there)."""
    from moeplan.runtime.ep.gathered_moe import wire_dtype
    from moeplan.runtime.precision import torch_dtype

    dense = torch_dtype(held_dense_dtype(ir, profile))
    return wire_dtype(dense, int(ir.moe_stages[0].hidden_size), int(ir.moe_stages[0].num_experts)).itemsize


def attention_record(attention: AttentionContext | None) -> dict:
    """plan.json `predicted.cost.attention_context`: what the cost model priced attention at context with."""
    return {} if attention is None else {"flops_per_key": attention.flops_per_key, "kv_bytes_per_key": attention.kv_bytes_per_key}


def shape_of_plan(plan: dict, context: list | None = None) -> ModelShape:
    """The shape a plan was priced with: its context rows, its recorded attention at context (plans written before
    it was recorded: a short context, as they were priced) and the dtype its counted ops were taken at (plans priced
    with the fitted counts, or before it was recorded: bf16's)."""
    cost = plan.get("predicted", {}).get("cost", {})
    recorded = cost.get("attention_context")
    return shape_with_context(_ir(plan), context or [], AttentionContext(**recorded) if recorded else None,
                              wire_bytes=int(cost.get("gathered_wire_bytes", FLOAT)),
                              held_dtype=(cost.get("runtime_ops") or {}).get("dtype") or "bfloat16")


def bundle_context_plan(root: Path, plan: dict, choice: str = "auto") -> list:
    """The context plan a bundle's runtime follows: recorded by compile, else read off its model
    (built on meta); with choice 'hidden' every block sends the hidden state."""
    recorded = plan.get("predicted", {}).get("cost", {}).get("context") if choice == "auto" else None
    if recorded is None and plan["model"].get("architecture") == "transformers":
        from moeplan.runtime.model.library_model import build_transformers

        recorded = context_plan_of(build_transformers((root / plan["model"]["config"]).parent, device="meta"), choice)
    return recorded or []


def _ir(plan: dict):
    from moeplan.core.ir import ModelIR

    return ModelIR.from_dict(plan["model"]["ir"])
