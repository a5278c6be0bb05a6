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
                                                  SLO_PLAN, VLLM_PLAN, VLLM_SLO_PLAN, flags_deployment)
from moeplan.passes.engine_targets.slo_search_pass import SLO_SEARCH
from moeplan.passes.importers.passes import IMPORT

VLLM_POLICIES = ("eplb", "contiguous")  # vLLM's EPLB on, or off (its linear placement)


PASSES = [IMPORT, LAYERS, TRACE, DEPLOYMENT, PLACEMENT, SERVING, PLAN, CODEGEN]
VLLM_PASSES = [IMPORT, LAYERS, TRACE, DEPLOYMENT, PLACEMENT, EPLB_WINDOW, SERVING, VLLM_PLAN, CODEGEN]
# --slo without --nodes: the SLO search writes the topology and the deployment (slo_search_pass.py)
SLO_PASSES = [IMPORT, LAYERS, TRACE, SLO_SEARCH, PLACEMENT, SERVING, SLO_PLAN, CODEGEN]
VLLM_SLO_PASSES = [IMPORT, LAYERS, TRACE, SLO_SEARCH, PLACEMENT, EPLB_WINDOW, SERVING, VLLM_SLO_PLAN, CODEGEN]
DEFAULT_GPUS_PER_NODE = 8  # an HGX / DGX board: what the SLO search fills before it adds nodes


def passes_for(target: str, facts: dict) -> list:
    """The pass list of engine target `target` for its input facts: the SLO search's where --slo was given."""
    vllm = target == "vllm"
    if "search_options" in facts:
        return VLLM_SLO_PASSES if vllm else SLO_PASSES
    return VLLM_PASSES if vllm else PASSES


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
    if values["slo"] is not None:
        return slo_inputs(target, model, trace, out, values, given, placement, spec)
    if "max_gpus" in given:
        raise UserError(f"--max-gpus bounds the SLO search: give --slo tpot=...[,ttft=...] too (and no --nodes), or "
                        f"drop --max-gpus and plan the {values['nodes']} x {values['gpus_per_node']} GPUs given")
    serving = serving_options(values["hardware"], values["workload"], target, values["nodes"])
    hardware = None if serving is None else engine_profile(serving["hardware"], values["nodes"], target).profile.name
    engine = {"attention": values["attention"], "max_running_requests": max_running_requests(values),
              "hardware": hardware}
    topology = {"nodes": values["nodes"], "gpus_per_node": values["gpus_per_node"]}
    flags_deployment(target, topology, engine, placement)  # a layout the engine cannot run fails before any pass
    return {"model_spec": str(model), "trace_path": str(trace), "out": None if out is None else str(out),
            "topology": topology, "placement_options": placement, "engine_options": engine, "target": spec,
            "serving_options": serving}


def slo_inputs(target: str, model, trace, out, values: dict, given, placement: dict, spec: dict) -> dict:
    """The facts of the SLO search's pass list (`passes_for`): the command fixes what it gives (--attention tp
    or dp, --redundant, --max-running-requests, --gpus-per-node: the node's size) and the search chooses
    the rest; --nodes is refused (the search chooses the GPU count, up to --max-gpus)."""
    slo = values["slo"].for_engine(target)
    if "nodes" in given:
        raise UserError(f"--slo searches the GPU count and layout: drop --nodes (--max-gpus bounds the search, "
                        f"--gpus-per-node sets the node size), or drop --slo to plan the {values['nodes']} nodes given")
    if values["hardware"] is None:
        raise UserError(f"--slo on --target {target} prices each deployment on a GPU: give --hardware (h100-sxm or "
                        f"h200-sxm from measured kernels, other profiles by the roofline)")
    gpus_per_node = values["gpus_per_node"] if "gpus_per_node" in given else DEFAULT_GPUS_PER_NODE
    serving = serving_options(values["hardware"], values["workload"], target, max(values["max_gpus"] // gpus_per_node, 1))
    no_replicas = target == "vllm" and placement.get("policy") == "contiguous"  # vLLM places replicas only with EPLB
    fixed = {"attention": values["attention"],
             "redundant_experts": values["redundant"] if "redundant" in given or no_replicas else None,
             "max_running_requests": values["max_running_requests"]}
    return {"model_spec": str(model), "trace_path": str(trace), "out": None if out is None else str(out),
            "placement_flags": placement, "target": spec, "serving_options": serving,
            "search_options": {"slo": str(slo), "max_gpus": values["max_gpus"], "gpus_per_node": gpus_per_node,
                               "fixed": fixed}}


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
            f"max/mean rank load {predicted['max_over_mean_load']:.3f} on the planning trace")
    serving = predicted.get("serving")
    if serving:
        text += "\n" + serving_line(serving)
    search = predicted.get("slo_search")
    if search:
        chosen = search["chosen"]
        text += (f"\nSLO search ({len(search['screened'])} deployments screened, {len(search['finalists'])} placed and "
                 f"priced under the trace): TPOT {chosen['tpot_s'] * 1e3:.2f} ms, TTFT {chosen['ttft_s']:.3f} s counting "
                 f"the requests queued behind the {chosen['max_running_requests']} running; {search['why']}")
    # a warning is no progress line: it is printed wherever the summary is, terminal or not
    return "\n".join([text, *predicted.get("warnings", [])])
