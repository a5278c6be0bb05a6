"""What the serving-engine targets (sglang, vllm, trtllm) share: their codegen pass, the bundle's frame and
the template context.

Their outputs are small text files (no weights): the engine's placement file, a launch script,
a README, plan.json and placement.json, and manifest.json over all of them. `moeplan codegen
plan.json` rewrites them from the plan alone. The launch flags come from the plan's deployment
record (`core/engine_layout.py`), checked against the plan before anything is written.
"""
from __future__ import annotations

import json
from pathlib import Path

from moeplan.backends.common.files import finish_bundle, write_file
from moeplan.core.atomic import atomic_path
from moeplan.core.engine_layout import per_attention_replica, plan_layout_problems
from moeplan.core.engine_serving_text import serving_line
from moeplan.core.errors import UserError
from moeplan.core.expert_slots import placement_slots
from moeplan.core.pass_manager import Pass


def write_bundle(out, plan) -> dict:
    """The engine's files for a plan (`backends/sglang/`, `backends/vllm/` or `backends/trtllm/`), written atomically
    at `out`."""
    import importlib

    return importlib.import_module(f"moeplan.backends.{plan.target}.codegen").write_bundle(out, plan)


def _codegen(facts):
    return {"manifest": write_bundle(facts["out"], facts["plan"])}


CODEGEN = Pass("codegen", ("plan", "out"), ("manifest",), _codegen)


def write_engine_bundle(out, plan, write_files) -> dict:
    """An engine target's bundle written atomically at `out`: `write_files(dir, plan, slots)` (the
    engine's own files; `slots`: [MoE layers][slots] logical expert ids), plan.json, placement.json
    and one manifest; returns the manifest."""
    problems = plan_layout_problems(plan)
    if problems:  # a plan.json edited by hand, or written before the deployment record
        raise UserError(f"plan.json's deployment cannot be launched: {problems[0]}; plan again with 'moeplan plan "
                        f"--target {plan.target}'")
    slots = placement_slots(plan.placement, int(plan.model["num_experts"]), int(plan.communication.redundant))
    with atomic_path(Path(out), kind="bundle") as tmp:
        tmp.mkdir(parents=True)
        write_files(tmp, plan, slots)
        write_plan_files(tmp, plan)
        return finish_bundle(tmp)


def write_plan_files(out: Path, plan) -> None:
    write_file(out / "plan.json", plan.to_json())
    write_file(out / "placement.json", json.dumps(plan.placement.to_json(), indent=1, sort_keys=True) + "\n")


def engine_context(plan, slots: list) -> dict:
    """Values every engine template reads, from the plan and its [MoE layers][slots] lists."""
    topo, comm, model, deployment = plan.topology, plan.communication, plan.model, plan.deployment
    dense = sorted(set(range(int(model["num_hidden_layers"]))) - set(model["moe_layer_indices"]))
    running = deployment.max_running_requests
    serving = plan.predicted.to_json().get("serving")
    return {
        "gpus": plan.world_size, "attention_tp": int(deployment.attention_tp),
        "attention_dp": int(deployment.attention_dp), "moe_ep": int(deployment.moe_ep), "moe_tp": int(deployment.moe_tp),
        "max_running_requests": running, "per_replica": per_attention_replica(running, int(deployment.attention_dp)),
        "moe_a2a": deployment.moe_a2a, "chosen_by": deployment.chosen_by,
        "model_name": model["name"], "model_dir_hint": str(model["name"]).split("/")[-1] or "model",
        "plan_version": plan.version,
        "nodes": int(topo["nodes"]), "gpus_per_node": int(topo["gpus_per_node"]), "ep_size": int(comm.ep_size),
        "num_experts": int(model["num_experts"]), "redundant": int(comm.redundant),
        "slots_per_rank": int(comm.slots_per_rank), "num_slots": len(slots[0]),
        "num_hidden_layers": int(model["num_hidden_layers"]), "policy": plan.placement.policy or "unknown",
        "load": f"{float(plan.predicted.max_over_mean_load):.3f}",
        "serving": serving_line(serving) if serving else None,
        "dense_layers": ", ".join(str(d) for d in dense) if dense else "none",
    }
