"""The AWS Lambda target: profile -> serverless facts -> expert sizing -> dense partition -> plan -> codegen.

Expert functions are sized by `passes/optimize/serverless/sizing_pipeline.py` (popularity table, optional
BO, MILP + ODS with a scatter-gather method per layer); the dense stages are partitioned by HyPAD
(`passes/optimize/serverless/partition.py`; parallelism 1: a dense slice is one function, whose
memory grows instead when the latency limit needs it). `moeplan plan --target lambda` runs this
list for the plan alone, so it works on config-only models too; `compile --target lambda` adds the
runtime check and the bundle (`backends/lambda_/codegen.py`).

plan.json body (serverless version 1):
* `placement`: {"version", "policy": "function_per_expert", "layers": [{"layer", "method", "beta",
  "experts": [{"expert", "memory_mb", "replicas", "predicted_tokens"}]}], "dense_slices": [{"slice",
  "units", "segments", "memory_mb", "eta"}], "unit_segments": {dense unit: segment}}
* `communication`: {"serverless_version": 1, "batch_tokens", "methods": per layer}
* `predicted`: cost (per batch: MoE layers, dense functions; per request with the partition),
  latency, throughput, validation batches, predictor errors, solver reports, profile, BO, and
  `request_cost`: the spec the request cost model prices one generation from
  (`passes/optimize/serverless/generation.py`; the front function and `simulate --new-tokens`)
* `inputs`: model spec, trace hash, SLO, options, and `facts` (platform + profiled timings): all
  `moeplan simulate` needs, so it never re-profiles.
* `deployment`: payload limit, the request rate the README's monthly cost is stated for, and the
  HTTP entry (`function-url` or `http-api`).
* `model.library`: the transformers / tokenizers versions the functions run (Hugging Face models).

Dense units are grouped per decoder block before HyPAD (the functions run the library's model,
which they can cut only between blocks; `backends/lambda_/layout.py`), each group sized by the
tensors its function will hold.
"""
from __future__ import annotations

import re
from pathlib import Path

from moeplan.core.errors import UserError
from moeplan.core.pass_manager import Pass
from moeplan.planner.pipeline.common import IMPORT, TRACE, needs_weights, plan_reads_back, trace_matches_model
from moeplan.core.plan import Plan

SERVERLESS_VERSION = 1


def methods_from_text(text: str) -> tuple:
    from moeplan.passes.optimize.serverless import billing as sc

    out = []
    for part in text.split(","):
        name = part.strip()
        if name not in sc.METHOD_IDS:
            raise UserError(f"unknown method '{name}' in --methods; use any of {', '.join(sc.METHOD_IDS)}")
        out.append(sc.METHOD_IDS[name])
    return tuple(sorted(set(out)))


def check_options(facts) -> None:
    o = facts["serverless_options"]
    if o["slo"] is None:
        raise UserError("--target lambda needs --slo SECONDS (end-to-end latency limit per batch)")
    if not o["slo"] > 0:
        raise UserError(f"--slo must be a positive number of seconds, got {o['slo']:g}")
    if o["batch_tokens"] <= 0:
        raise UserError(f"--batch-tokens must be positive, got {o['batch_tokens']}")
    if not 0 < o["validation_fraction"] < 1:
        raise UserError(f"--validation-fraction must be between 0 and 1, got {o['validation_fraction']}")
    if not o["requests_per_second"] > 0:
        raise UserError(f"--requests-per-second must be positive, got {o['requests_per_second']}")
    methods_from_text(o["methods"])


def _platform(facts):
    from moeplan.core.platforms import load_platform

    return {"platform": load_platform(facts["serverless_options"]["platform"])}


def _profile(facts):
    from moeplan.passes.analysis.profile.operators import DEFAULT_CACHE_DIR, profile_model

    loaded, o = facts["model"], facts["serverless_options"]
    prof = profile_model(loaded.ir, loaded.module if loaded.has_weights else None, budget_s=o["profile_budget"],
                         cache_dir=None if o["no_cache"] else (o["cache_dir"] or DEFAULT_CACHE_DIR), seed=o["seed"], onnx_path=loaded.onnx_path)
    return {"profile": prof}


def _facts(facts):
    from moeplan.passes.analysis.serverless_facts import build_facts

    return {"serverless_facts": build_facts(facts["model"].ir, facts["profile"], facts["platform"])}


