"""The sglang, vllm and trtllm targets: the engine's deployment and the placement it loads at startup.

Passes: import (the config alone is enough: full-size models are built on the `meta` device) ->
layers (which decoder layers are MoE, from the config) -> trace -> deployment (the layout from
--nodes, --gpus-per-node, --attention, --redundant, --max-running-requests, --hardware) -> placement
-> [vllm: eplb_window] -> serving (with `--hardware` / `--workload`: TPOT, TTFT, throughput and memory
per GPU of that deployment, priced from measured kernels, `passes/cost/engine/serving_pass.py`) ->
plan (`passes/engine_targets/passes.py`) -> codegen (`backends/common/engine_bundle.py` with
`backends/sglang/`, `backends/vllm/` or `backends/trtllm/`, written into a temporary directory
renamed onto --out only when everything succeeded). `moeplan codegen plan.json` rewrites the files
from the plan alone: they hold no weights. What the plan optimises: `passes/engine_targets/passes.py`.
"""
from __future__ import annotations

from moeplan.backends.common.engine_bundle import CODEGEN
from moeplan.core.engine_serving_text import serving_line
from moeplan.core.errors import UserError
from moeplan.passes.analysis.trace.passes import TRACE
from moeplan.passes.cost.engine.serving_pass import SERVING, engine_profile, serving_options
from moeplan.passes.engine_targets.passes import (DEPLOYMENT, ENGINE_DEFAULTED, EPLB_WINDOW, LAYERS, PLACEMENT, PLAN,
                                                  VLLM_PLAN, flags_deployment)
from moeplan.passes.importers.passes import IMPORT

VLLM_POLICIES = ("eplb", "contiguous")  # vLLM's EPLB on, or off (its linear placement)


PASSES = [IMPORT, LAYERS, TRACE, DEPLOYMENT, PLACEMENT, SERVING, PLAN, CODEGEN]
VLLM_PASSES = [IMPORT, LAYERS, TRACE, DEPLOYMENT, PLACEMENT, EPLB_WINDOW, SERVING, VLLM_PLAN, CODEGEN]


def max_running_requests(values: dict) -> int | None:
    """--max-running-requests, else the requests of --workload where the target takes it, else None (the
    engine's own)."""
    if values.get("max_running_requests") is not None:
        return int(values["max_running_requests"])
    if values.get("workload") is not None:
        from moeplan.passes.cost.options import parse_workload

        return len(parse_workload(values["workload"]).prompt_lengths)
    return None


def _refuse_vllm_policies(values: dict, given) -> None:
    """vLLM loads no placement: only the policies that say what its EPLB does (eplb) or its linear start
    (contiguous) apply."""
    if "policy" in given and values["policy"] not in VLLM_POLICIES:
        raise UserError(f"--policy {values['policy']} does not apply to --target vllm: vLLM 0.32 loads no placement "
                        f"file, so use --policy eplb (its EPLB places the experts, the default) or contiguous (EPLB "
                        f"off, vLLM's linear placement)")
    if "policy" in given and values["policy"] == "contiguous" and values["redundant"]:
        raise UserError("--redundant needs vLLM's EPLB (vLLM places replicas only with --enable-eplb): drop --redundant "
                        "or use --policy eplb")


def inputs(target: str, model: str, trace: str, out, values: dict, given) -> dict:
    """The facts the engine pass list starts from. Placement flags not given (`given`: the names of
    those that were) become None, so the passes apply the engine defaults (eplb, the config's groups)."""
    from moeplan.planner.pipeline.flags import PLACEMENT_FLAGS, pick

    if values["image"] is not None and not values["kubernetes"]:
        raise UserError("--image applies to --target sglang with --kubernetes (the pods' image)")
    if target == "vllm":
        _refuse_vllm_policies(values, given)
    placement = {k: (None if k in ENGINE_DEFAULTED and k not in given else v)
                 for k, v in pick(values, PLACEMENT_FLAGS).items()}
    spec = {"name": target}
    if values["kubernetes"]:
        from moeplan.backends.sglang.codegen import DEFAULT_IMAGE

        spec.update(kubernetes=True, image=values["image"] or DEFAULT_IMAGE)
    serving = serving_options(values["hardware"], values["workload"], target, values["nodes"])
    hardware = None if serving is None else engine_profile(serving["hardware"], values["nodes"], target).profile.name
    engine = {"attention": values["attention"], "max_running_requests": max_running_requests(values),
              "hardware": hardware}
    topology = {"nodes": values["nodes"], "gpus_per_node": values["gpus_per_node"]}
    flags_deployment(target, topology, engine, placement)  # a layout the engine cannot run fails before any pass
    return {"model_spec": str(model), "trace_path": str(trace), "out": None if out is None else str(out),
            "topology": topology, "placement_options": placement, "engine_options": engine, "target": spec,
            "serving_options": serving}


def summary(facts: dict) -> dict:
    """The --json summary's fields of an engine target's plan."""
    plan = facts["plan"].as_written()
    return {"world_size": plan.world_size, "policy": plan.placement.policy,
            "redundant": plan.communication.redundant, "objective": "balance",
            "deployment": plan.deployment.to_json(), "predicted": plan.predicted.to_json()}


def describe(summary: dict, facts: dict) -> str:
    predicted, d = summary["predicted"], summary["deployment"]
    running = d.get("max_running_requests")
    text = (f"{summary['target']} placement for {summary['world_size']} EP ranks ({summary['policy']}, "
            f"{summary['redundant']} redundant slots); attention tp {d['attention_tp']} x dp {d['attention_dp']}, "
            f"{'engine-sized' if running is None else running} running requests, MoE {d['moe_a2a']}; predicted "
            f"max/mean rank load {predicted['max_over_mean_load']:.3f}")
    serving = predicted.get("serving")
    if serving:
        text += "\n" + serving_line(serving)
    return text
