"""The offloading passes: the offload target's plan (one GPU whose experts do not all fit) and the
expert caches of torchrun bundles (compile --gpu-memory / --expert-cache).

The decisions (cache capacity, residents, eviction, prefetch, tiers) are `cache_plan.py` and, per
rank, `rank_caches.py`. Facts read: `offload_options` (gpu_memory_bytes | expert_cache, hardware, batch,
max_length, prompt_tokens, validation_fraction, seed; `options.py` makes them from the flags) and
`progress` (a callable for progress lines).
"""
from __future__ import annotations

from moeplan.core.pass_manager import Pass
from moeplan.core.plan import Plan, plan_reads_back
from moeplan.passes.analysis.trace.passes import trace_matches_model


def routed_trace_matches_model(facts) -> None:
    """Offload planning replays per-token expert requests, so a loads-only trace cannot serve."""
    from moeplan.passes.analysis.trace.format import require_routing

    require_routing(facts["trace"], "offload planning (per-token expert requests)")
    trace_matches_model(facts)


def _plan(facts):
    from moeplan.passes.optimize.offload.cache_plan import OffloadRequest, kv_bytes_per_token, plan_offload
    from moeplan.core.hardware import DEFAULT_OFFLOAD_HARDWARE, load_profile

    o, loaded = facts["offload_options"], facts["model"]
    ir = loaded.ir
    given = load_profile(o["hardware"], DEFAULT_OFFLOAD_HARDWARE)
    hw = given.profile
    config = getattr(loaded.module, "config", None) if loaded.module is not None else None
    req = OffloadRequest(hardware=hw, gpu_memory_bytes=o["gpu_memory_bytes"], expert_cache=o["expert_cache"],
                         batch=o["batch"], max_length=o["max_length"], prompt_tokens=o["prompt_tokens"],
                         validation_fraction=o["validation_fraction"], seed=o["seed"],
                         host_memory_bytes=o.get("host_memory_bytes"), host_compute=o.get("host_compute"))
    body = plan_offload(ir, facts["trace"], req, kv_bytes_per_token(config, ir), say=facts["progress"])
    inputs = {"model": facts["model_spec"], "trace_sha256": facts["trace_sha256"], "gpu_memory_bytes": o["gpu_memory_bytes"],
              "expert_cache": o["expert_cache"], "hardware": hw.name, "batch": o["batch"], "max_length": o["max_length"],
              **({"host_memory_bytes": o["host_memory_bytes"]} if o.get("host_memory_bytes") is not None else {}),
              **({"host_compute": o["host_compute"]} if o.get("host_compute") is not None else {}),
              "prompt_tokens": o["prompt_tokens"], "validation_fraction": o["validation_fraction"], "seed": o["seed"],
              **body["inputs_extra"], **given.plan_record(figures=False)}
    plan = Plan(target="offload", model={"name": ir.name, "architecture": ir.architecture, "ir": ir.to_dict()},
                topology={"kind": "single_gpu", "nodes": 1, "gpus_per_node": 1, "hardware": hw.name},
                placement=body["placement"], communication=body["communication"], predicted=body["predicted"],
                inputs=inputs)
    return {"plan": plan}


PLAN = Pass("plan", ("model", "model_spec", "trace", "trace_sha256", "offload_options", "progress"), ("plan",), _plan,
            check=routed_trace_matches_model, ensures=plan_reads_back)


# --- expert caches inside torchrun bundles (compile --gpu-memory / --expert-cache) -------------------

def _offload_request(o: dict, hardware: str):
    """The expert-cache request of a torchrun/Kubernetes plan, priced on the plan's own profile
    (`hardware`: --hardware, the same profile as the cost model's)."""
    from moeplan.passes.optimize.offload.cache_plan import OffloadRequest
    from moeplan.core.hardware import load_hardware

    return OffloadRequest(hardware=load_hardware(hardware), gpu_memory_bytes=o["gpu_memory_bytes"],
                          expert_cache=o["expert_cache"], batch=o["batch"], max_length=o["max_length"],
                          prompt_tokens=o["prompt_tokens"], validation_fraction=o["validation_fraction"], seed=o["seed"],
                          host_memory_bytes=o.get("host_memory_bytes"), host_compute=o.get("host_compute"))


def _expert_cache(facts):
    """Per-rank expert caches when compile was asked for them (`offload_options` not None)."""
    o = facts["offload_options"]
    if o is None:
        return {"expert_cache": None}
    from moeplan.passes.analysis.trace.format import require_routing
    from moeplan.passes.optimize.offload.cache_plan import kv_bytes_per_token
    from moeplan.passes.optimize.offload.rank_caches import plan_rank_caches

    require_routing(facts["trace"], "an expert cache (per-token expert requests)")
    loaded = facts["model"]
    config = getattr(loaded.module, "config", None) if loaded.module is not None else None
    hardware = facts["cost_options"]["hardware"]  # the plan's one profile (default_cost_options filled it in)
    body = plan_rank_caches(loaded.ir, facts["trace"], facts["placement"].hosts(), _offload_request(o, hardware),
                            kv_bytes_per_token(config, loaded.ir), eviction=o.get("eviction"),
                            prefetch=o.get("prefetch"), ranks_per_node=facts["placement"].topology.gpus_per_node)
    return {"expert_cache": body}


EXPERT_CACHE = Pass("expert_cache", ("model", "trace", "placement", "offload_options", "cost_options"), ("expert_cache",),
                    _expert_cache)


