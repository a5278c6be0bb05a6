"""The cost model wired to plans, traces and runs: what compile records and what run checks.

* `placement_or_auto` / `COST`: the torchrun pipeline's placement pass (--policy auto prices every
  policy) and cost pass (both modes priced, --mode auto takes the faster), facts `cost_options`
  {"hardware", "workload"} -> `cost` {"mode", "doc": plan.json `predicted.cost`}.

* `Workload.parse("8x32+8")`: 8 requests of 32 prompt tokens, 8 generated tokens each.
* `cost_fact`: compile's cost pass: the chosen placement priced under both modes (routing
  sampled from the plan's trace), the mode `auto` picks, and the policy candidates' table.
* `predict_run`: the prediction for the tokens a finished run actually routed (its routing.pt
  and prompts), which must equal the run's byte counters exactly.
"""
from __future__ import annotations

import json
import re
from pathlib import Path


from moeplan.passes.analysis.cost_model import ModelShape, Workload, predict, routing_from_keys
from moeplan.planner.errors import UserError
from moeplan.planner.pass_manager import Pass

DEFAULT_WORKLOAD = "8x32+8"


def default_cost_options(given: dict | None) -> dict:
    """{"hardware", "workload"} with the defaults filled in (the default profile is named in the plan);
    both are checked here, before any pass runs."""
    from moeplan.planner.hardware import DEFAULT_HARDWARE, load_hardware

    out = {"hardware": DEFAULT_HARDWARE, "workload": DEFAULT_WORKLOAD}
    out.update({k: v for k, v in (given or {}).items() if v is not None})
    load_hardware(out["hardware"])
    parse_workload(out["workload"])
    return out


def parse_workload(text: str) -> Workload:
    """'RxP+G': R requests of P prompt tokens, G generated tokens each."""
    m = re.fullmatch(r"\s*(\d+)\s*x\s*(\d+)\s*\+\s*(\d+)\s*", text or "")
    if not m or min(int(g) for g in m.groups()) < 1:
        raise UserError(f"--workload must look like REQUESTSxPROMPT+NEW (e.g. {DEFAULT_WORKLOAD}), all at least 1; got {text!r}")
    r, p, g = (int(x) for x in m.groups())
    return Workload(prompt_lengths=(p,) * r, new_tokens=g)


def shape_of_plan(plan: dict) -> ModelShape:
    from moeplan.planner.ir import ModelIR

    return ModelShape.from_ir(ModelIR.from_dict(plan["model"]["ir"]))


def cost_fact(ir, trace, placement, mode: str, cost_options: dict) -> dict:
    """What compile records under plan.json `predicted.cost` and the mode the bundle runs."""
    from moeplan.passes.optimize.by_predicted_time import choose_mode, predict_modes
    from moeplan.planner.hardware import load_hardware

    profile = load_hardware(cost_options["hardware"])
    workload = parse_workload(cost_options["workload"])
    shape = ModelShape.from_ir(ir)
    preds = predict_modes(placement.hosts(), placement.topology.gpus_per_node, shape, workload, trace.experts, profile)
    chosen = choose_mode(preds) if mode == "auto" else mode
    return {
        "mode": chosen,
        "doc": {"hardware": profile.name, "workload": cost_options["workload"], "mode_requested": mode,
                "mode": chosen, "modes": preds,
                "alternatives": placement.metrics.get("auto_predictions", [])},
    }


def predict_run(root: Path, out_dir: Path, mode: str, profile=None) -> dict:
    """The cost model on the routing a finished run recorded (its counters must match exactly)."""
    import torch

    from moeplan.passes.optimize.placement.decision import placement_from_dict

    plan = json.loads((root / "plan.json").read_text())
    placement = placement_from_dict(json.loads((root / "placement.json").read_text()))
    routing = torch.load(out_dir / "routing.pt", weights_only=False)
    result = json.loads((out_dir / "result.json").read_text())
    new_tokens = len(result["generated"][0]) if result["generated"] else 0
    workload = Workload(prompt_lengths=tuple(len(p) for p in result["prompt_ids"]), new_tokens=new_tokens)
    served = routing_from_keys(routing["keys"].numpy(), routing["experts"].numpy(), int(routing["max_len"]))
    pred = predict(placement.hosts(), placement.topology.gpus_per_node, shape_of_plan(plan), mode, workload, served, profile)
    return pred.summary(workload.prompt_tokens)


