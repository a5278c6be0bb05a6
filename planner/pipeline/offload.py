"""The offload target (one GPU whose experts do not all fit): import -> trace -> offload plan.

A plan-only target for now: the decisions (cache capacity, residents, eviction, prefetch, tiers)
are `passes/optimize/offload/plan.py`; no bundle codegen yet. Facts read from the command:
`offload_options` (gpu_memory_bytes | expert_cache, hardware, batch, max_length, prompt_tokens,
validation_fraction, seed) and `progress` (a callable for progress lines).
"""
from __future__ import annotations

from moeplan.planner.pass_manager import Pass
from moeplan.planner.pipeline.common import IMPORT, TRACE, trace_matches_model
from moeplan.planner.plan import Plan


def routed_trace_matches_model(facts) -> None:
    """Offload planning replays per-token expert requests, so a loads-only trace cannot serve."""
    from moeplan.passes.analysis.trace.format import require_routing

    require_routing(facts["trace"], "offload planning (per-token expert requests)")
    trace_matches_model(facts)


def _plan(facts):
    from moeplan.passes.optimize.offload.hardware import DEFAULT, load_hardware
    from moeplan.passes.optimize.offload.plan import OffloadRequest, kv_bytes_per_token, plan_offload

    o, loaded = facts["offload_options"], facts["model"]
    ir = loaded.ir
    hw = load_hardware(o["hardware"] or DEFAULT)
    config = getattr(loaded.module, "config", None) if loaded.module is not None else None
    req = OffloadRequest(hardware=hw, gpu_memory_bytes=o["gpu_memory_bytes"], expert_cache=o["expert_cache"],
                         batch=o["batch"], max_length=o["max_length"], prompt_tokens=o["prompt_tokens"],
                         validation_fraction=o["validation_fraction"], seed=o["seed"])
    body = plan_offload(ir, facts["trace"], req, kv_bytes_per_token(config, ir), say=facts["progress"])
    inputs = {"model": facts["model_spec"], "trace_sha256": facts["trace_sha256"], "gpu_memory_bytes": o["gpu_memory_bytes"],
              "expert_cache": o["expert_cache"], "hardware": hw.name, "batch": o["batch"], "max_length": o["max_length"],
              "prompt_tokens": o["prompt_tokens"], "validation_fraction": o["validation_fraction"], "seed": o["seed"],
              **body["inputs_extra"]}
    plan = Plan(target="offload", model={"name": ir.name, "architecture": ir.architecture, "ir": ir.to_dict()},
                topology={"kind": "single_gpu", "nodes": 1, "gpus_per_node": 1, "hardware": hw.name},
                placement=body["placement"], communication=body["communication"], predicted=body["predicted"],
                inputs=inputs)
    return {"plan": plan}


PLAN = Pass("plan", ("model", "model_spec", "trace", "trace_sha256", "offload_options", "progress"), ("plan",), _plan,
            check=routed_trace_matches_model)
PASSES = [IMPORT, TRACE, PLAN]
