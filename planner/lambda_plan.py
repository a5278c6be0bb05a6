"""plan.json for the AWS Lambda target: the general `Plan` record with a versioned serverless body.

Why a separate writer: the general Plan rounds floats to 6 decimals, which would erase Lambda
prices (~1.7e-5 $/GB-s) and per-token times (~1e-6 s). This module keeps every float to 8
significant digits instead, and otherwise writes exactly the `Plan` fields, so
`Plan.from_dict` reads a Lambda plan too. Layout (serverless body version 1):

* `placement`: {"version", "policy": "function_per_expert", "layers": [{"layer", "method",
  "beta", "experts": [{"expert", "memory_mb", "replicas", "predicted_tokens"}]}]}
* `communication`: {"serverless_version": 1, "batch_tokens", "methods": per layer}
* `predicted`: cost (dollars per batch, MoE layers and non-MoE functions), latency, throughput,
  the simulated cost on the validation batches' real loads, predictor errors, solver reports, BO
* `inputs`: trace digest, SLO, options, and `facts` (platform + profiled timings): everything
  `moeplan simulate` needs, so it never re-profiles.
No timings of the planner itself, timestamps or absolute paths: same inputs, same bytes.
"""
from __future__ import annotations

import json
import math

from moeplan.passes.optimize.serverless import cost as sc
from moeplan.passes.optimize.serverless.sizing import ExpertChoice, LayerDecision
from moeplan.planner.errors import UserError
from moeplan.planner.plan import Plan

SERVERLESS_VERSION = 1


def _sig(value, digits: int = 8):
    if isinstance(value, float):
        if not math.isfinite(value):
            return None
        return float(f"{value:.{digits}g}")
    if isinstance(value, dict):
        return {str(k): _sig(v, digits) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_sig(v, digits) for v in value]
    if hasattr(value, "item") and not isinstance(value, (str, bytes)):
        return _sig(value.item(), digits)
    return value


def build_plan(ir, facts: sc.ServerlessFacts, layers, *, batch_tokens: int, predicted: dict, inputs: dict) -> Plan:
    placement = {"version": 1, "policy": "function_per_expert", "layers": [
        {"layer": e, "method": sc.METHOD_NAMES[d.method], "beta": int(d.beta), "experts": [
            {"expert": i, "memory_mb": int(c.memory_mb), "replicas": int(c.replicas), "predicted_tokens": int(c.tokens)}
            for i, c in enumerate(d.experts)]}
        for e, d in enumerate(layers)]}
    functions = sum(len(d.experts) for d in layers) + len(layers) + 2
    return Plan(
        target="lambda",
        model={"name": ir.name, "architecture": ir.architecture, "ir": ir.to_dict()},
        topology={"kind": "serverless", "platform": facts.platform.name, "functions": functions},
        placement=placement,
        communication={"serverless_version": SERVERLESS_VERSION, "batch_tokens": int(batch_tokens),
                       "methods": [sc.METHOD_NAMES[d.method] for d in layers]},
        predicted=predicted,
        inputs=dict(inputs, facts=facts.to_dict()),
    )


def plan_json(plan: Plan) -> str:
    from dataclasses import asdict

    return json.dumps(_sig(asdict(plan)), indent=2, sort_keys=True) + "\n"


def _first_non_number(value, where: str):
    """The path of the first leaf of `value` that is not a finite number >= 0 (None if all are)."""
    if isinstance(value, dict):
        return next((bad for k, v in value.items() if (bad := _first_non_number(v, f"{where}.{k}"))), None)
    if isinstance(value, list):
        return next((bad for i, v in enumerate(value) if (bad := _first_non_number(v, f"{where}[{i}]"))), None)
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < float("inf")
    return None if ok else where


def read_plan(path) -> tuple:
    """(plan, facts, layers, batch_tokens) from a Lambda plan.json; problems are UserErrors."""
    from pathlib import Path

    path = Path(path)
    if not path.is_file():
        raise UserError(f"plan file '{path}' does not exist; write one with 'moeplan plan MODEL --trace T --target lambda --slo S --out {path}'")
    try:
        plan = Plan.from_json(path.read_text(encoding="utf-8"))
    except (ValueError, TypeError, KeyError, AttributeError, UnicodeDecodeError, RecursionError) as exc:
        raise UserError(f"plan file '{path}' is not a moeplan plan ({exc.__class__.__name__}: {str(exc)[:80]})") from None
    if not isinstance(plan.communication, dict) or not isinstance(plan.inputs, dict) \
            or not isinstance(plan.placement, dict):
        raise UserError(f"plan file '{path}' has malformed sections; regenerate it with 'moeplan plan'")
    if plan.target != "lambda" or plan.communication.get("serverless_version") != SERVERLESS_VERSION:
        raise UserError(f"plan file '{path}' is a '{plan.target}' plan; 'moeplan simulate' needs a lambda plan (serverless_version {SERVERLESS_VERSION})")
    bad = _first_non_number({k: v for k, v in plan.inputs.get("facts", {}).items() if k != "platform"}
                            if isinstance(plan.inputs.get("facts"), dict) else None, "facts")
    if bad:
        raise UserError(f"plan file '{path}': {bad} must be a finite non-negative number; regenerate the plan")
    try:
        facts = sc.ServerlessFacts.from_dict(plan.inputs["facts"])
        layers = [LayerDecision(sc.METHOD_IDS[l["method"]], int(l["beta"]),
                                tuple(ExpertChoice(int(x["memory_mb"]), int(x["replicas"]), int(x["predicted_tokens"]))
                                      for x in l["experts"]))
                  for l in plan.placement["layers"]]
        batch_tokens = int(plan.communication["batch_tokens"])
    except (KeyError, TypeError, ValueError, OverflowError, AttributeError) as exc:
        raise UserError(f"plan file '{path}' has a malformed serverless section ({exc.__class__.__name__}: {exc}); regenerate it")
    for l, layer in enumerate(layers):
        for e, x in enumerate(layer.experts):
            if x.replicas < 1 or x.memory_mb < 1 or x.tokens < 0:
                raise UserError(f"plan file '{path}': layer {l} expert {e} has {x.replicas} replicas, {x.memory_mb} MB, "
                                f"{x.tokens} predicted tokens; every expert needs >= 1 replica and memory; regenerate it")
        if layer.beta < 0:
            raise UserError(f"plan file '{path}': layer {l} has a negative beta; regenerate it")
    if batch_tokens < 1:
        raise UserError(f"plan file '{path}': batch_tokens must be positive; regenerate it")
    return plan, facts, layers, batch_tokens
