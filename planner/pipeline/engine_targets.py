"""The sglang and trtllm targets: a placement that a serving engine loads at startup.

Passes: import (the config alone is enough: full-size models are built on the `meta` device) ->
layers (which decoder layers are MoE, from the config) -> trace -> placement -> serving (with
`--hardware` / `--workload`: TPOT, TTFT, throughput and memory per GPU of the deployment, priced from
measured kernels, `passes/cost/engine/serving_pass.py`) -> plan (`passes/engine_targets/passes.py`) -> codegen (`backends/common/engine_bundle.py` with
`backends/sglang/` or `backends/trtllm/`, written into a temporary directory renamed onto --out
only when everything succeeded). `moeplan codegen plan.json` rewrites the files from the plan
alone: they hold no weights. What the plan optimises: `passes/engine_targets/passes.py`.
"""
from __future__ import annotations

from moeplan.backends.common.engine_bundle import CODEGEN
from moeplan.core.errors import UserError
from moeplan.passes.analysis.trace.passes import TRACE
from moeplan.passes.cost.engine.serving_pass import SERVING, serving_options
from moeplan.passes.engine_targets.passes import ENGINE_DEFAULTED, LAYERS, PLACEMENT, PLAN
from moeplan.passes.importers.passes import IMPORT

ENGINE_TARGETS = ("sglang", "trtllm")


PASSES = [IMPORT, LAYERS, TRACE, PLACEMENT, SERVING, PLAN, CODEGEN]


def inputs(target: str, model: str, trace: str, out, values: dict, given) -> dict:
    """The facts the engine pass list starts from. Placement flags not given (`given`: the names of
    those that were) become None, so the passes apply the engine defaults (eplb, the config's groups)."""
    from moeplan.planner.pipeline.flags import PLACEMENT_FLAGS, pick

    if values["image"] is not None and not values["kubernetes"]:
        raise UserError("--image applies to --target sglang with --kubernetes (the pods' image)")
    placement = {k: (None if k in ENGINE_DEFAULTED and k not in given else v)
                 for k, v in pick(values, PLACEMENT_FLAGS).items()}
    spec = {"name": target}
    if values["kubernetes"]:
        from moeplan.backends.sglang.codegen import DEFAULT_IMAGE

        spec.update(kubernetes=True, image=values["image"] or DEFAULT_IMAGE)
    return {"model_spec": str(model), "trace_path": str(trace), "out": None if out is None else str(out),
            "topology": {"nodes": values["nodes"], "gpus_per_node": values["gpus_per_node"]},
            "placement_options": placement, "target": spec,
            "serving_options": serving_options(values["hardware"], values["workload"], target, values["nodes"])}


def summary(facts: dict) -> dict:
    """The --json summary's fields of an engine target's plan."""
    plan = facts["plan"]
    return {"world_size": plan.world_size, "policy": plan.placement.policy,
            "redundant": plan.communication.redundant, "objective": "balance",
            "predicted": plan.as_written().predicted.to_json()}


def describe(summary: dict, facts: dict) -> str:
    predicted = summary["predicted"]
    text = (f"{summary['target']} placement for {summary['world_size']} EP ranks ({summary['policy']}, "
            f"{summary['redundant']} redundant slots); predicted max/mean rank load "
            f"{predicted['max_over_mean_load']:.3f}")
    serving = predicted.get("serving")
    if serving:
        text += "\n" + serving_line(serving)
    return text


def serving_line(serving: dict) -> str:
    """The serving prediction in one line, as compile and plan print it."""
    layout = serving["layout"]
    attention = f"dp{layout['attention_dp']}" if layout["attention_dp"] > 1 else f"tp{layout['attention_tp']}"
    fits = "fits" if serving["fits"] else "does NOT fit"
    return (f"serving {serving['workload']} on {layout['gpus']}x {serving['hardware']} (attention {attention}, "
            f"ep{layout['moe_ep']}): TPOT {serving['tpot_s'] * 1e3:.2f} ms, TTFT {serving['ttft_s']:.3f} s, "
            f"{serving['output_tokens_per_s']:.0f} output tokens/s ({serving['output_tokens_per_s_per_gpu']:.0f} per GPU), "
            f"{serving['memory_per_gpu_bytes'] / 2**30:.1f} GiB per GPU ({fits} in "
            f"{serving['memory']['device_bytes'] / 2**30:.0f} GiB); prices: {price_sources_text(serving)}")


def price_sources_text(serving: dict) -> str:
    """Share of the decode step's time per price source, largest first."""
    sources = serving.get("price_sources") or []
    total = sum(r["seconds"] for r in sources) or 1.0
    return ", ".join(f"{r['seconds'] / total:.0%} {r['source']}" for r in sorted(sources, key=lambda r: -r["seconds"]))