def _sizing(facts):
    from moeplan.passes.optimize.serverless.bo_refine import BOOptions
    from moeplan.passes.optimize.serverless.sizing_pipeline import SizingOptions, plan_serverless

    o = facts["serverless_options"]
    bo = BOOptions(q=o["bo_q"], max_iterations=o["bo_iterations"], seed=o["seed"], storage=o["bo_storage"]) \
        if o["bo_iterations"] > 0 else None
    progress = facts["progress"]
    outcome = plan_serverless(facts["serverless_facts"], facts["trace"], o["slo"], batch_tokens=o["batch_tokens"],
                              validation_fraction=o["validation_fraction"],
                              sizing_options=SizingOptions(methods=methods_from_text(o["methods"]),
                                                           time_limit_s=o["time_limit"], solver=o["solver"]),
                              bo_options=bo, size_for_statistic=o["size_for"],
                              progress=lambda it, best: progress(f"BO iteration {it}: best cost ${best:.8f}"))
    return {"sizing": outcome}


def _partition(facts):
    from moeplan.passes.optimize.serverless import partition as P

    from moeplan.passes.optimize.serverless.generation import REQUEST_GRID

    loaded, o = facts["model"], facts["serverless_options"]
    by_tokens = P.units_on_grid(loaded.ir, facts["profile"], sorted(set(REQUEST_GRID) | {o["batch_tokens"]}),
                                loaded.module if loaded.has_weights else None, seed=o["seed"])
    units = _runtime_units(loaded, facts["model_spec"], by_tokens[o["batch_tokens"]])
    grid_units = {T: _runtime_units(loaded, facts["model_spec"], by_tokens[T]) for T in REQUEST_GRID}
    return {"partition": (P.hypad(units, facts["platform"], o["batch_tokens"], max_eta=1),
                          {n: u.segment for u in units for n in u.names}, grid_units)}


def _runtime_units(loaded, spec: str, units: list) -> list:
    """Units grouped where the Lambda runtime can cut (between decoder blocks of the library's
    model), each group's bytes those its function will ship (`backends/lambda_/layout.py`);
    unchanged for models the runtime cannot run (ONNX graphs: plan only)."""
    from moeplan.backends.lambda_ import layout as lay
    from moeplan.passes.optimize.serverless import partition as P

    if loaded.module is None:
        return units
    try:
        layout = lay.Layout.of(loaded.module)
    except lay.LayoutError:
        return units
    stages = loaded.ir.to_dict()["stages"]
    layout, sizes = lay.dense_tensor_bytes(lay.with_routing(layout, _meta_model(loaded, spec)), loaded.module, stages)
    pieces = lay.unit_pieces(layout, stages)
    if len(layout.moe_layers) != len(loaded.ir.moe_stages) or any(u not in pieces for x in units for u in x.names):
        return units
    return P.group_units(units, lambda name: pieces[name],
                         lambda u, opens: lay.group_bytes(layout, sizes, pieces, u.names, u.segment, opens))


def _meta_model(loaded, spec: str):
    """The model as the bundle's functions build it (transformers: on the meta device), so that
    probing its blocks never copies real weights; the loaded module where no bundle could be made."""
    from moeplan.backends.common.model_source import bundle_model, model_files

    try:
        arch, files = model_files(spec)
        return bundle_model(arch, files, spec)
    except UserError:
        return loaded.module


