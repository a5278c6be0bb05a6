"""The engine targets' serving pass: the plan's deployment and placement priced for a workload
(plan.json `predicted.serving`), with `predict_serving` (`prediction.py`).

Facts read: `serving_options` (None: no `--hardware`/`--workload` given, no prediction; else
{"hardware", "workload"}), `model_spec` (its config.json gives the engine's model shape),
`engine_model` (the layers pass's summary: the model's name), `trace` and `placement` (the busiest
rank's rows under the placement), `topology`, `target` (the engine's name; `kv_cache_dtype` where
given), `engine_deployment` (the deployment record, plan.json `deployment`: attention tp/dp, MoE
ep/tp, redundant experts, max running requests, MoE all-to-all; `core/engine_layout.py`). Fact
written: `serving`, the prediction as plan.json holds it (None without options).

The deployment priced is the record the target's bundle launches (`backends/sglang`, `backends/vllm`,
`backends/trtllm` read the same record), whoever chose it (the flags' deployment pass or a search).
"""
from __future__ import annotations

import json

from moeplan.core.errors import UserError
from moeplan.core.hardware import TIERS, load_profile
from moeplan.core.pass_manager import Pass
from moeplan.passes.cost.engine.deployment import Deployment
from moeplan.passes.cost.engine.model_shape import engine_model
from moeplan.passes.cost.engine.prediction import Routing, predict_serving
from moeplan.passes.cost.engine.serving import parse_workload
from moeplan.passes.engine_targets.passes import read_config

# what `--hardware` alone prices: 64 concurrent requests of 1,024 prompt tokens generating 128 each
DEFAULT_ENGINE_WORKLOAD = "64x1024+128"
# the figures engine pricing reads from a hardware profile (`roofline.py`, `memory.py`)
ENGINE_FIGURES = ("flops_per_s", "memory_bytes_per_s", "op_overhead_s", "device_memory_bytes",
                  "collective_latency_base_s", "collective_latency_per_peer_s")


def serving_options(hardware: str | None, workload: str | None, target: str, nodes: int) -> dict | None:
    """{"hardware", "workload"} of an engine target's flags, checked before any pass runs (the profile
    knows every figure engine pricing reads over `nodes` nodes; the workload parses); None when neither
    is given (the plan then predicts balance only, as before)."""
    if hardware is None and workload is None:
        return None
    if hardware is None:
        raise UserError(f"--workload on --target {target} prices the engine on a GPU: give --hardware too "
                        f"(h100-sxm and h200-sxm are priced from measured kernels, other profiles by the roofline)")
    options = {"hardware": hardware, "workload": workload or DEFAULT_ENGINE_WORKLOAD}
    engine_profile(hardware, nodes, target)
    parse_workload(options["workload"])
    return options


def engine_profile(hardware: str, nodes: int, target: str):
    """The LoadedProfile of `--hardware`, refused in one line if it lacks a figure engine pricing reads."""
    tiers = TIERS if nodes > 1 else TIERS[:1]
    figures = ENGINE_FIGURES + tuple(f"{k}.{t}" for k in ("bandwidth_bytes_per_s", "message_latency_s") for t in tiers)
    given = load_profile(hardware)
    given.profile.require(figures, f"the {target} serving prediction over {nodes} node(s)")
    return given


def deployment_of(target: dict, topology: dict, record: dict, hardware: str) -> Deployment:
    """The deployment the target's bundle launches: the plan's deployment record on `hardware`."""
    return Deployment(target["name"], hardware, topology["nodes"], topology["gpus_per_node"], record["attention_tp"],
                      record["attention_dp"], record["moe_ep"], record["moe_tp"],
                      redundant_experts=record["redundant_experts"],
                      max_running_requests=record["max_running_requests"], kv_cache_dtype=target.get("kv_cache_dtype"),
                      a2a=record["moe_a2a"])


def _serving(facts):
    options = facts["serving_options"]
    if options is None:
        return {"serving": None}
    topology = facts["topology"]
    given = engine_profile(options["hardware"], topology["nodes"], facts["target"]["name"])
    model = engine_model(read_config(facts["model_spec"]), facts["engine_model"]["name"])
    dep = deployment_of(facts["target"], topology, facts["engine_deployment"], given.profile.name)
    prediction = predict_serving(model, dep, options["workload"], Routing.placed(facts["trace"], facts["placement"]),
                                 profile=given.profile)
    doc = {"hardware": given.profile.name, **prediction.to_json(), **given.plan_record(figures=True)}
    json.dumps(doc)  # plain data, as plan.json holds it
    return {"serving": doc}


SERVING = Pass("serving", ("serving_options", "model_spec", "engine_model", "trace", "placement", "topology", "target",
                           "engine_deployment"), ("serving",), _serving)
