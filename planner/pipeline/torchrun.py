"""The torchrun and Kubernetes targets: affinity -> placement -> cost -> expert caches -> plan -> codegen.

The placement decision itself is `passes/optimize/placement/`; this file wires it. The plan pass
records every decision (placement, communication mode, the Kubernetes settings) and nothing of the
bundle's layout; the codegen pass adds the layout (shard names, model file paths) and writes the
bundle into a temporary directory that is renamed onto --out only when everything succeeded.

Facts read from the command (`inputs`): `topology` {"nodes", "gpus_per_node"}, `placement_options`
(policy flags), `mode` (auto | coherent | standard), `target` {"name", for kubernetes what
`backends/kubernetes/deployment.py` records (image, weights source, hardware kind, scheduling); "weights":
"reference" for `--weights reference`}, `cost_options`,
`offload_options` (None without an expert cache), `out`.

A Hugging Face directory with safetensors is imported on `meta` and its checkpoint streamed into
the shards tensor by tensor (`backends/common/checkpoint_index.py`): compile never holds the
model's weights. With `--weights reference` the bundle holds per-rank indexes into the checkpoint.
"""
from __future__ import annotations

import dataclasses
import json

import numpy as np

from moeplan.core.pass_manager import Pass
from moeplan.planner.pipeline import cost_passes
from moeplan.planner.pipeline import offload as offload_passes
from moeplan.planner.pipeline import placement as place_passes
from moeplan.planner.pipeline import common
from moeplan.planner.pipeline.common import MODEL_FILES, TRACE, needs_weights, plan_reads_back, trace_matches_model
from moeplan.core.plan import Plan

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
    from moeplan.core.hardware import load_hardware

    loaded, cache = facts["model"], plan.communication.get("expert_cache")
    config = getattr(loaded.module, "config", None) if loaded.module is not None else None
    resident = list(cache["capacity"]) if cache else [int(n) for n in facts["placement"].hosts().sum(axis=(0, 1))]
    profile = load_hardware(facts["cost_options"]["hardware"])  # the plan's one profile
    capacity = serving_capacity(loaded.ir, config, resident, plan.communication["mode"],
                                *device_memory(facts["offload_options"], profile,
                                               facts["placement"].topology.gpus_per_node))
    return dataclasses.replace(plan, communication={**plan.communication, "capacity": capacity})


def weights_source(model_spec: str, loaded, model_files: dict, form: str = "copy") -> tuple:
    """(weights for codegen, referenced checkpoint or None): a Hugging Face safetensors directory is
    streamed (`TensorEntry`s reading one tensor at a time); other models give their state dict."""
    from moeplan.core.errors import UserError
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


def write_bundle(backend: str, out, plan: Plan, model_spec: str, loaded, model_files: dict) -> dict:
    """The plan's bundle at `out` by `backends/<backend>/codegen.py` (torchrun, or kubernetes: the
    torchrun bundle plus manifests), its weights read from the model."""
    import importlib

    weights, checkpoint = weights_source(model_spec, loaded, model_files, plan.deployment.get("weights", "copy"))
    writer = importlib.import_module(f"moeplan.backends.{backend}.codegen").write_bundle
    return writer(out, plan, weights, model_files, checkpoint)


def codegen_pass(backend: str) -> Pass:
    """The codegen pass writing the bundle with `backends/<backend>/codegen.py`."""
    def codegen(facts):
        return {"manifest": write_bundle(backend, facts["out"], facts["plan"], facts["model_spec"], facts["model"],
                                         facts["model_files"])}

    return Pass("codegen", ("plan", "model", "model_spec", "model_files", "out"), ("manifest",), codegen, check=needs_weights)


AFFINITY = Pass("affinity", ("trace",), ("affinity",), _affinity)
# the placement pass of `moeplan place`, here also checking that the trace was recorded from this model;
# --policy auto prices every policy with the cost model (planner/pipeline/cost_passes.py)
PLACEMENT = dataclasses.replace(place_passes.PLACEMENT, reads=place_passes.PLACEMENT.reads + ("model", "mode", "cost_options"),
                                run=cost_passes.placement_or_auto, check=trace_matches_model)