def _u_table(facts, batch_tokens) -> dict:
    """U_j: per-token expert compute time at each memory option, layer 0, mean expert load."""
    lf = facts.layers[0]
    tokens = max(1, batch_tokens * lf.top_k // max(lf.num_experts, 1))
    return {str(int(m)): float(f"{float(lf.u(m, tokens)):.4g}") for m in facts.platform.memory_options_mb}


def _predicted(outcome, part, prof, sfacts, o) -> dict:
    sim, res = outcome.predicted_sim, outcome.result
    n = len(outcome.validation)
    predicted = {
        "batch_tokens": o["batch_tokens"],
        "moe_cost_per_batch_usd": sim.moe_cost,
        "dense_cost_per_batch_usd": sim.dense_cost,
        "latency_s": sim.latency,
        "throughput_tokens_per_s": sim.throughput,
        "validation": {"batches": n, "moe_cost_per_batch_usd": sum(v.moe_cost for v in outcome.validation) / n,
                       "latency_s": sum(v.latency for v in outcome.validation) / n,
                       "slo_violations": sum(v.latency > o["slo"] + 1e-9 for v in outcome.validation),
                       "overflows": sum(len(v.overflows) for v in outcome.validation)},
        "predictor_error": outcome.predictor_error,  # on the validation batches (also used to select ours)
        "predictor_options": outcome.predictor_options,
        "algorithm": res.algorithm,
        "solves": [{k: v for k, v in s.items() if k != "seconds"} for s in res.solves],
        "profile": {"time_rmsle": prof.time_rmsle, "memory_rmsle": prof.memory_rmsle, "measurements": len(prof.rows),
                    "expert_u_s_per_token": _u_table(sfacts, o["batch_tokens"])},
        "dense_partition": {"cost_per_request_usd": part.cost_per_request_usd, "latency_s": part.latency_s,
                            "latency_limit_s": part.latency_limit_s, "slices": len(part.slices),
                            "merged_units": part.merged_units, "units": part.units},
        "cost_per_request_usd": sim.moe_cost + part.cost_per_request_usd,
    }
    if outcome.bo:
        predicted["bo"] = {"iterations": outcome.bo["iterations"], "baseline_cost": outcome.bo["baseline_cost"],
                           "best_cost": outcome.bo["best_cost"],
                           "history": [{k: v for k, v in h.items() if k != "seconds"} for h in outcome.bo["history"]]}
    return predicted


def _plan(facts):
    from moeplan.passes.optimize.serverless import billing as sc

    loaded, o, outcome = facts["model"], facts["serverless_options"], facts["sizing"]
    part, segment_of, grid_units = facts["partition"]
    ir, sfacts, layers = loaded.ir, facts["serverless_facts"], outcome.result.layers
    placement = {"version": 1, "policy": "function_per_expert", "layers": [
        {"layer": e, "method": sc.METHOD_NAMES[d.method], "beta": int(d.beta), "experts": [
            {"expert": i, "memory_mb": int(c.memory_mb), "replicas": int(c.replicas), "predicted_tokens": int(c.tokens)}
            for i, c in enumerate(d.experts)]}
        for e, d in enumerate(layers)],
        "dense_slices": [{"slice": k, "units": list(s.names), "segments": list(s.segments), "memory_mb": s.memory_mb,
                          "eta": s.eta} for k, s in enumerate(part.slices)],
        "unit_segments": dict(sorted(segment_of.items()))}
    from moeplan.backends.common.model_source import library_pins

    model = {"name": ir.name, "architecture": ir.architecture, "ir": ir.to_dict(),
             "library": library_pins("transformers" if ir.source_format.startswith("hf") else "")}
    functions = len(part.slices) + sum(int(c.replicas) for d in layers for c in d.experts)
    inputs = {"model": facts["model_spec"], "trace_sha256": facts["trace_sha256"], "slo_s": o["slo"],
              "validation_fraction": o["validation_fraction"], "methods": o["methods"].split(","), "size_for": o["size_for"],
              "bo_iterations": o["bo_iterations"], "bo_q": o["bo_q"], "seed": o["seed"],
              "profile_hash": facts["profile"].model_hash, "facts": sfacts.to_dict(),
              "profile": facts["profile"].to_dict()}  # the measurements behind every decision (issue 17)
    plan = Plan(
        target="lambda", model=model,
        topology={"kind": "serverless", "platform": sfacts.platform.name, "functions": functions},
        placement=placement,
        communication={"serverless_version": SERVERLESS_VERSION, "batch_tokens": int(o["batch_tokens"]),
                       "methods": [sc.METHOD_NAMES[d.method] for d in layers]},
        predicted=dict(_predicted(outcome, part, facts["profile"], sfacts, o),
                       request_cost=_request_spec(loaded, sfacts, layers, part, grid_units, o["http_entry"])),
        inputs=inputs,
        deployment={"payload_limit_bytes": int(facts["platform"].payload_limit_bytes),
                    "requests_per_second": o["requests_per_second"], "http_entry": o["http_entry"]},
    )
    return {"plan": plan}


def _request_spec(loaded, sfacts, layers, part, grid_units: dict, http_entry: str) -> dict:
    """What one generation request costs under this plan (passes/optimize/serverless/generation.py)."""
    from moeplan.passes.optimize.serverless.generation import kv_bytes_per_layer_token, request_spec

    from moeplan.backends.lambda_.front import time_limit_s
    from moeplan.runtime.lambda_.request_cost import request_cost

    p = sfacts.platform
    attention = {s.name for s in loaded.ir.stages if s.kind == "attention"}
    config = getattr(loaded.module, "config", None) if loaded.module is not None else None
    spec = request_spec(sfacts, layers, part.slices, grid_units, attention, kv_bytes_per_layer_token(config, loaded.ir),
                        int(p.front_function_memory_mb), p.http_api_request_price if http_entry == "http-api" else 0.0)
    limit, least = time_limit_s(p.to_dict(), http_entry), request_cost(spec, 1, 1)["latency_s"]
    if least > limit:  # even the smallest request cannot be answered behind this entry
        where = "an API Gateway HTTP API waits for its integration" if http_entry == "http-api" else \
            "a synchronous EXPRESS execution may run"
        other = "; --http-entry function-url waits up to 5 minutes" if http_entry == "http-api" else ""
        raise UserError(f"a one-token request is predicted to take {least:.1f} s, over the {limit:g} s {where}{other}")
    return spec


def _lambda_model_files(facts):
    """The model files a Lambda bundle ships, once the runtime is known to cut this model into functions."""
    from moeplan.backends.common.model_source import bundle_model, model_files
    from moeplan.backends.lambda_.layout import Layout, LayoutError

    try:
        arch, files = model_files(facts["model_spec"])
    except UserError as exc:  # its messages name the torchrun target, whose models this one runs too
        raise UserError(str(exc).replace("torchrun", "lambda")) from None
    try:
        Layout.of(bundle_model(arch, files, facts["model_spec"]))
    except LayoutError as exc:
        raise UserError(f"cannot compile '{facts['model_spec']}' for lambda: {exc}") from None
    return {"model_files": {"architecture": arch, "files": files}}


def _codegen(facts):
    from moeplan.backends.lambda_.codegen import write_bundle

    return {"manifest": write_bundle(facts["out"], facts["plan"], facts["model"].module.state_dict(), facts["model_files"])}


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
    if not isinstance(plan.communication, dict) or not isinstance(plan.inputs, dict) \
            or not isinstance(plan.placement, dict):
        raise UserError(f"plan file '{path}' has malformed sections; regenerate it with 'moeplan plan'")
    if plan.target != "lambda" or plan.communication.get("serverless_version") != SERVERLESS_VERSION:
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
        batch_tokens = int(plan.communication["batch_tokens"])
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


MODEL_FILES = Pass("runtime", ("model_spec",), ("model_files",), _lambda_model_files)
PLATFORM = Pass("platform", ("serverless_options",), ("platform",), _platform, check=check_options)
PROFILE = Pass("profile", ("model", "trace", "serverless_options"), ("profile",), _profile, check=trace_matches_model)
FACTS = Pass("facts", ("model", "profile", "platform"), ("serverless_facts",), _facts)
SIZING = Pass("sizing", ("serverless_facts", "trace", "serverless_options", "progress"), ("sizing",), _sizing)
PARTITION = Pass("partition", ("model", "model_spec", "profile", "platform", "serverless_options"), ("partition",), _partition)
PLAN = Pass("plan", ("model", "model_spec", "trace_sha256", "serverless_options", "serverless_facts", "profile", "platform",
                     "sizing", "partition"), ("plan",), _plan, ensures=plan_reads_back)
CODEGEN = Pass("codegen", ("plan", "model", "model_spec", "model_files", "out"), ("manifest",), _codegen, check=needs_weights)

PASSES = [MODEL_FILES, PLATFORM, IMPORT, TRACE, PROFILE, FACTS, SIZING, PARTITION, PLAN, CODEGEN]


def inputs(model: str, trace: str, out, values: dict) -> dict:
    """The facts the lambda pass list starts from; flag mistakes stop here, before any pass runs."""
    from moeplan.planner.pipeline.flags import SERVERLESS_FLAGS, pick

    serverless = dict(pick(values, SERVERLESS_FLAGS), time_limit=values["time_limit"], solver=values["solver"])
    check_options({"serverless_options": serverless})
    return {"model_spec": str(model), "trace_path": str(trace), "out": None if out is None else str(out),
            "serverless_options": serverless}


def summary(facts: dict) -> dict:
    """The --json summary's fields of a lambda plan."""
    doc = facts["plan"].to_dict()
    result = {}
    if "manifest" not in facts:
        result["bo_iterations"] = facts["sizing"].bo["iterations"] if facts["sizing"].bo else 0
    p = doc["predicted"]
    result.update(functions=doc["topology"]["functions"], dense_slices=len(doc["placement"]["dense_slices"]),
                  methods=doc["communication"]["methods"], cost_per_request_usd=p["cost_per_request_usd"],
                  moe_cost_per_batch_usd=p["moe_cost_per_batch_usd"], latency_s=p["latency_s"],
                  throughput_tokens_per_s=p["throughput_tokens_per_s"], algorithm=p["algorithm"],
                  predictor_error=p["predictor_error"])
    return result


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
             f"{', '.join(summary['methods'])}; predicted ${summary['cost_per_request_usd']:.8f} per request"]
    if "manifest" not in facts:  # the plan alone: how it was sized
        timings = summary["passes"]
        lines += layer_lines(facts["sizing"].result.layers)
        lines.append("predictor error (tokens per expert): "
                     + ", ".join(f"{k} {v:.1f}" for k, v in summary["predictor_error"].items()))
        profile_s = sum(t["seconds"] for t in timings if t["pass"] == "profile")
        lines.append(f"planning took {sum(t['seconds'] for t in timings):.1f} s (profile {profile_s:.1f} s"
                     f"{', cached' if facts['profile'].cached else ''})")
    return "\n".join(lines)
