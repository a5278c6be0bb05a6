"""The AWS Lambda target: runtime files -> platform -> import -> trace -> profile -> serverless facts ->
expert sizing -> dense partition -> plan -> codegen, as a pass list, with the facts it starts from,
its summaries, and a Lambda plan read back for `moeplan simulate` and the report.

The planning passes and plan.json's serverless body are `passes/optimize/serverless/passes.py`;
`moeplan plan --target lambda` runs this list for the plan alone, so it works on config-only models
too; `compile --target lambda` adds the runtime check and the bundle (`backends/lambda_/codegen.py`).
The partition pass groups dense units where the Lambda runtime can cut the model: this list hands it
the Lambda backend's rule (`backends/lambda_/layout.py: runtime_units`).
"""
from __future__ import annotations

import re
from pathlib import Path

from moeplan.backends.lambda_.codegen import CODEGEN, MODEL_FILES
from moeplan.backends.lambda_.layout import runtime_units
from moeplan.core.errors import UserError
from moeplan.core.plan import Plan
from moeplan.core.plan_sections import Communication, Placement
from moeplan.passes.analysis.passes import FACTS
from moeplan.passes.analysis.profile.passes import PROFILE
from moeplan.passes.analysis.trace.passes import TRACE
from moeplan.passes.importers.passes import IMPORT
from moeplan.passes.optimize.serverless.passes import (PLAN, PLATFORM, SERVERLESS_VERSION, SIZING, check_options,
                                                       partition_pass)


PARTITION = partition_pass(runtime_units)  # the Lambda runtime's cuts (backends/lambda_/layout.py)
PASSES = [MODEL_FILES, PLATFORM, IMPORT, TRACE, PROFILE, FACTS, SIZING, PARTITION, PLAN, CODEGEN]


def inputs(model: str, trace: str, out, values: dict) -> dict:
    """The facts the lambda pass list starts from; flag mistakes stop here, before any pass runs."""
    from moeplan.planner.pipeline.flags import DEFAULT_PROMPT_TOKENS, SERVERLESS_FLAGS, pick

    serverless = dict(pick(values, SERVERLESS_FLAGS), time_limit=values["time_limit"], solver=values["solver"])
    if serverless["slo"] is not None:  # the grammar of every target's --slo (core/slo.py); lambda's is seconds
        serverless["slo"] = serverless["slo"].for_lambda()
    if serverless["prompt_tokens"] is None:
        serverless["prompt_tokens"] = DEFAULT_PROMPT_TOKENS
    check_options({"serverless_options": serverless})
    return {"model_spec": str(model), "trace_path": str(trace), "out": None if out is None else str(out),
            "serverless_options": serverless}


def summary(facts: dict) -> dict:
    """The --json summary's fields of a lambda plan."""
    plan = facts["plan"].as_written()  # the figures as plan.json holds them
    result = {}
    if "manifest" not in facts:
        result["bo_iterations"] = facts["sizing"].bo["iterations"] if facts["sizing"].bo else 0
    p = plan.predicted
    result.update(functions=plan.topology["functions"], dense_slices=len(plan.placement.dense_slices),
                  methods=plan.communication.methods, api_call=p.api_call, batch_tokens=plan.communication.batch_tokens,
                  cost_per_batch_usd=p.cost_per_request_usd,
                  moe_cost_per_batch_usd=p.moe_cost_per_batch_usd, latency_s=p.latency_s,
                  throughput_tokens_per_s=p.throughput_tokens_per_s, algorithm=p.algorithm,
                  predictor_error=p.predictor_error)
    return result


def api_call_line(call: dict) -> str:
    """The API call a Lambda plan's cost is stated for, priced with every charge, and its month."""
    from moeplan.runtime.lambda_.charges import breakdown_text

    u = call["usd"]
    return (f"predicted ${u['total']:.8f} per API call of {call['prompt_tokens']} prompt + {call['new_tokens']} new tokens "
            f"({breakdown_text(u)}; {call['latency_s']:.2f} s); ${call['monthly_usd']:.2f} per month at "
            f"{call['requests_per_second']:g} such calls per second")


