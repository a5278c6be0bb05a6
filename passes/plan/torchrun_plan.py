"""The plan pass of the torchrun and Kubernetes targets: every decision in one Plan.

The plan records the placement (`passes/optimize/placement/`), the communication mode and its
predicted cost (`passes/cost/`), the expert caches (`passes/optimize/offload/`), the serving
capacity (`passes/cost/capacity.py`), the Kubernetes settings and the planning trace's loads and
affinity (`passes/analysis/trace_summary.py`, for the report), and nothing of the bundle's
layout: the codegen pass (`backends/torchrun/codegen.py`) adds that (shard names, model file
paths) when it writes the bundle.
"""
from __future__ import annotations

import dataclasses
import json

from moeplan.core.library_pins import library_pins
from moeplan.core.pass_manager import Pass
from moeplan.core.plan import Plan, plan_reads_back
from moeplan.passes.optimize.offload.options import recorded_options


def communication(mode: str, moe_layers: int) -> dict:
    """What the runtime is configured with: how tokens move in each MoE layer."""
    coherent = mode == "coherent"
    return {
        "mode": mode, "gating": "dynamic",
        "layers": [{"layer": l, "all_to_all": "variable-size",
                    "exchanges": ["dispatch", "merge"] if coherent else ["dispatch", "combine"]} for l in range(moe_layers)],
        "attention_state": ("replicated KV cache: every rank computes up to the first MoE router itself, then each "
                            "token's normed hidden state is sent to every rank at every later layer") if coherent else "owner rank",
    }


def _plan(facts):
    from moeplan.passes.analysis.trace_summary import trace_summary
    from moeplan.passes.optimize.placement.metrics import score_placement

    loaded, trace, placement = facts["model"], facts["trace"], facts["placement"]
    ir = loaded.ir
    score = score_placement(trace, placement.hosts(), placement.topology).as_dict()
    placement_doc = json.loads(placement.to_json())  # without run-dependent metrics (solve time)
    placement_doc.get("metrics", {}).pop("auto_predictions", None)  # recorded under predicted.cost.alternatives
    placement_doc.get("metrics", {}).pop("auto_stop", None)  # and predicted.cost.auto_stop
    target = facts["target"]
    model = {"name": ir.name, "architecture": facts["model_files"]["architecture"],
             "library": library_pins(facts["model_files"]["architecture"]),
             "moe_layers": len(ir.moe_stages), "num_experts": ir.moe_stages[0].num_experts,
             "top_k": ir.moe_stages[0].top_k, "ir": ir.to_dict()}
    plan = Plan(
        target=target["name"], model=model,
        topology={"nodes": placement.topology.nodes, "gpus_per_node": placement.topology.gpus_per_node},
        placement=placement_doc,
        communication=communication(facts["cost"]["mode"], len(ir.moe_stages)),
        predicted={**score, "inter_layer_top1_affinity": [float(a) for a in facts["affinity"]],
                   "cost": facts["cost"]["doc"]},
        inputs={"model": facts["model_spec"], "trace_sha256": facts["trace_sha256"], "trace_tokens": trace.num_tokens,
                "options": facts["placement_options"], "trace_summary": trace_summary(trace, placement.hosts())},
        deployment={k: v for k, v in target.items() if k != "name"},
    )
    if facts["expert_cache"] is not None:  # issue 13: each rank caches among its experts (passes/optimize/offload/)
        plan = dataclasses.replace(plan, communication={**plan.communication.to_json(), "expert_cache": facts["expert_cache"]["communication"]},
                                   predicted={**plan.predicted.to_json(), "expert_cache": facts["expert_cache"]["predicted"]},
                                   inputs={**plan.inputs, "offload": recorded_options(facts["offload_options"])})
    return {"plan": _with_capacity(plan, facts)}


def _with_capacity(plan: Plan, facts) -> Plan:
    """Issue 29: how many sequences of what context the ranks hold (passes/cost/capacity.py)."""
    from moeplan.passes.cost.capacity import device_memory, held_weights, serving_capacity
    from moeplan.core.hardware import load_hardware

    loaded, cache = facts["model"], plan.communication.expert_cache
    config = getattr(loaded.module, "config", None) if loaded.module is not None else None
    resident = list(cache["capacity"]) if cache else [int(n) for n in facts["placement"].hosts().sum(axis=(0, 1))]
    profile = load_hardware(facts["cost_options"]["hardware"])  # the plan's one profile
    capacity = serving_capacity(loaded.ir, config, resident, plan.communication.mode,
                                *device_memory(facts["offload_options"], profile,
                                               facts["placement"].topology.gpus_per_node),
                                held_weights(loaded.ir, profile))
    return dataclasses.replace(plan, communication={**plan.communication.to_json(), "capacity": capacity})


PLAN = Pass("plan", ("model", "model_spec", "model_files", "trace", "trace_sha256", "placement", "placement_options", "affinity", "mode",
                     "target", "cost", "expert_cache", "offload_options", "cost_options"), ("plan",), _plan,
            ensures=plan_reads_back)
