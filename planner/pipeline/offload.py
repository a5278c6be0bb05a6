"""The offload target (one GPU whose experts do not all fit): import -> trace -> offload plan.

A plan-only target for now: the decisions (cache capacity, residents, eviction, prefetch, tiers)
are `passes/optimize/offload/plan.py`; no bundle codegen yet. Facts read from the command:
`offload_options` (gpu_memory_bytes | expert_cache, hardware, batch, max_length, prompt_tokens,
validation_fraction, seed) and `progress` (a callable for progress lines).
"""
from __future__ import annotations

from pathlib import Path

from moeplan.planner.pass_manager import Pass
from moeplan.planner.pipeline.common import IMPORT, TRACE, trace_matches_model
from moeplan.planner.plan import Plan


def routed_trace_matches_model(facts) -> None:
    """Offload planning replays per-token expert requests, so a loads-only trace cannot serve."""
    from moeplan.passes.analysis.trace.format import require_routing

    require_routing(facts["trace"], "offload planning (per-token expert requests)")
    trace_matches_model(facts)


def _plan(facts):
    from moeplan.passes.optimize.offload.plan import OffloadRequest, kv_bytes_per_token, plan_offload
    from moeplan.planner.hardware import DEFAULT_OFFLOAD_HARDWARE, load_profile

    o, loaded = facts["offload_options"], facts["model"]
    ir = loaded.ir
    given = load_profile(o["hardware"], DEFAULT_OFFLOAD_HARDWARE)
    hw = given.profile
    config = getattr(loaded.module, "config", None) if loaded.module is not None else None
    req = OffloadRequest(hardware=hw, gpu_memory_bytes=o["gpu_memory_bytes"], expert_cache=o["expert_cache"],
                         batch=o["batch"], max_length=o["max_length"], prompt_tokens=o["prompt_tokens"],
                         validation_fraction=o["validation_fraction"], seed=o["seed"],
                         host_memory_bytes=o.get("host_memory_bytes"))
    body = plan_offload(ir, facts["trace"], req, kv_bytes_per_token(config, ir), say=facts["progress"])
    inputs = {"model": facts["model_spec"], "trace_sha256": facts["trace_sha256"], "gpu_memory_bytes": o["gpu_memory_bytes"],
              "expert_cache": o["expert_cache"], "hardware": hw.name, "batch": o["batch"], "max_length": o["max_length"],
              **({"host_memory_bytes": o["host_memory_bytes"]} if o.get("host_memory_bytes") is not None else {}),
              "prompt_tokens": o["prompt_tokens"], "validation_fraction": o["validation_fraction"], "seed": o["seed"],
              **body["inputs_extra"], **given.plan_record(figures=False)}
    plan = Plan(target="offload", model={"name": ir.name, "architecture": ir.architecture, "ir": ir.to_dict()},
                topology={"kind": "single_gpu", "nodes": 1, "gpus_per_node": 1, "hardware": hw.name},
                placement=body["placement"], communication=body["communication"], predicted=body["predicted"],
                inputs=inputs)
    return {"plan": plan}


PLAN = Pass("plan", ("model", "model_spec", "trace", "trace_sha256", "offload_options", "progress"), ("plan",), _plan,
            check=routed_trace_matches_model)
PASSES = [IMPORT, TRACE, PLAN]


# --- expert caches inside torchrun bundles (compile --gpu-memory / --expert-cache) -------------------

RUNTIME_POLICY_FILES = {  # bundle path: the simulator's module it is a copy of
    "runtime/offload_policies.py": "moeplan.passes.optimize.offload.policies",
    "runtime/offload_next_use.py": "moeplan.passes.optimize.offload.next_use",
    "runtime/offload_stepper.py": "moeplan.passes.optimize.offload.stepper",
    "runtime/offload_prefetch.py": "moeplan.passes.optimize.offload.prefetch",
    "runtime/offload_eam_match.py": "moeplan.passes.analysis.eam_match",
}


def _offload_request(o: dict, hardware: str):
    """The expert-cache request of a torchrun/Kubernetes plan, priced on the plan's own profile
    (`hardware`: --hardware, the same profile as the cost model's)."""
    from moeplan.passes.optimize.offload.plan import OffloadRequest
    from moeplan.planner.hardware import load_hardware

    return OffloadRequest(hardware=load_hardware(hardware), gpu_memory_bytes=o["gpu_memory_bytes"],
                          expert_cache=o["expert_cache"], batch=o["batch"], max_length=o["max_length"],
                          prompt_tokens=o["prompt_tokens"], validation_fraction=o["validation_fraction"], seed=o["seed"],
                          host_memory_bytes=o.get("host_memory_bytes"))


def _expert_cache(facts):
    """Per-rank expert caches when compile was asked for them (`offload_options` not None)."""
    o = facts["offload_options"]
    if o is None:
        return {"expert_cache": None}
    from moeplan.passes.analysis.trace.format import require_routing
    from moeplan.passes.optimize.offload.plan import kv_bytes_per_token
    from moeplan.passes.optimize.offload.ranks import plan_rank_caches

    require_routing(facts["trace"], "an expert cache (per-token expert requests)")
    loaded = facts["model"]
    config = getattr(loaded.module, "config", None) if loaded.module is not None else None
    from moeplan.planner.pipeline.cost import default_cost_options

    hardware = default_cost_options(facts.get("cost_options"))["hardware"]
    body = plan_rank_caches(loaded.ir, facts["trace"], facts["placement"].hosts(), _offload_request(o, hardware),
                            kv_bytes_per_token(config, loaded.ir), eviction=o.get("eviction"),
                            prefetch=o.get("prefetch"), ranks_per_node=facts["placement"].topology.gpus_per_node)
    return {"expert_cache": body}


