"""The offload target (one GPU whose experts do not all fit): import -> trace -> offload plan.

A plan-only target for now (no bundle codegen yet); its passes and decisions are
`passes/optimize/offload/` (`passes.py`, `cache_plan.py`), its options `options.py` there.
"""
from __future__ import annotations

from moeplan.passes.analysis.trace.passes import TRACE
from moeplan.passes.importers.passes import IMPORT
from moeplan.passes.optimize.offload.options import offload_options
from moeplan.passes.optimize.offload.passes import PLAN

PASSES = [IMPORT, TRACE, PLAN]


def inputs(model: str, trace: str, out, values: dict) -> dict:
    """The facts `moeplan plan --target offload` starts from (an unknown --hardware stops here, before any pass)."""
    from moeplan.core.hardware import DEFAULT_OFFLOAD_HARDWARE, load_profile

    load_profile(values["hardware"], DEFAULT_OFFLOAD_HARDWARE)
    return {"model_spec": str(model), "trace_path": str(trace), "offload_options": offload_options(values)}


def summary(facts: dict) -> dict:
    """The --json summary's fields of an offload plan."""
    the_plan = facts["plan"]
    p, c = the_plan.predicted, the_plan.communication
    return {"expert_cache": c.expert_cache, "total_experts": c.memory["total_experts"], "eviction": c.eviction,
            "prefetch": c.prefetch, "hit_ratio": p.hit_ratio, "seconds_per_token": p.seconds_per_token,
            "belady_gap_points": p.belady_gap_points}


def describe(summary: dict, facts: dict) -> str:
    """What an offload plan holds."""
    the_plan = facts["plan"]
    p, c = the_plan.predicted, the_plan.communication
    m = c.memory
    return "\n".join([
        f"expert cache {c.expert_cache} of {m['total_experts']} experts "
        f"({m['expert_bytes'] / 2**20:.1f} MiB each), eviction {c.eviction}, prefetch {c.prefetch}",
        f"GPU memory: dense {m['dense_bytes'] / 2**30:.2f} GiB, KV {m['kv_cache_bytes'] / 2**30:.2f} GiB, "
        f"activations {m['activation_bytes'] / 2**30:.2f} GiB, reserve {m['reserve_bytes'] / 2**30:.2f} GiB; "
        f"tiers: host {c.tiers['host_experts']} experts, disk {c.tiers['disk_experts']}",
        f"predicted on held-out sequences: hit ratio {p.hit_ratio:.3f} (Belady {p.policies['belady']['hit_ratio']:.3f}), "
        f"{p.seconds_per_token * 1e3:.3f} ms/token, {p.resident_at_layer_start:.3f} resident at layer start",
        f"planning took {summary['seconds']:.1f} s"])