def layer_lines(layers) -> list:
    """The per-layer sizing as a table: method, beta, memory and replica counts."""
    from collections import Counter

    from moeplan.passes.optimize.serverless import billing as sc

    lines = ["layer  method        beta  memory MB (experts)                 replicas (experts)"]
    for e, d in enumerate(layers):
        mem = Counter(c.memory_mb for c in d.experts)
        reps = Counter(c.replicas for c in d.experts)
        mem_s = " ".join(f"{m}x{n}" for m, n in sorted(mem.items()))
        rep_s = " ".join(f"{r}x{n}" for r, n in sorted(reps.items()))
        lines.append(f"{e:>5}  {sc.METHOD_NAMES[d.method]:<12}  {d.beta:>4}  {mem_s:<34}  {rep_s}")
    return lines


def describe(summary: dict, facts: dict) -> str:
    """What a lambda plan (with its sizing table) or bundle holds."""
    lines = [f"{summary['functions']} functions ({summary['dense_slices']} dense slices), methods "
             f"{', '.join(summary['methods'])}", api_call_line(summary["api_call"]),
             f"sized for batches of {summary['batch_tokens']} tokens: ${summary['cost_per_batch_usd']:.8f} per batch "
             "(Lambda duration and request fees of the MoE and dense functions: the sizing's objective)"]
    if "manifest" not in facts:  # the plan alone: how it was sized
        timings = summary["passes"]
        lines += layer_lines(facts["sizing"].result.layers)
        lines.append("predictor error (tokens per expert): "
                     + ", ".join(f"{k} {v:.1f}" for k, v in summary["predictor_error"].items()))
        profile_s = sum(t["seconds"] for t in timings if t["pass"] == "profile")
        lines.append(f"planning took {sum(t['seconds'] for t in timings):.1f} s (profile {profile_s:.1f} s"
                     f"{', cached' if facts['profile'].cached else ''})")
    return "\n".join(lines)


def read_plan(path) -> tuple:
    """(plan, facts, layers, batch_tokens) from a Lambda plan.json; problems are UserErrors."""
    from moeplan.passes.optimize.serverless import billing as sc
    from moeplan.passes.optimize.serverless.sizing import ExpertChoice, LayerDecision

    path = Path(path)
    if not path.is_file():
        raise UserError(f"plan file '{path}' does not exist; write one with 'moeplan plan MODEL --trace T --target lambda --slo S --out {path}'")
    try:
        plan = Plan.from_json(path.read_text(encoding="utf-8"))
    except (ValueError, TypeError, KeyError, AttributeError, UnicodeDecodeError, RecursionError) as exc:
        raise UserError(f"plan file '{path}' is not a moeplan plan ({exc.__class__.__name__}: {str(exc)[:80]})") from None
    if not isinstance(plan.communication, Communication) or not isinstance(plan.inputs, dict) \
            or not isinstance(plan.placement, Placement):
        raise UserError(f"plan file '{path}' has malformed sections; regenerate it with 'moeplan plan'")
    if plan.target != "lambda" or plan.communication.serverless_version != SERVERLESS_VERSION:
        raise UserError(f"plan file '{path}' is a '{plan.target}' plan; 'moeplan simulate' takes lambda plans "
                        f"(serverless_version {SERVERLESS_VERSION}) and offload plans"
                        + ("; a torchrun or kubernetes bundle is measured by 'moeplan run BUNDLE --verify'"
                           if plan.target in ("torchrun", "kubernetes") else ""))
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
        batch_tokens = int(plan.communication["batch_tokens"])  # string keys here: a missing one is the KeyError reported
    except (KeyError, TypeError, ValueError, OverflowError, AttributeError) as exc:
        raise UserError(f"plan file '{path}' has a malformed serverless section ({exc.__class__.__name__}: {exc}); regenerate it") from None
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


def _first_non_number(value, where: str, dicts_at=("facts", "facts.layers[]")):
    """The path of the first leaf of `value` that is not a finite number >= 0 (None if all are);
    dicts are allowed only where ServerlessFacts has them (the root and each of its layers)."""
    shape = re.sub(r"\[\d+\]", "[]", where)
    if isinstance(value, dict) and shape in dicts_at:
        return next((bad for k, v in value.items() if (bad := _first_non_number(v, f"{where}.{k}"))), None)
    if isinstance(value, list):
        return next((bad for i, v in enumerate(value) if (bad := _first_non_number(v, f"{where}[{i}]"))), None)
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < float("inf")
    return None if ok else where
