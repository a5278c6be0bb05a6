"""`moeplan compile MODEL --trace T --target sglang|trtllm`: a placement that a serving engine loads.

Only the model's config is read (the model is built on the `meta` device), so full-size models
plan without weights. Steps: import the config -> check the trace against it -> placement
(`passes/optimize/placement/policies.py`) -> slot lists (`backends/common/expert_slots.py`) ->
the engine's files (`backends/sglang/`, `backends/trtllm/`), written into a temporary directory
that is renamed onto --out only when everything succeeded.

What the plan optimises: SGLang and TensorRT-LLM run standard expert parallelism. Every token
goes from its attention rank to the ranks of its experts and its outputs are combined back at
that home rank, at every MoE layer. A token's route therefore does not depend on where its
previous layer's experts ran, and inter-layer affinity buys nothing. What sets an MoE layer's
time is its busiest rank, so the default policy is `eplb` (balance: max over mean rank load per
layer, replicas sharing their expert's tokens evenly, as the engines' dynamic/random dispatch
over replicas does). `ilp` is accepted for per-token traces; its affinity term then only
reshuffles experts among equally balanced layouts.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

from moeplan.planner.errors import UserError

ENGINE_TARGETS = ("sglang", "trtllm")
DEFAULT_ENGINE_POLICY = "eplb"
OBJECTIVE = ("balance under standard expert parallelism (tokens combine at their home rank every MoE layer): "
             "max over mean rank load per MoE layer, replicas splitting their expert's tokens evenly")
LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def read_config(model_spec: str) -> tuple:
    """(config path, config dict) of a Hugging Face config file or model directory."""
    path = Path(model_spec)
    config_path = path / "config.json" if path.is_dir() else path
    if not config_path.is_file():
        raise UserError(f"'{model_spec}' is neither a config.json nor a directory with one; the sglang and trtllm "
                        f"targets need the model's Hugging Face config (e.g. examples/configs/deepseek-v3.json)")
    try:
        config = json.loads(config_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"'{config_path}' is not valid JSON ({exc.__class__.__name__})") from None
    if not isinstance(config, dict) or not isinstance(config.get("num_hidden_layers"), int):
        raise UserError(f"'{config_path}' has no integer num_hidden_layers; the sglang and trtllm targets need a "
                        f"Hugging Face decoder config")
    return config_path, config


def moe_layer_indices(ir, num_hidden_layers: int) -> list:
    """Decoder-layer index of each MoE stage, from its module path (`...layers.<i>.mlp`)."""
    indices = []
    for stage in ir.moe_stages:
        match = LAYER_INDEX.search(f"{stage.name}.") or LAYER_INDEX.search(f"{stage.source}.")
        if not match:
            raise UserError(f"cannot tell which decoder layer MoE stage '{stage.name}' is; the sglang and trtllm "
                            f"targets need a Hugging Face model whose MoE blocks sit in model.layers.<i>")
        indices.append(int(match.group(1)))
    if indices != sorted(set(indices)) or indices[-1] >= num_hidden_layers:
        raise UserError(f"the model's MoE layers {indices[:6]}... do not fit its {num_hidden_layers} decoder layers")
    return indices


def compile_engine(model_spec: str, trace_path: str, target: str, nodes: int, gpus_per_node: int, out: str,
                   policy: str | None = None, redundant: int = 0, balance: float | None = None,
                   time_limit: float = 30.0, effort: float = 1.0, kubernetes: bool = False,
                   image: str | None = None, quiet: bool = True) -> dict:
    """Plan a placement for `target` (sglang or trtllm) and write its files; returns a summary."""
    from moeplan.backends.common.expert_slots import placement_slots
    from moeplan.passes.analysis.trace.format import load_trace, trace_file_sha256
    from moeplan.passes.optimize.placement.decision import Topology
    from moeplan.planner.atomic import atomic_path
    from moeplan.planner.compile_pipeline import NONDETERMINISTIC_METRICS, check_trace_matches, run_placement
    from moeplan.planner.importers import load_model
    from moeplan.planner.plan import Plan

    if target not in ENGINE_TARGETS:
        raise ValueError(target)
    if nodes < 1 or gpus_per_node < 1:
        raise UserError(f"--nodes and --gpus-per-node must be at least 1, got {nodes} and {gpus_per_node}")
    if kubernetes and target != "sglang":
        raise UserError("--kubernetes applies to --target sglang (and the torchrun bundle's --target kubernetes)")
    config_path, config = read_config(model_spec)
    ir = load_model(str(config_path)).ir
    layers = moe_layer_indices(ir, config["num_hidden_layers"])
    trace = load_trace(trace_path)
    check_trace_matches(ir, trace)
    num_experts, top_k = ir.moe_stages[0].num_experts, ir.moe_stages[0].top_k
    policy = policy or DEFAULT_ENGINE_POLICY
    options = {"policy": policy, "redundant": redundant, "time_limit": time_limit, "effort": effort,
               "expert_groups": int(config.get("n_group") or 0)}
    if balance is not None:
        options["balance"] = balance
    topology = Topology(nodes, gpus_per_node)
    placement = run_placement(_widen(trace, num_experts), topology, **options)
    doc = json.loads(placement.to_json())
    for key in NONDETERMINISTIC_METRICS:
        doc.get("metrics", {}).pop(key, None)
    slots = placement_slots(doc, num_experts, redundant)
    plan = Plan(
        target=target,
        model={"name": ir.name, "architecture": (config.get("architectures") or [ir.architecture])[0],
               "model_type": config.get("model_type"), "num_hidden_layers": config["num_hidden_layers"],
               "moe_layer_indices": layers, "moe_layers": len(layers), "num_experts": num_experts, "top_k": top_k},
        topology={"nodes": nodes, "gpus_per_node": gpus_per_node},
        placement=doc,
        communication={"mode": "standard", "engine": target, "ep_size": topology.devices,
                       "slots_per_rank": (num_experts + redundant) // topology.devices, "redundant": redundant,
                       "objective": OBJECTIVE},
        predicted={"max_over_mean_load": doc["metrics"]["max_over_mean_load"]},
        inputs={"trace_sha256": trace_file_sha256(trace_path), "trace_tokens": trace.num_tokens,
                "trace_loads_only": trace.loads_only, "options": options},
    )
    with atomic_path(Path(out)) as tmp:
        if target == "sglang":
            from moeplan.backends.sglang.codegen import write_sglang_bundle

            manifest = write_sglang_bundle(tmp, plan, slots, kubernetes=kubernetes, image=image)
        else:
            from moeplan.backends.trtllm.codegen import write_trtllm_bundle

            manifest = write_trtllm_bundle(tmp, plan, slots)
    return {"out": str(out), "target": target, "world_size": topology.devices, "policy": policy,
            "redundant": redundant, "predicted": plan.to_dict()["predicted"], "files": len(manifest["files"]),
            "objective": "balance"}


def _widen(trace, num_experts: int):
    """The trace with the model's expert count (a trace that never routed to the last experts
    still places them)."""
    from moeplan.passes.analysis.trace.format import make_trace

    if trace.num_experts == num_experts:
        return trace
    loads = None
    if trace.loads_only:
        loads = np.zeros((trace.num_layers, num_experts), dtype=np.int64)
        loads[:, :trace.num_experts] = trace.loads
    return make_trace(trace.experts, trace.weights, num_experts=num_experts, token_ids=trace.token_ids,
                      positions=trace.positions, sequence=trace.sequence, attention_ids=trace.attention_ids,
                      loads=loads)
