"""The passes of the serving-engine targets (sglang, vllm, trtllm): the engine's deployment and the
placement it loads at startup (vllm: the placement its EPLB is expected to reach).

Passes: layers (which decoder layers are MoE, from the config) -> deployment (the layout the engine
is launched with: `core/engine_layout.py`, plan.json `deployment`) -> placement (with the engines'
defaults) -> [vllm: eplb_window, `eplb_window.py`] -> plan; the list (with import, trace and
codegen, `backends/common/engine_bundle.py`) is `planner/pipeline/engine_targets.py`.

What the plan optimises: SGLang, vLLM and TensorRT-LLM run standard expert parallelism. Every token goes
from its attention rank to the ranks of its experts and its outputs are combined back at that home
rank, at every MoE layer. A token's route therefore does not depend on where its previous layer's
experts ran, and inter-layer affinity buys nothing; what sets an MoE layer's time is its busiest
rank. So the default policy is `eplb` (balance: max over mean rank load per layer, replicas
sharing their expert's tokens evenly, as the engines' dynamic dispatch over replicas does), with
DeepSeek's hierarchical variant when the config has expert groups (`n_group`). `ilp` is accepted
for per-token traces; its affinity term then only chooses among layouts within its load cap.

Facts read from the command: `model_spec`, `trace_path`, `topology`, `placement_options` (with
`policy` / `expert_groups` None when not given on the command line), `engine_options` {"attention",
"max_running_requests", "hardware"}, `target` {"name", "kubernetes", "image"}, `out`; the plan also
takes the serving pass's `serving` (plan.json `predicted.serving`, `passes/cost/engine/serving_pass.py`,
which prices the deployment record `engine_deployment`). A search that chooses the deployment (the SLO
search) writes `topology` and `engine_deployment` itself.

A placement whose max/mean rank load is over `IMBALANCE_WARNING` with no redundant slot gets a warning
(one line on stderr and in plan.json `predicted.warnings`) naming `--redundant`: the engine's busiest
rank sets every MoE layer's pace, and replicas of the hot experts are what brings it down.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

from moeplan.core.engine_layout import attention_dp_for, engine_deployment, plan_layout_problems
from moeplan.core.errors import UserError
from moeplan.core.pass_manager import Pass
from moeplan.core.plan import Plan, plan_reads_back
from moeplan.passes.analysis.trace.passes import trace_matches_model
from moeplan.passes.optimize.placement.passes import placement_is_valid

DEFAULT_POLICY = "eplb"
ENGINE_DEFAULTED = ("policy", "expert_groups")  # placement flags whose engine default differs from torchrun's
OBJECTIVE = ("balance under standard expert parallelism (tokens combine at their home rank every MoE layer): "
             "max over mean rank load per MoE layer, replicas splitting their expert's tokens evenly")
LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")
SOLVE_METRICS = ("solve_seconds",)
IMBALANCE_WARNING = 1.5  # max/mean rank load above which a plan with no redundant slot warns


def read_config(model_spec: str) -> dict:
    """The Hugging Face config of a config file or model directory."""
    path = Path(model_spec)
    config_path = path / "config.json" if path.is_dir() else path
    try:
        config = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"cannot read a Hugging Face config from '{model_spec}' ({exc.__class__.__name__}); the sglang, "
                        f"vllm and trtllm targets need the model's config.json (e.g. examples/configs/deepseek-v3.json)") from None
    if not isinstance(config, dict) or not isinstance(config.get("num_hidden_layers"), int):
        raise UserError(f"'{config_path}' has no integer num_hidden_layers; the sglang, vllm and trtllm targets need a "
                        f"Hugging Face decoder config")
    return config


def moe_layer_indices(ir, num_hidden_layers: int) -> list:
    """Decoder-layer index of each MoE stage, from its module path (`model.layers.<i>.mlp`)."""
    indices = []
    for stage in ir.moe_stages:
        match = LAYER_INDEX.search(f"{stage.name}.") or LAYER_INDEX.search(f"{stage.source}.")
        if not match:
            raise UserError(f"cannot tell which decoder layer MoE stage '{stage.name}' is; the sglang, vllm and "
                            f"trtllm targets need a Hugging Face model whose MoE blocks sit in model.layers.<i>")
        indices.append(int(match.group(1)))
    if indices != sorted(set(indices)) or indices[-1] >= num_hidden_layers:
        raise UserError(f"the model's MoE layers {indices[:6]}... do not fit its {num_hidden_layers} decoder layers")
    return indices


def _layers(facts):
    config = read_config(facts["model_spec"])
    ir = facts["model"].ir
    return {"engine_model": {
        "name": ir.name, "architecture": (config.get("architectures") or [ir.architecture])[0],
        "model_type": config.get("model_type"), "num_hidden_layers": config["num_hidden_layers"],
        "moe_layer_indices": moe_layer_indices(ir, config["num_hidden_layers"]), "moe_layers": len(ir.moe_stages),
        "num_experts": ir.moe_stages[0].num_experts, "top_k": ir.moe_stages[0].top_k,
        "expert_groups": int(config.get("n_group") or 0)}}


def engine_placement_options(options: dict, engine_model: dict) -> dict:
    """The command's placement flags with the engine defaults for those not given."""
    options = dict(options)
    if options.get("policy") is None:
        options["policy"] = DEFAULT_POLICY
    if options.get("expert_groups") is None:
        options["expert_groups"] = engine_model["expert_groups"]
    return options