def recorded_options(o: dict) -> dict:
    """The offload options as plan.json's inputs record them: `prefetch` only when it prefetches
    (so that --prefetch none plans byte for byte as before the flag existed)."""
    return {k: v for k, v in o.items() if not (k == "prefetch" and v in (None, "none"))}


def runtime_policy_files() -> dict:
    """The simulator's policy, prefetch and stepper modules, shipped as the bundle runtime's (one
    implementation: the runtime runs the very code the simulator ran). They import numpy and each
    other only; `from moeplan.<shipped module> import` lines become `from .offload_<name> import`."""
    import importlib.util
    import re
    from pathlib import Path

    shipped = {module: "." + Path(dest).stem for dest, module in RUNTIME_POLICY_FILES.items()}

    def local_import(m):
        if m.group(1) not in shipped:
            raise ValueError(f"a shipped offload module imports {m.group(1)}, which bundles do not ship")
        return f"from {shipped[m.group(1)]} import"

    return {dest: re.sub(r"^from (moeplan[\w.]*) import", local_import,
                         Path(importlib.util.find_spec(module).origin).read_text(), flags=re.MULTILINE)
            for dest, module in RUNTIME_POLICY_FILES.items()}


EXPERT_CACHE = Pass("expert_cache", ("model", "trace", "placement", "offload_options", "cost_options"), ("expert_cache",),
                    _expert_cache)


def cache_beside_simulation(root, plan: dict, out_dir, summary: dict) -> dict:
    """`moeplan run` on a bundle with expert caches: the measured counters beside the simulator's
    replay of the requests each rank logged (passes/optimize/offload/replay.py: same policy,
    prefetcher, timing, capacity and residents; its loads split into disk reads and host-tier copies
    by the plan's host tier), whether those requests are the ones the run's routing implies
    (routing.pt; exact order on one rank), and the measured wall seconds per token beside the
    modelled ones (reported, not checked: the plan models its hardware profile)."""
    import json

    import torch

    from moeplan.passes.optimize.offload.ranks import rank_keys
    from moeplan.passes.optimize.offload.replay import matches, replay_rank_logs
    from moeplan.passes.optimize.offload.stream import stream_from_log
    from moeplan.passes.optimize.placement.decision import placement_from_dict

    spec = plan["communication"]["expert_cache"]
    data = torch.load(Path(out_dir) / "expert_cache.pt", weights_only=True)
    masks = rank_keys(placement_from_dict(json.loads((Path(root) / "placement.json").read_text())).hosts())
    streams = [stream_from_log(log) for log in data["logs"]]
    simulated = replay_rank_logs(spec, streams, masks)
    measured = summary["expert_cache"]
    forwards = simulated.pop("forwards")
    modelled = simulated.pop("modelled_seconds_by_rank")
    seconds = {"measured_wall": summary["elapsed_s"] / forwards if forwards else 0.0,
               "modelled_for_these_tokens": max(modelled) / forwards if forwards and spec.get("prefetch", "none") != "none" else None,
               "planned": plan["predicted"].get("expert_cache", {}).get("seconds_per_token"), "forwards": forwards}
    return {"expert_cache": {"eviction": spec["eviction"], "prefetch": spec.get("prefetch", "none"), "capacity": spec["capacity"],
                             "measured": measured, "simulated": simulated, "matches_simulation": matches(measured, simulated),
                             "seconds_per_token": seconds,
                             "requests_match_routing": _requests_match_routing(out_dir, summary, streams)}}


def _requests_match_routing(out_dir, summary: dict, streams: list) -> bool:
    """One rank: the logged stream is exactly the batched engine's stream of routing.pt (order
    included). More ranks: per (forward, layer), the union of the ranks' requested experts is the
    set the routing implies."""
    import numpy as np
    import torch

    from moeplan.passes.optimize.offload.stream import batched_stream

    routing = torch.load(Path(out_dir) / "routing.pt", weights_only=True)
    keys, experts, max_len = routing["keys"].numpy(), routing["experts"].numpy(), int(routing["max_len"])
    seq, pos = keys // max_len, keys % max_len
    prompt_len = np.array([len(p) for p in summary["prompt_ids"]])[seq]
    forward = np.where(pos < prompt_len, 0, pos - prompt_len + 1)
    order = np.lexsort((keys, forward))
    expected = batched_stream(experts[order], forward[order], streams[0].num_experts)
    if len(streams) == 1:
        got = streams[0]
        return all(np.array_equal(getattr(got, f), getattr(expected, f))
                   for f in ("keys", "step_start", "step_layer", "step_token"))

    def pairs(s):
        return {(int(s.step_token[st]), int(k)) for st, k in zip(s.step, s.keys)}

    return set().union(*(pairs(s) for s in streams)) == pairs(expected)


def with_numpy(requirements: str) -> str:
    """A bundle's requirements.txt plus the numpy its expert cache and policies import (pinned)."""
    import numpy

    if any(line.split("==")[0] == "numpy" for line in requirements.splitlines()):
        return requirements
    return requirements + f"numpy=={numpy.__version__}\n"