PLAN = Pass("plan", ("model", "model_spec", "model_files", "trace", "trace_sha256", "placement", "placement_options", "affinity", "mode",
                     "target", "cost", "expert_cache", "offload_options", "cost_options"), ("plan",), _plan,
            ensures=plan_reads_back)
IMPORT = dataclasses.replace(common.IMPORT, run=_import)

PLANNING = [MODEL_FILES, IMPORT, TRACE, AFFINITY, PLACEMENT, cost_passes.COST, offload_passes.EXPERT_CACHE, PLAN]
PASSES = PLANNING + [codegen_pass("torchrun")]
KUBERNETES_PASSES = PLANNING + [codegen_pass("kubernetes")]


def inputs(target: str, model: str, trace: str, out, values: dict) -> dict:
    """The facts the torchrun or kubernetes pass list starts from, from the flags' values."""
    from moeplan.planner.pipeline.cost_passes import default_cost_options
    from moeplan.planner.pipeline.flags import PLACEMENT_FLAGS, pick

    spec = {"name": target}
    if target == "kubernetes":  # the hardware, image and weights' way to the pods, checked before planning
        from moeplan.backends.kubernetes.deployment import deployment

        spec.update(deployment(values))
    if values["weights"] == "reference":  # recorded in the plan's deployment; codegen writes checkpoint indexes
        spec["weights"] = "reference"
    return {"model_spec": str(model), "trace_path": str(trace), "out": None if out is None else str(out),
            "topology": {"nodes": values["nodes"], "gpus_per_node": values["gpus_per_node"]},
            "placement_options": pick(values, PLACEMENT_FLAGS), "mode": values["mode"], "target": spec,
            "cost_options": default_cost_options({"hardware": values["hardware"], "workload": values["workload"]},
                                                 values["nodes"]),
            "offload_options": offload_passes.offload_options(values, target)}


def summary(facts: dict) -> dict:
    """The --json summary's fields of a torchrun or kubernetes plan: scale, headline predictions."""
    from moeplan.planner.pipeline.cost_passes import describe_choice

    plan = facts["plan"]
    doc = plan.to_dict()
    result = dict(world_size=plan.world_size, policy=doc["placement"].get("policy"), mode=doc["communication"]["mode"],
                  predicted={k: doc["predicted"][k] for k in ("gpu_local_fraction", "node_local_fraction", "max_over_mean_load")})
    cache = doc["communication"].get("expert_cache")
    if cache:  # issue 13: per-rank expert caches
        result["expert_cache"] = {"capacity": cache["capacity"], "eviction": cache["eviction"], "prefetch": cache["prefetch"],
                                  "predicted_hit_ratio": doc["predicted"]["expert_cache"]["hit_ratio"]}
    if doc["communication"].get("capacity"):  # issue 29: what the service holds at once
        result["capacity"] = doc["communication"]["capacity"]
    cost = doc["predicted"].get("cost")
    if cost:  # issue 12: the cost model's figures for the chosen mode, and the profile they are for
        chosen = cost["modes"][cost["mode"]]
        result.update(hardware=cost["hardware"], choice=describe_choice(doc))
        result["predicted"].update(seconds_per_token=chosen["seconds_per_token"],
                                   total_bytes_per_token=chosen["total_bytes_per_token"])
    return result


def describe(summary: dict, facts: dict) -> str:
    """What a plan or bundle holds, in one line (and the cost model's choice, the expert caches,
    the serving capacity)."""
    p = summary["predicted"]
    lines = [f"{summary['world_size']} ranks; predicted gpu_local_fraction {p['gpu_local_fraction']:.3f}, "
             f"node_local_fraction {p['node_local_fraction']:.3f}, max/mean load {p['max_over_mean_load']:.3f}"]
    if "choice" in summary:
        lines.append(summary["choice"])
    if "expert_cache" in summary:
        c = summary["expert_cache"]
        lines.append(f"expert caches: {c['capacity']} entries per rank, eviction {c['eviction']}, prefetch {c['prefetch']}, "
                     f"predicted hit ratio {c['predicted_hit_ratio']:.3f}")
    if "capacity" in summary:
        from moeplan.passes.optimize.capacity import describe_capacity

        lines.append(describe_capacity(summary["capacity"]))
    return "\n".join(lines)
