"""The AWS Lambda target's serverless passes: platform -> expert sizing -> dense partition -> plan.

The whole list (runtime files, import, trace, profile, serverless facts, these, codegen) is
`planner/pipeline/lambda_.py`; the profile and facts passes stand beside their analyses
(`passes/analysis/profile/passes.py`, `passes/analysis/passes.py`), the codegen pass beside the
bundle writer (`backends/lambda_/codegen.py`).

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
  (`passes/optimize/serverless/request_spec.py`; the front function and `simulate --new-tokens`), and
  `api_call`: that model's price of the API call named at compile (--prompt-tokens, --new-tokens),
  every charge in, and the monthly cost of such calls at --requests-per-second (`api_call` below)
* `inputs`: model spec, trace hash, SLO, options, and `facts` (platform + profiled timings): all
  `moeplan simulate` needs, so it never re-profiles.
* `deployment`: payload limit, the request rate the README's monthly cost is stated for, and the
  HTTP entry (`function-url` or `http-api`).
* `model.library`: the transformers / tokenizers versions the functions run (Hugging Face models).

Dense units are grouped per decoder block before HyPAD (the functions run the library's model,
which they can cut only between blocks; `backends/lambda_/layout.py: runtime_units`, which the
driver hands to `partition_pass`), each group sized by the tensors its function will hold.
"""
from __future__ import annotations

from moeplan.core.errors import UserError
from moeplan.core.library_pins import library_pins
from moeplan.core.pass_manager import Pass
from moeplan.core.plan import Plan, plan_reads_back
from moeplan.core.platforms import time_limit_s

SERVERLESS_VERSION = 1
SECONDS_PER_MONTH = 30 * 24 * 3600


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
    if o["prompt_tokens"] < 1 or o["new_tokens"] < 1:
        raise UserError(f"--prompt-tokens and --new-tokens name the API call whose cost is stated and must be at least 1, "
                        f"got {o['prompt_tokens']} and {o['new_tokens']}")
    methods_from_text(o["methods"])


def _platform(facts):
    from moeplan.core.platforms import load_platform

    return {"platform": load_platform(facts["serverless_options"]["platform"])}


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


def partition_pass(runtime_units) -> Pass:
    """The dense partition pass (HyPAD, `partition.py`), its units first grouped where the Lambda
    runtime can cut the model: `runtime_units(loaded, model_spec, units, group_units)` returns the
    units grouped by `group_units` (`partition.group_units`). The driver gives the Lambda backend's
    (`backends/lambda_/layout.py: runtime_units`): passes do not import backends."""
    def _partition(facts):
        from moeplan.passes.optimize.serverless import partition as P

        from moeplan.passes.optimize.serverless.request_spec import REQUEST_GRID

        loaded, o = facts["model"], facts["serverless_options"]
        by_tokens = P.units_on_grid(loaded.ir, facts["profile"], sorted(set(REQUEST_GRID) | {o["batch_tokens"]}),
                                    loaded.module if loaded.has_weights else None, seed=o["seed"])
        units = runtime_units(loaded, facts["model_spec"], by_tokens[o["batch_tokens"]], P.group_units)
        grid_units = {T: runtime_units(loaded, facts["model_spec"], by_tokens[T], P.group_units) for T in REQUEST_GRID}
        return {"partition": (P.hypad(units, facts["platform"], o["batch_tokens"], max_eta=1),
                              {n: u.segment for u in units for n in u.names}, grid_units)}

    return Pass("partition", ("model", "model_spec", "profile", "platform", "serverless_options"), ("partition",), _partition)


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
    model = {"name": ir.name, "architecture": ir.architecture, "ir": ir.to_dict(),
             "library": library_pins("transformers" if ir.source_format.startswith("hf") else "")}
    functions = len(part.slices) + sum(int(c.replicas) for d in layers for c in d.experts)
    inputs = {"model": facts["model_spec"], "trace_sha256": facts["trace_sha256"], "slo_s": o["slo"],
              "validation_fraction": o["validation_fraction"], "methods": o["methods"].split(","), "size_for": o["size_for"],
              "bo_iterations": o["bo_iterations"], "bo_q": o["bo_q"], "seed": o["seed"],
              "profile_hash": facts["profile"].model_hash, "facts": sfacts.to_dict(),
              "profile": facts["profile"].to_dict()}  # the measurements behind every decision (issue 17)
    spec = _request_spec(loaded, sfacts, layers, part, grid_units, o["http_entry"])
    plan = Plan(
        target="lambda", model=model,
        topology={"kind": "serverless", "platform": sfacts.platform.name, "functions": functions},
        placement=placement,
        communication={"serverless_version": SERVERLESS_VERSION, "batch_tokens": int(o["batch_tokens"]),
                       "methods": [sc.METHOD_NAMES[d.method] for d in layers]},
        predicted=dict(_predicted(outcome, part, facts["profile"], sfacts, o), request_cost=spec,
                       api_call=api_call(spec, o, time_limit_s(sfacts.platform.to_dict(), o["http_entry"]))),
        inputs=inputs,
        deployment={"payload_limit_bytes": int(facts["platform"].payload_limit_bytes),
                    "requests_per_second": o["requests_per_second"], "http_entry": o["http_entry"]},
    )
    return {"plan": plan}


def api_call(spec: dict, o: dict, limit_s: float) -> dict:
    """What the API call the user named (--prompt-tokens, --new-tokens: a request that runs to its
    max_tokens) costs, every charge in (the front function, each function's duration and request fee,
    S3 requests, the EXPRESS execution, the HTTP API's fee), and the month of such calls at
    --requests-per-second; refused when the deployment's HTTP entry would not wait for it."""
    from moeplan.runtime.lambda_.request_cost import request_cost

    P, N, rate = int(o["prompt_tokens"]), int(o["new_tokens"]), float(o["requests_per_second"])
    cost = request_cost(spec, P, N)
    if cost["latency_s"] > limit_s:
        raise UserError(f"an API call of {P} prompt + {N} new tokens is predicted to take {cost['latency_s']:.1f} s, over "
                        f"the {limit_s:g} s this deployment's HTTP entry waits; name a shorter call with --new-tokens "
                        "or --prompt-tokens")
    return {"prompt_tokens": P, "new_tokens": N, "usd": cost["usd"], "latency_s": cost["latency_s"],
            "lambda_gb_s": cost["lambda_gb_s"], "lambda_invocations": cost["lambda_invocations"],
            "s3_puts": cost["s3_puts"], "s3_gets": cost["s3_gets"], "executions": cost["executions"],
            "requests_per_second": rate, "monthly_usd": cost["usd"]["total"] * rate * SECONDS_PER_MONTH}


def _request_spec(loaded, sfacts, layers, part, grid_units: dict, http_entry: str) -> dict:
    """What one generation request costs under this plan (passes/optimize/serverless/request_spec.py)."""
    from moeplan.passes.optimize.serverless.request_spec import kv_bytes_per_layer_token, request_spec
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


PLATFORM = Pass("platform", ("serverless_options",), ("platform",), _platform, check=check_options)
SIZING = Pass("sizing", ("serverless_facts", "trace", "serverless_options", "progress"), ("sizing",), _sizing)
PLAN = Pass("plan", ("model", "model_spec", "trace_sha256", "serverless_options", "serverless_facts", "profile", "platform",
                     "sizing", "partition"), ("plan",), _plan, ensures=plan_reads_back)