def auto_placement(ir, trace, request, mode: str, cost_options: dict):
    """--policy auto: every candidate policy priced by the cost model; the fastest, with the table
    of candidates under its metrics (`auto_candidates`)."""
    from moeplan.passes.optimize.by_predicted_time import choose_placement
    from moeplan.planner.hardware import load_hardware

    placement, rows = choose_placement(trace, request, ModelShape.from_ir(ir), load_hardware(cost_options["hardware"]),
                                       parse_workload(cost_options["workload"]), mode)
    placement.metrics["auto_candidates"] = [{k: v for k, v in r.items() if k != "modes"} for r in rows]
    placement.metrics["auto_predictions"] = rows
    return placement


def describe_choice(plan: dict) -> str:
    """One line: policy and mode chosen, predicted seconds per token under each mode, the profile."""
    cost = plan["predicted"]["cost"]
    modes = ", ".join(f"{m} {v['seconds_per_token'] * 1e3:.2f} ms/token {v['total_bytes_per_token']:.0f} B/token"
                      for m, v in sorted(cost["modes"].items()))
    note = " (the default; pass --hardware for the machine the bundle will run on)" if cost["hardware"] == "cpu-gloo" else ""
    return (f"placement {plan['placement'].get('policy')}, mode {cost['mode']} (requested {cost['mode_requested']}); "
            f"predicted {modes}; hardware profile {cost['hardware']}{note}")


def measured_beside_predicted(root: Path, plan: dict, out_dir: Path, mode: str, summary: dict) -> dict:
    """The keys `moeplan run` reports next to its measurements: the cost model on the run's own
    routing, priced with the plan's hardware profile (bytes only when that profile is a file not here)."""
    from moeplan.planner.hardware import BUILTIN, DEFAULT_HARDWARE, load_hardware

    if "ir" not in plan.get("model", {}):  # a bundle written without the planner: nothing to predict from
        return {}
    name = plan.get("predicted", {}).get("cost", {}).get("hardware", DEFAULT_HARDWARE)
    try:
        profile = load_hardware(name if name in BUILTIN or Path(name).is_file() else DEFAULT_HARDWARE)
    except UserError:
        profile = load_hardware(DEFAULT_HARDWARE)
    pred = predict_run(root, out_dir, mode, profile)
    tps = summary["tokens_per_second"]
    return {
        "predicted_bytes_per_token": pred["bytes_per_token"],
        "predicted_total_bytes_per_token": pred["total_bytes_per_token"],
        "predicted_messages_per_token": pred["messages_per_token"],
        "predicted_seconds_per_token": pred["seconds_per_token"],
        "predicted_hardware": profile.name,
        "seconds_per_token": 1.0 / tps if tps > 0 else float("inf"),
        "bytes_match_prediction": abs(pred["total_bytes_per_token"] - summary["total_bytes_per_token"]) < 1e-6
                                  and abs(pred["bytes_per_token"] - summary["bytes_per_token"]) < 1e-6,
        "predicted": pred,
    }


def placement_or_auto(facts):
    """The placement pass: `moeplan place`'s, or with --policy auto the fastest by predicted time."""
    from moeplan.planner.pipeline import placement as place_passes

    options = facts["placement_options"]
    if options.get("policy") != "auto":
        return place_passes._placement(facts)
    from moeplan.passes.optimize.placement.decision import Topology
    from moeplan.passes.optimize.placement.policies import PlacementRequest

    topo = facts["topology"]
    request = PlacementRequest(topology=Topology(topo["nodes"], topo["gpus_per_node"]),
                               **{k: v for k, v in options.items() if k != "policy"})
    return {"placement": auto_placement(facts["model"].ir, facts["trace"], request, facts["mode"],
                                        default_cost_options(facts.get("cost_options")))}


def _cost(facts):
    return {"cost": cost_fact(facts["model"].ir, facts["trace"], facts["placement"], facts["mode"],
                              default_cost_options(facts.get("cost_options")))}


COST = Pass("cost", ("model", "trace", "placement", "mode", "cost_options"), ("cost",), _cost)
