"""The torchrun and Kubernetes targets: runtime files -> import -> trace -> affinity -> placement -> cost ->
expert caches -> plan -> codegen, as a pass list, with the facts it starts from and its summaries.

Each pass lives beside what it runs: `backends/common/model_source.py` (the runtime's model files),
`passes/importers/passes.py` (on `meta` for a Hugging Face safetensors directory), `passes/analysis/`
(trace, affinity), `passes/cost/cost_pass.py` (placement, --policy auto by predicted time, and the cost
pass), `passes/optimize/offload/passes.py` (expert caches), `passes/plan/torchrun_plan.py` (the plan)
and `backends/torchrun/codegen.py` (the bundle, written into a temporary directory renamed onto
--out only when everything succeeded).

Facts read from the command (`inputs`): `topology` {"nodes", "gpus_per_node"}, `placement_options`
(policy flags), `mode` (auto | coherent | standard), `target` {"name", for kubernetes what
`backends/kubernetes/deployment.py` records (image, weights source, hardware kind, scheduling); "weights":
"reference" for `--weights reference`}, `cost_options`,
`offload_options` (None without an expert cache), `out`.
"""
from __future__ import annotations

from moeplan.backends.common.model_source import MODEL_FILES
from moeplan.backends.torchrun.codegen import codegen_pass
from moeplan.passes.analysis.passes import AFFINITY
from moeplan.passes.analysis.trace.passes import TRACE
from moeplan.passes.cost.cost_pass import COST, PLACEMENT
from moeplan.passes.importers.passes import STREAMING_IMPORT
from moeplan.passes.optimize.offload.options import offload_options
from moeplan.passes.optimize.offload.passes import EXPERT_CACHE
from moeplan.passes.plan.torchrun_plan import PLAN

PLANNING = [MODEL_FILES, STREAMING_IMPORT, TRACE, AFFINITY, PLACEMENT, COST, EXPERT_CACHE, PLAN]
PASSES = PLANNING + [codegen_pass("torchrun")]
KUBERNETES_PASSES = PLANNING + [codegen_pass("kubernetes")]


def inputs(target: str, model: str, trace: str, out, values: dict) -> dict:
    """The facts the torchrun or kubernetes pass list starts from, from the flags' values."""
    from moeplan.passes.cost.options import default_cost_options
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
            "offload_options": offload_options(values, target)}


def summary(facts: dict) -> dict:
    """The --json summary's fields of a torchrun or kubernetes plan: scale, headline predictions."""
    from moeplan.passes.cost.options import describe_choice

    plan = facts["plan"].as_written()  # the figures as plan.json holds them
    comm, predicted = plan.communication, plan.predicted
    result = dict(world_size=plan.world_size, policy=plan.placement.policy, mode=comm.mode,
                  predicted={"gpu_local_fraction": predicted.gpu_local_fraction,
                             "node_local_fraction": predicted.node_local_fraction,
                             "max_over_mean_load": predicted.max_over_mean_load,
                             "routing": "planning trace", "trace_tokens": plan.inputs.get("trace_tokens")})
    cache = comm.expert_cache
    if cache:  # issue 13: per-rank expert caches
        result["expert_cache"] = {"capacity": cache["capacity"], "eviction": cache["eviction"], "prefetch": cache["prefetch"],
                                  "predicted_hit_ratio": predicted.expert_cache["hit_ratio"]}
    if comm.capacity:  # issue 29: what the service holds at once
        result["capacity"] = comm.capacity
    cost = predicted.cost
    if cost:  # issue 12: the cost model's figures for the chosen mode, and the profile they are for
        chosen = cost["modes"][cost["mode"]]
        result.update(hardware=cost["hardware"], choice=describe_choice(plan))
        result["predicted"].update(seconds_per_token=chosen["seconds_per_token"],
                                   total_bytes_per_token=chosen["total_bytes_per_token"], workload=cost["workload"])
    return result


def describe(summary: dict, facts: dict) -> str:
    """What a plan or bundle holds, in one line (and the cost model's choice, the expert caches,
    the serving capacity)."""
    p = summary["predicted"]
    tokens = f" ({p['trace_tokens']:,} tokens)" if p.get("trace_tokens") is not None else ""
    lines = [f"{summary['world_size']} ranks; on the planning trace{tokens}: gpu_local_fraction {p['gpu_local_fraction']:.3f}, "
             f"node_local_fraction {p['node_local_fraction']:.3f}, max/mean load {p['max_over_mean_load']:.3f}"]
    if "choice" in summary:
        lines.append(summary["choice"])
    if "expert_cache" in summary:
        c = summary["expert_cache"]
        lines.append(f"expert caches: {c['capacity']} entries per rank, eviction {c['eviction']}, prefetch {c['prefetch']}, "
                     f"predicted hit ratio {c['predicted_hit_ratio']:.3f}")
    if "capacity" in summary:
        from moeplan.passes.cost.capacity import describe_capacity

        lines.append(describe_capacity(summary["capacity"]))
    return "\n".join(lines)
