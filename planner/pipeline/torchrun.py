"""The torchrun and Kubernetes targets: affinity -> placement -> plan -> codegen.

The placement decision itself is `passes/optimize/placement/`; this file wires it. The plan pass
records every decision (placement, communication mode, the Kubernetes settings) and nothing of the
bundle's layout; the codegen pass adds the layout (shard names, model file paths) and writes the
bundle into a temporary directory that is renamed onto --out only when everything succeeded.

Facts read from the command: `topology` {"nodes", "gpus_per_node"}, `placement_options` (policy
flags), `mode` (coherent | standard), `target` {"name", and for kubernetes "image",
"storage_class"; "weights": "reference" for `--weights reference`}, `out`.

A Hugging Face directory with safetensors is imported on `meta` and its checkpoint streamed into
the shards tensor by tensor (`backends/common/checkpoint_index.py`): compile never holds the
model's weights. With `--weights reference` the bundle holds per-rank indexes into the checkpoint.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from moeplan.planner.pass_manager import Pass
from moeplan.planner.pipeline import cost as cost_passes
from moeplan.planner.pipeline import offload as offload_passes
from moeplan.planner.pipeline import placement as place_passes
from moeplan.planner.pipeline import common
from moeplan.planner.pipeline.common import MODEL_FILES, TRACE, needs_weights, trace_matches_model
from moeplan.planner.plan import Plan

def _affinity(facts):
    from moeplan.passes.analysis.affinity import top1_affinity

    return {"affinity": np.asarray(top1_affinity(facts["trace"]))}


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
    from moeplan.passes.optimize.placement.metrics import score_placement

    loaded, trace, placement = facts["model"], facts["trace"], facts["placement"]
    ir = loaded.ir
    score = score_placement(trace, placement.hosts(), placement.topology).as_dict()
    placement_doc = json.loads(placement.to_json())  # without run-dependent metrics (solve time)
    placement_doc.get("metrics", {}).pop("auto_predictions", None)  # recorded under predicted.cost.alternatives
    target = facts["target"]
    from moeplan.backends.common.model_source import library_pins

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
                "options": facts["placement_options"]},
        deployment={k: v for k, v in target.items() if k != "name"},
    )
    if facts["expert_cache"] is not None:  # issue 13: each rank caches among its experts (pipeline/offload.py)
        plan = dataclasses.replace(plan, communication={**plan.communication, "expert_cache": facts["expert_cache"]["communication"]},
                                   predicted={**plan.predicted, "expert_cache": facts["expert_cache"]["predicted"]},
                                   inputs={**plan.inputs, "offload": offload_passes.recorded_options(facts["offload_options"])})
    return {"plan": _with_capacity(plan, facts)}


def _with_capacity(plan: Plan, facts) -> Plan:
    """Issue 29: how many sequences of what context the ranks hold (passes/optimize/capacity.py)."""
    from moeplan.passes.optimize.capacity import device_memory, serving_capacity

    loaded, cache = facts["model"], plan.communication.get("expert_cache")
    config = getattr(loaded.module, "config", None) if loaded.module is not None else None
    resident = list(cache["capacity"]) if cache else [int(n) for n in facts["placement"].hosts().sum(axis=(0, 1))]
    capacity = serving_capacity(loaded.ir, config, resident, plan.communication["mode"], *device_memory(facts["offload_options"]))
    return dataclasses.replace(plan, communication={**plan.communication, "capacity": capacity})


def bundle_plan(plan: Plan, model_files: dict, checkpoint: dict | None = None) -> Plan:
    """The plan with the bundle's layout filled in: shard names, model files' paths, and for
    `--weights reference` the checkpoint the indexes point into (codegen adds the weights' hash)."""
    from moeplan.backends.common.shards import shard_name

    model = dict(plan.model, config="model/config.json")
    if "model/model.py" in model_files["files"]:
        model["source"] = "model/model.py"
    form = "reference" if checkpoint is not None else "copy"
    if checkpoint is not None:
        model["checkpoint"] = checkpoint
    return dataclasses.replace(plan, model=model, shards=[shard_name(r, form) for r in range(plan.world_size)])


def write_torchrun_bundle(out, plan: Plan, weights, model_files: dict, checkpoint: dict | None = None) -> dict:
    """The torchrun bundle, plus kubernetes/ manifests for that target, written atomically at `out`.

    `weights`: the library state dict or `TensorEntry`s (`weights_source`); `checkpoint`: the
    referenced checkpoint ({"path", "files"}) for `--weights reference`.
    """
    from moeplan.backends.common.manifest import write_manifest
    from moeplan.backends.torchrun.codegen import WeightsMismatch, write_bundle
    from moeplan.planner.atomic import atomic_path
    from moeplan.planner.errors import UserError

    plan = bundle_plan(plan, model_files, checkpoint)
    with atomic_path(Path(out), kind="bundle") as tmp:
        try:
            manifest = write_bundle(tmp, plan, weights, model_files["files"])
        except WeightsMismatch as exc:
            raise UserError(f"{exc}; give the plan's model with --model or plan again") from None
        if plan.communication.get("expert_cache"):  # the runtime's cache runs the simulator's policy code
            from moeplan.backends.common.files import write_file

            for rel, text in offload_passes.runtime_policy_files().items():
                write_file(tmp / rel, text)
            write_file(tmp / "requirements.txt", offload_passes.with_numpy((tmp / "requirements.txt").read_text()))
            manifest = write_manifest(tmp)
        if plan.target == "kubernetes":
            from moeplan.backends.kubernetes.codegen import write_manifests

            write_manifests(tmp, plan, image=plan.deployment["image"], storage_class=plan.deployment.get("storage_class"))
            manifest = write_manifest(tmp)
    return manifest


def weights_source(model_spec: str, loaded, model_files: dict, form: str = "copy") -> tuple:
    """(weights for codegen, referenced checkpoint or None): a Hugging Face safetensors directory is
    streamed (`TensorEntry`s reading one tensor at a time); other models give their state dict."""
    from moeplan.planner.errors import UserError
    from moeplan.planner.importers.hf_streaming import streamable_directory

    directory = streamable_directory(model_spec) if model_files["architecture"] == "transformers" else None
    if directory is None:
        if form == "reference":
            raise UserError(f"--weights reference needs a Hugging Face model directory with safetensors weights; "
                            f"'{model_spec}' is not one: use --weights copy")
        return loaded.module.state_dict(), None
    from moeplan.backends.common.checkpoint_index import checkpoint_entries, checkpoint_files
    from moeplan.backends.common.model_source import expert_containers

    containers = expert_containers("transformers", model_files["files"], spec=model_spec)
    entries, tensors = checkpoint_entries(directory, loaded.module, containers, model_spec)
    if form != "reference":
        return entries, None
    return entries, {"path": str(directory.resolve()), "files": checkpoint_files(directory, tensors)}


def _import(facts):
    """The model, on `meta` for a Hugging Face safetensors directory (codegen streams its weights)."""
    from moeplan.planner.importers.hf_streaming import load_directory_meta, streamable_directory

    directory = streamable_directory(facts["model_spec"])
    return {"model": load_directory_meta(directory)} if directory is not None else common.IMPORT.run(facts)


def _codegen(facts):
    form = facts["target"].get("weights", "copy")
    weights, checkpoint = weights_source(facts["model_spec"], facts["model"], facts["model_files"], form)
    return {"manifest": write_torchrun_bundle(facts["out"], facts["plan"], weights, facts["model_files"], checkpoint)}


AFFINITY = Pass("affinity", ("trace",), ("affinity",), _affinity)
# the placement pass of `moeplan place`, here also checking that the trace was recorded from this model;
# --policy auto prices every policy with the cost model (planner/pipeline/cost.py)
PLACEMENT = dataclasses.replace(place_passes.PLACEMENT, reads=place_passes.PLACEMENT.reads + ("model", "mode", "cost_options"),
                                run=cost_passes.placement_or_auto, check=trace_matches_model)
PLAN = Pass("plan", ("model", "model_spec", "model_files", "trace", "trace_sha256", "placement", "placement_options", "affinity", "mode",
                     "target", "cost", "expert_cache", "offload_options"), ("plan",), _plan)
CODEGEN = Pass("codegen", ("plan", "model", "model_spec", "model_files", "out", "target"), ("manifest",), _codegen,
               check=needs_weights)
IMPORT = dataclasses.replace(common.IMPORT, run=_import)

PASSES = [MODEL_FILES, IMPORT, TRACE, AFFINITY, PLACEMENT, cost_passes.COST, offload_passes.EXPERT_CACHE, PLAN, CODEGEN]
