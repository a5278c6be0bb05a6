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
import os
import re
from dataclasses import replace
from pathlib import Path


from moeplan.passes.cost.model import ModelShape, Workload, predict, routing_from_keys
from moeplan.core.errors import UserError
from moeplan.core.pass_manager import Pass

DEFAULT_WORKLOAD = "8x32+8"


def default_cost_options(given: dict | None, nodes: int | None = None) -> dict:
    """{"hardware", "workload"} with the defaults filled in (the default profile is named in the plan);
    both are checked here, before any pass runs (with `nodes`, also that the profile knows every
    figure the cost model needs for that many nodes)."""
    from moeplan.core.hardware import DEFAULT_HARDWARE

    out = {"hardware": DEFAULT_HARDWARE, "workload": DEFAULT_WORKLOAD}
    out.update({k: v for k, v in (given or {}).items() if v is not None})
    cost_profile(out, nodes or 1)
    parse_workload(out["workload"])
    return out


def cost_profile(cost_options: dict, nodes: int):
    """The plan's LoadedProfile, refused in one line if it lacks a figure the cost model needs for
    `nodes` nodes (a one-machine profile over two nodes)."""
    from moeplan.core.hardware import cost_model_figures, load_profile

    given = load_profile(cost_options["hardware"])
    given.profile.require(cost_model_figures(nodes), f"the cost model of a plan over {nodes} node(s)")
    return given


def parse_workload(text: str) -> Workload:
    """'RxP+G': R requests of P prompt tokens, G generated tokens each."""
    m = re.fullmatch(r"\s*(\d+)\s*x\s*(\d+)\s*\+\s*(\d+)\s*", text or "")
    if not m or min(int(g) for g in m.groups()) < 1:
        raise UserError(f"--workload must look like REQUESTSxPROMPT+NEW (e.g. {DEFAULT_WORKLOAD}), all at least 1; got {text!r}")
    r, p, g = (int(x) for x in m.groups())
    return Workload(prompt_lengths=(p,) * r, new_tokens=g)


def context_plan_of(module, choice: str = "auto") -> list:
    """[[hidden | kv, elements per token]] per decoder block: the runtime's own choice of coherent
    mode's context row (`runtime/ep/context_exchange.py`), read off the model's modules
    (meta device is enough); [] when the runtime cannot run the model."""
    from moeplan.runtime.ep.context_exchange import model_context_plan
    from moeplan.runtime.model.library_model import ModelError

    if module is None:
        return []
    try:
        return [[kind, int(n)] for kind, n in model_context_plan(module, choice)]
    except (ModelError, StopIteration):
        return []


def shape_with_context(ir, context: list) -> ModelShape:
    """The IR's shape with coherent mode's per-block context rows (when they cover every block)."""
    shape = ModelShape.from_ir(ir)
    if len(context) != shape.num_blocks:
        return shape
    return replace(shape, context_elements=tuple(n for _, n in context))


def shape_of_plan(plan: dict, context: list | None = None) -> ModelShape:
    return shape_with_context(_ir(plan), context or [])


def bundle_context_plan(root: Path, plan: dict, choice: str = "auto") -> list:
    """The context plan a bundle's runtime follows: recorded by compile, else read off its model
    (built on meta); with choice 'hidden' every block sends the hidden state."""
    recorded = plan.get("predicted", {}).get("cost", {}).get("context") if choice == "auto" else None
    if recorded is None and plan["model"].get("architecture") == "transformers":
        from moeplan.runtime.model.library_model import build_transformers

        recorded = context_plan_of(build_transformers((root / plan["model"]["config"]).parent, device="meta"), choice)
    return recorded or []


def _ir(plan: dict):
    from moeplan.core.ir import ModelIR

    return ModelIR.from_dict(plan["model"]["ir"])


def cost_fact(ir, trace, placement, mode: str, cost_options: dict, context: list | None = None) -> dict:
    """What compile records under plan.json `predicted.cost` and the mode the bundle runs."""
    from moeplan.passes.cost.by_predicted_time import choose_mode, predict_modes

    given = cost_profile(cost_options, placement.topology.nodes)
    profile = given.profile
    workload = parse_workload(cost_options["workload"])
    shape = shape_with_context(ir, context or [])
    preds = predict_modes(placement.hosts(), placement.topology.gpus_per_node, shape, workload, trace.experts, profile)
    chosen = choose_mode(preds) if mode == "auto" else mode
    return {
        "mode": chosen,
        "doc": {"hardware": profile.name, "workload": cost_options["workload"], "mode_requested": mode,
                "mode": chosen, "modes": preds, "context": context or [],
                "alternatives": placement.metrics.get("auto_predictions", []),
                **given.plan_record(figures=True)},
    }


