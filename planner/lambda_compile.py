"""`moeplan compile MODEL --trace T --target lambda --slo S --out DIR`: plan, partition, write the bundle.

Steps: profile (cached), serverless facts, expert sizing with a scatter-gather method per layer
(`serverless_plan.plan_serverless`, as `moeplan plan`), HyPAD on the dense stages
(`passes/optimize/serverless/partition.py`; parallelism 1: a dense slice is one function, memory grows
instead when the latency limit needs it), then the Lambda bundle (`backends/lambda_/codegen.py`)
written into a temporary directory renamed onto --out only when everything succeeded.
The plan.json is the lambda plan of `moeplan plan` with `placement.dense_slices` and
`predicted.dense_partition` added.
"""
from __future__ import annotations

import json
from pathlib import Path

from moeplan.planner.errors import UserError


def compile_lambda(model_spec: str, trace_path: str, out: str, *, slo_s: float, batch_tokens: int = 10240,
                   methods: str = "pipelined_s3,s3,direct", platform_file=None, cache_dir=None,
                   profile_budget: float = 5.0, time_limit: float = 10.0, requests_per_second: float = 1.0,
                   seed: int = 0, profile_from=None) -> dict:
    """Run the pipeline; returns a summary dict."""
    from dataclasses import asdict

    from moeplan.backends.lambda_.codegen import write_bundle
    from moeplan.backends.common.model_source import model_files
    from moeplan.backends.common.shards import state_dict_sha256
    from moeplan.passes.analysis.profile.operators import DEFAULT_CACHE_DIR, profile_model, profile_record
    from moeplan.passes.analysis.serverless_facts import build_facts
    from moeplan.passes.analysis.trace.format import load_trace, trace_file_sha256
    from moeplan.passes.optimize.serverless import partition as P
    from moeplan.passes.optimize.serverless.plan import SizingOptions, plan_serverless
    from moeplan.planner.atomic import atomic_path
    from moeplan.planner.compile_pipeline import check_trace_matches
    from moeplan.planner.commands.plan import _methods
    from moeplan.planner.importers import load_model
    from moeplan.planner.lambda_plan import _sig, build_plan
    from moeplan.planner.platforms import load_platform

    if batch_tokens <= 0:
        raise UserError(f"--batch-tokens must be positive, got {batch_tokens}")
    if requests_per_second <= 0:
        raise UserError(f"--requests-per-second must be positive, got {requests_per_second}")
    arch, files = model_files(model_spec)
    if arch != "tiny_moe":
        raise UserError(f"the lambda target runs TinyMoE-family models (see examples/tiny_moe); '{model_spec}' is {arch}")
    platform = load_platform(platform_file)
    trace = load_trace(trace_path)
    loaded = load_model(model_spec)
    if not loaded.has_weights:
        raise UserError(f"model '{model_spec}' has no weights to ship; the lambda target needs a runnable model")
    ir = loaded.ir
    check_trace_matches(ir, trace, f"trace '{trace_path}'")
    if profile_from is not None:
        prof = recorded_profile(profile_from, ir)
    else:
        prof = profile_model(ir, loaded.module, budget_s=profile_budget, seed=seed,
                             cache_dir=DEFAULT_CACHE_DIR if cache_dir is None else cache_dir)
    facts = build_facts(ir, prof, platform)
    outcome = plan_serverless(facts, trace, slo_s, batch_tokens=batch_tokens,
                              sizing_options=SizingOptions(methods=_methods(methods), time_limit_s=time_limit))
    sim = outcome.predicted_sim
    units = P.units_from_profile(ir, prof, batch_tokens, loaded.module, seed=seed)
    part = P.hypad(units, platform, batch_tokens, max_eta=1)
    predicted = {
        "batch_tokens": batch_tokens, "moe_cost_per_batch_usd": sim.moe_cost, "latency_s": sim.latency,
        "throughput_tokens_per_s": sim.throughput, "algorithm": outcome.result.algorithm,
        "predictor_error": outcome.predictor_error,
        "dense_partition": {"cost_per_request_usd": part.cost_per_request_usd, "latency_s": part.latency_s,
                            "latency_limit_s": part.latency_limit_s, "slices": len(part.slices),
                            "merged_units": part.merged_units, "units": part.units},
        "cost_per_request_usd": sim.moe_cost + part.cost_per_request_usd,
    }
    inputs = {"trace_sha256": trace_file_sha256(trace_path), "slo_s": slo_s, "methods": methods.split(","),
              "profile_hash": prof.model_hash, "seed": seed, "profile": profile_record(prof, ir)}
    plan = build_plan(ir, facts, outcome.result.layers, batch_tokens=batch_tokens, predicted=predicted, inputs=inputs)
    doc = _sig(asdict(plan))
    doc["model"].update({"architecture": arch, "config": "model/config.json", "source": "model/model.py",
                         "weights_sha256": state_dict_sha256(loaded.module.state_dict())})
    doc["placement"]["dense_slices"] = [{"slice": k, "units": s.names, "segments": s.segments,
                                         "memory_mb": s.memory_mb, "eta": s.eta} for k, s in enumerate(part.slices)]
    doc["topology"]["functions"] = len(part.slices) + sum(int(x["replicas"]) for l in doc["placement"]["layers"]
                                                          for x in l["experts"])
    text = json.dumps(doc, indent=2, sort_keys=True) + "\n"
    segment_of = {n: u.segment for u in units for n in u.names}
    with atomic_path(Path(out), kind="bundle") as tmp:
        manifest = write_bundle(tmp, doc, text, loaded.module.state_dict(), files, segment_of=segment_of,
                                payload_limit=platform.payload_limit_bytes, requests_per_second=requests_per_second)
    return {"out": str(out), "target": "lambda", "functions": doc["topology"]["functions"],
            "dense_slices": len(part.slices), "methods": doc["communication"]["methods"],
            "cost_per_request_usd": predicted["cost_per_request_usd"], "files": len(manifest["files"])}


def recorded_profile(source, ir):
    """The profile recorded in a lambda plan.json (or a lambda bundle directory holding one)."""
    from moeplan.passes.analysis.profile.operators import profile_for_reuse

    path = Path(source)
    if path.is_dir():
        path = path / "plan.json"
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
        record = doc["inputs"]["profile"]
    except (OSError, ValueError, UnicodeDecodeError):
        raise UserError(f"--profile-from: cannot read '{path}' as a plan.json; give a lambda plan or bundle") from None
    except (KeyError, TypeError):
        raise UserError(f"--profile-from: '{path}' records no profile (inputs.profile); give a plan made by "
                        "this moeplan") from None
    try:
        return profile_for_reuse(record, ir)
    except ValueError as exc:
        raise UserError(f"--profile-from '{path}': {exc}") from None