def with_model_experts(trace, num_experts: int):
    """The trace with the model's expert count: experts it never routed to are placed too."""
    from moeplan.passes.analysis.trace.format import make_trace

    if trace.num_experts == num_experts:
        return trace
    loads = None
    if trace.loads_only:
        loads = np.zeros((trace.num_layers, num_experts), dtype=np.int64)
        loads[:, :trace.num_experts] = trace.loads
    return make_trace(trace.experts, trace.weights, num_experts=num_experts, token_ids=trace.token_ids,
                      positions=trace.positions, sequence=trace.sequence, attention_ids=trace.attention_ids, loads=loads)


def _placement(facts):
    from moeplan.passes.optimize.placement.schema import Topology
    from moeplan.passes.optimize.placement.policies import PlacementRequest, plan_placement

    topo, engine_model = facts["topology"], facts["engine_model"]
    options = engine_placement_options(facts["placement_options"], engine_model)
    request = PlacementRequest(topology=Topology(topo["nodes"], topo["gpus_per_node"]), **options)
    return {"placement": plan_placement(with_model_experts(facts["trace"], engine_model["num_experts"]), request)}


def flags_deployment(target: str, topology: dict, engine_options: dict, placement_options: dict) -> dict:
    """The layout the flags ask for: every GPU in expert parallelism, attention by `--attention` (a layout the
    engine cannot run is one UserError line, which the driver raises before any pass runs)."""
    nodes, gpus_per_node = int(topology["nodes"]), int(topology["gpus_per_node"])
    return engine_deployment(
        target, nodes, gpus_per_node, attention_dp=attention_dp_for(engine_options["attention"], nodes, gpus_per_node),
        moe_ep=nodes * gpus_per_node, redundant_experts=int(placement_options.get("redundant", 0)),
        max_running_requests=engine_options["max_running_requests"], hardware=engine_options.get("hardware"))


def _deployment(facts):
    return {"engine_deployment": flags_deployment(facts["target"]["name"], facts["topology"], facts["engine_options"],
                                                  facts["placement_options"])}


def _eplb_window(facts):
    """vLLM's --eplb-config from the trace's drift (`eplb_window.py`)."""
    from moeplan.passes.engine_targets.eplb_window import eplb_config
    from moeplan.passes.optimize.placement.schema import Topology

    topo, deployment, engine_model = facts["topology"], facts["engine_deployment"], facts["engine_model"]
    options = engine_placement_options(facts["placement_options"], engine_model)
    config, measured = eplb_config(with_model_experts(facts["trace"], engine_model["num_experts"]),
                                   Topology(topo["nodes"], topo["gpus_per_node"]), deployment["redundant_experts"],
                                   int(options["expert_groups"]), deployment["max_running_requests"],
                                   deployment["attention_dp"])
    return {"eplb": {"config": config, "load_drift": measured}}


def imbalance_warning(max_over_mean: float, redundant: int, ep_size: int) -> str | None:
    """The warning of a placement that leaves its busiest rank far above the mean with no replicas."""
    if redundant or max_over_mean <= IMBALANCE_WARNING:
        return None
    return (f"warning: the busiest EP rank gets {max_over_mean:.2f}x the mean rank load (mean over MoE layers) with 0 "
            f"redundant slots, and it sets every MoE layer's pace; give --redundant {ep_size} (one replica slot per rank) "
            f"or more so the hot experts get replicas")


