"""`moeplan run`'s check of a finished run against the cost model: the prediction for the tokens the
run actually routed (its routing.pt and prompts), whose bytes must equal the run's counters
exactly, reported beside the measured seconds per token, and beside the plan's own figure for the
same mode, which is for another workload (`predicted.cost.workload`) on the planning trace's routing:
each figure names its workload (`workload`, `plan_workload`).
"""
from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

from moeplan.passes.cost.context import bundle_context_plan, shape_of_plan
from moeplan.passes.cost.cost_model import Workload, predict, routing_from_keys
from moeplan.passes.cost.options import plan_profile, profile_label, workload_label


def predict_run(root: Path, out_dir: Path, mode: str, profile=None, context: str = "auto") -> dict:
    """The cost model on the routing a finished run recorded (its counters must match exactly);
    `context`: the run's context choice (`serve --context`)."""
    import torch

    from moeplan.passes.optimize.placement.schema import placement_from_dict

    plan = json.loads((root / "plan.json").read_text())
    placement = placement_from_dict(json.loads((root / "placement.json").read_text()))
    routing = torch.load(out_dir / "routing.pt", weights_only=False)
    result = json.loads((out_dir / "result.json").read_text())
    new_tokens = len(result["generated"][0]) if result["generated"] else 0
    workload = Workload(prompt_lengths=tuple(len(p) for p in result["prompt_ids"]), new_tokens=new_tokens)
    served = routing_from_keys(routing["keys"].numpy(), routing["experts"].numpy(), int(routing["max_len"]))
    # priced with the op counts of what its ranks held (a plan for one device, checked on another, may differ)
    shape = replace(shape_of_plan(plan, bundle_context_plan(root, plan, context)),
                    held_dtype=result.get("weight_dtype") or "float32")
    pred = predict(placement.hosts(), placement.topology.gpus_per_node, shape, mode, workload, served, profile,
                   service=False)  # a static run: eager steps, dynamic gating
    return pred.summary(workload.prompt_tokens) | {"context": [shape.context_elements_at(b) for b in range(shape.num_blocks)],
                                                   "workload": workload_label(workload)}


def measured_beside_predicted(root: Path, plan: dict, out_dir: Path, mode: str, summary: dict,
                              context: str = "auto") -> dict:
    """The keys `moeplan run` reports next to its measurements: the cost model on the run's own
    routing, priced with the plan's hardware profile (its recorded figures, or the built-in of its name)."""
    if "ir" not in plan.get("model", {}):  # a bundle written without the planner: nothing to predict from
        return {}
    cost = plan.get("predicted", {}).get("cost", {})
    profile = plan_profile(cost)
    pred = predict_run(root, out_dir, mode, profile, context)
    tps = summary["tokens_per_second"]
    used = [int(n) for _, n in summary.get("context", [])]
    planned = (cost.get("modes") or {}).get(mode) or {}
    return {
        # what each prediction is for: this run's prompts and routing, beside the plan's workload and trace
        "workload": pred["workload"], "plan_workload": cost.get("workload"),
        "plan_seconds_per_token": planned.get("seconds_per_token"),
        "plan_decode_steps": cost.get("decode_steps"),  # "cuda graphs": the plan priced a service's captured steps
        "plan_total_bytes_per_token": planned.get("total_bytes_per_token"),
        "predicted_bytes_per_token": pred["bytes_per_token"],
        "predicted_total_bytes_per_token": pred["total_bytes_per_token"],
        "predicted_messages_per_token": pred["messages_per_token"],
        "predicted_seconds_per_token": pred["seconds_per_token"],
        "predicted_hardware": profile_label(cost) if cost else profile.name,
        "seconds_per_token": 1.0 / tps if tps > 0 else float("inf"),
        # the machine's 1-minute load beside the calibration's: a CPU prediction holds at the load it was fitted at
        "load_average": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
        "calibration_load_average": ((cost.get("hardware_profile") or {}).get("calibration") or {}).get("load_average"),
        "bytes_match_prediction": abs(pred["total_bytes_per_token"] - summary["total_bytes_per_token"]) < 1e-6
                                  and abs(pred["bytes_per_token"] - summary["bytes_per_token"]) < 1e-6,
        "context_elements": used,  # coherent: per block, what the runtime sent per token (hidden or K/V)
        "context_matches_prediction": mode != "coherent" or used == pred["context"],
        "predicted": pred,
    }
