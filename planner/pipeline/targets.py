"""The targets: each a pass list ending in its codegen pass; planning is the same list asked for the plan.

`run_target` is what `moeplan compile` and `moeplan plan` call; `codegen_from_plan` is what
`moeplan codegen plan.json` calls: the target's codegen alone, from the plan and the weights.
"""
from __future__ import annotations

from moeplan.planner.errors import UserError
from moeplan.planner.pass_manager import PassManager
from moeplan.planner.pipeline import common, engines, lambda_, torchrun

TARGETS = {"torchrun": torchrun.PASSES, "kubernetes": torchrun.KUBERNETES_PASSES, "lambda": lambda_.PASSES,
           "sglang": engines.PASSES, "trtllm": engines.PASSES}


def run_target(target: str, facts: dict, *, plan_only: bool = False, quiet: bool = False) -> tuple:
    """(facts, pass timings) of the target's pipeline; with `plan_only`, just what the plan needs."""
    if target not in TARGETS:
        raise UserError(f"unknown target '{target}'; use one of {', '.join(TARGETS)}")
    manager = PassManager(TARGETS[target], quiet=quiet)
    facts = manager.run(facts, want=("plan",) if plan_only else None)
    return facts, manager.timings()


def codegen_from_plan(plan, model_spec: str, out: str) -> dict:
    """The bundle of a written plan: the target's codegen over the plan and the model's weights."""
    if plan.target not in TARGETS:
        raise UserError(f"plan target '{plan.target}' has no codegen; use one of {', '.join(TARGETS)}")
    if plan.target in engines.ENGINE_TARGETS:  # placement files only: no weights
        return engines.write_bundle(out, plan)
    runtime = lambda_.MODEL_FILES if plan.target == "lambda" else common.MODEL_FILES
    files = runtime.run({"model_spec": model_spec})["model_files"]
    importer = common.IMPORT if plan.target == "lambda" else torchrun.IMPORT  # a Hugging Face checkpoint streams
    loaded = importer.run({"model_spec": model_spec})["model"]
    _require_weights(loaded, model_spec)
    try:
        if plan.target == "lambda":
            from moeplan.backends.lambda_.codegen import write_bundle

            return write_bundle(out, plan, loaded.module.state_dict(), files)
        return torchrun.write_bundle(plan.target, out, plan, model_spec, loaded, files)
    except UserError as exc:
        raise UserError(str(exc).replace("the weights are", f"the weights of '{model_spec}' are")) from None


def _require_weights(loaded, model_spec: str) -> None:
    if loaded.module is None or not loaded.has_weights:
        raise UserError(f"model '{model_spec}' has no weights to ship; codegen needs the weights the plan was made for")


def compile_bundle(model_spec: str, trace_path: str, nodes: int, gpus_per_node: int, out: str, placement_options: dict,
                   mode: str = "coherent", quiet: bool = False, target: dict | None = None,
                   cost_options: dict | None = None, offload_options: dict | None = None) -> tuple:
    """A torchrun (or kubernetes) bundle from Python, as `moeplan compile` writes it; (facts, timings).

    `placement_options` holds any `PlacementRequest` fields (policy, redundant, time_limit, ...);
    policy and `mode` may be "auto" (by the cost model's predicted time under `cost_options`
    {"hardware", "workload"}, default cpu-gloo and 8x32+8).
    """
    from moeplan.planner.pipeline.cost import default_cost_options

    if nodes < 1 or gpus_per_node < 1:
        raise UserError(f"--nodes and --gpus-per-node must be at least 1, got {nodes} and {gpus_per_node}")
    target = target or {"name": "torchrun"}
    return run_target(target["name"], {
        "model_spec": str(model_spec), "trace_path": str(trace_path), "out": str(out),
        "topology": {"nodes": nodes, "gpus_per_node": gpus_per_node}, "placement_options": dict(placement_options),
        "mode": mode, "target": target, "cost_options": default_cost_options(cost_options),
        "offload_options": offload_options}, quiet=quiet)