def predict_run(root: Path, out_dir: Path, mode: str, profile=None, context: str = "auto") -> dict:
    """The cost model on the routing a finished run recorded (its counters must match exactly);
    `context`: the run's context choice (`serve --context`)."""
    import torch

    from moeplan.passes.optimize.placement.contract import placement_from_dict

    plan = json.loads((root / "plan.json").read_text())
    placement = placement_from_dict(json.loads((root / "placement.json").read_text()))
    routing = torch.load(out_dir / "routing.pt", weights_only=False)
    result = json.loads((out_dir / "result.json").read_text())
    new_tokens = len(result["generated"][0]) if result["generated"] else 0
    workload = Workload(prompt_lengths=tuple(len(p) for p in result["prompt_ids"]), new_tokens=new_tokens)
    served = routing_from_keys(routing["keys"].numpy(), routing["experts"].numpy(), int(routing["max_len"]))
    shape = shape_of_plan(plan, bundle_context_plan(root, plan, context))
    pred = predict(placement.hosts(), placement.topology.gpus_per_node, shape, mode, workload, served, profile)
    return pred.summary(workload.prompt_tokens) | {"context": [shape.context_elements_at(b) for b in range(shape.num_blocks)]}


def auto_placement(ir, trace, request, mode: str, cost_options: dict, context: list | None = None):
    """--policy auto: every candidate policy priced by the cost model; the fastest, with the table
    of candidates under its metrics (`auto_candidates`)."""
    from moeplan.passes.cost.by_predicted_time import choose_placement

    profile = cost_profile(cost_options, request.topology.nodes).profile
    placement, rows = choose_placement(trace, request, shape_with_context(ir, context or []), profile,
                                       parse_workload(cost_options["workload"]), mode)
    placement.metrics["auto_candidates"] = [{k: v for k, v in r.items() if k != "modes"} for r in rows]
    placement.metrics["auto_predictions"] = rows
    return placement


def plan_profile(cost: dict):
    """The HardwareProfile a plan's `predicted.cost` was priced with (core/hardware.py)."""
    from moeplan.core.hardware import profile_of_record

    return profile_of_record(cost.get("hardware_profile"), cost.get("hardware"))


def profile_label(cost: dict, detail: bool = False) -> str:
    """The profile as a person reads it: 'cpu-gloo', or 'cpu-gloo (this-machine, calibrated DATE)';
    `detail` adds the machine key and the file's hash."""
    recorded = cost.get("hardware_profile")
    if recorded is None:
        return cost.get("hardware", "?")
    calibration = recorded.get("calibration") or {}
    where = recorded["given"]
    if calibration:
        where += f", calibrated {calibration.get('date', '?')}"
        if detail:
            where += f" on {calibration.get('machine_key', '?')}"
    if detail:
        where += f", sha256 {recorded['sha256'][:12]}"
    return f"{cost.get('hardware', '?')} ({where})"


def describe_choice(plan: dict) -> str:
    """One line: policy and mode chosen, predicted seconds per token under each mode, the profile."""
    cost = plan["predicted"]["cost"]
    modes = ", ".join(f"{m} {v['seconds_per_token'] * 1e3:.2f} ms/token {v['total_bytes_per_token']:.0f} B/token"
                      for m, v in sorted(cost["modes"].items()))
    note = (" (the default; pass --hardware for the machine the bundle will run on)"
            if cost["hardware"] == "cpu-gloo" and "hardware_profile" not in cost else "")
    return (f"placement {plan['placement'].get('policy')}, mode {cost['mode']} (requested {cost['mode_requested']}); "
            f"predicted {modes}; hardware profile {profile_label(cost, detail=True)}{note}")


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
    return {
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


def placement_or_auto(facts):
    """The placement pass: `moeplan place`'s, or with --policy auto the fastest by predicted time."""
    from moeplan.planner.pipeline import placement as place_passes

    options = facts["placement_options"]
    if options.get("policy") != "auto":
        return place_passes._placement(facts)
    from moeplan.passes.optimize.placement.contract import Topology
    from moeplan.passes.optimize.placement.policies import PlacementRequest

    topo = facts["topology"]
    request = PlacementRequest(topology=Topology(topo["nodes"], topo["gpus_per_node"]),
                               **{k: v for k, v in options.items() if k != "policy"})
    return {"placement": auto_placement(facts["model"].ir, facts["trace"], request, facts["mode"],
                                        default_cost_options(facts.get("cost_options")),
                                        context_plan_of(facts["model"].module))}


def _cost(facts):
    return {"cost": cost_fact(facts["model"].ir, facts["trace"], facts["placement"], facts["mode"],
                              default_cost_options(facts.get("cost_options")), context_plan_of(facts["model"].module))}


COST = Pass("cost", ("model", "trace", "placement", "mode", "cost_options"), ("cost",), _cost)