def _plan(facts):
    from moeplan.core.expert_slots import placement_slots
    from moeplan.passes.analysis.trace_summary import trace_summary

    placement, trace, engine_model, target = facts["placement"], facts["trace"], facts["engine_model"], facts["target"]
    doc = json.loads(placement.to_json())
    for key in SOLVE_METRICS:
        doc.get("metrics", {}).pop(key, None)
    options = engine_placement_options(facts["placement_options"], engine_model)
    redundant = int(options.get("redundant", 0))
    try:  # every layer must fit the engine's slot layout
        placement_slots(doc, engine_model["num_experts"], redundant)
    except ValueError as exc:
        raise UserError(f"the {options['policy']} placement cannot be written as {target['name']}'s slot lists ({exc}); "
                        f"use --policy eplb") from None
    ep_size = placement.topology.devices
    deployment = {**facts["engine_deployment"], **{k: v for k, v in target.items() if k != "name"}}
    predicted = {"max_over_mean_load": doc["metrics"]["max_over_mean_load"]}
    if "eplb" in facts:  # vllm: its EPLB on (--policy eplb) or off (contiguous: vLLM's linear placement)
        if options["policy"] == "eplb":
            deployment["eplb"] = facts["eplb"]["config"]
            predicted["load_drift"] = facts["eplb"]["load_drift"]
    if facts["serving"] is not None:
        predicted["serving"] = facts["serving"]
    if "slo_search" in facts:  # the SLO search chose the deployment: its choice, why and frontier
        predicted["slo_search"] = facts["slo_search"]
    warning = imbalance_warning(doc["metrics"]["max_over_mean_load"], redundant, ep_size)
    if warning is not None:
        if "eplb" in facts and options["policy"] != "eplb":  # vLLM places replicas only with its EPLB
            warning += " (vllm: with --policy eplb)"
        predicted["warnings"] = [warning]  # printed with the plan's summary (planner/pipeline/engine_targets.py)
    plan = Plan(
        target=target["name"], model={k: v for k, v in engine_model.items() if k != "expert_groups"},
        topology={"nodes": placement.topology.nodes, "gpus_per_node": placement.topology.gpus_per_node},
        placement=doc,
        communication={"mode": "standard", "engine": target["name"], "ep_size": ep_size, "redundant": redundant,
                       "slots_per_rank": (engine_model["num_experts"] + redundant) // ep_size, "objective": OBJECTIVE},
        predicted=predicted,
        inputs={"model": facts["model_spec"], "trace_sha256": facts["trace_sha256"], "trace_tokens": trace.num_tokens,
                "trace_loads_only": trace.loads_only, "options": options,
                "trace_summary": trace_summary(trace, placement.hosts())},
        deployment=deployment,
    )
    return {"plan": plan}


def deployment_fits_plan(facts) -> None:
    """Postcondition of the engine plan pass: the deployment record agrees with the plan's topology and
    placement (`core/engine_layout.py`)."""
    problems = plan_layout_problems(facts["plan"])
    if problems:
        raise ValueError(problems[0])


def _plan_ensures(facts) -> None:
    plan_reads_back(facts)
    deployment_fits_plan(facts)


LAYERS = Pass("layers", ("model", "model_spec"), ("engine_model",), _layers)
DEPLOYMENT = Pass("deployment", ("topology", "engine_options", "placement_options", "target"), ("engine_deployment",),
                  _deployment)
EPLB_WINDOW = Pass("eplb_window", ("trace", "topology", "engine_deployment", "engine_model", "placement_options"),
                   ("eplb",), _eplb_window)
PLACEMENT = Pass("placement", ("trace", "topology", "placement_options", "engine_model", "model"), ("placement",),
                 _placement, check=trace_matches_model, ensures=placement_is_valid)
PLAN_READS = ("placement", "trace", "trace_sha256", "engine_model", "placement_options", "model_spec", "target",
              "engine_deployment", "serving")
PLAN = Pass("plan", PLAN_READS, ("plan",), _plan, ensures=_plan_ensures)
VLLM_PLAN = Pass("plan", PLAN_READS + ("eplb",), ("plan",), _plan, ensures=_plan_ensures)
SLO_PLAN = Pass("plan", PLAN_READS + ("slo_search",), ("plan",), _plan, ensures=_plan_ensures)
VLLM_SLO_PLAN = Pass("plan", PLAN_READS + ("eplb", "slo_search"), ("plan",), _plan, ensures=_plan_ensures)
