"""The offload target (one GPU whose experts do not all fit): import -> trace -> offload plan; and
the expert caches of torchrun bundles (compile --gpu-memory / --expert-cache).

A plan-only target for now: the decisions (cache capacity, residents, eviction, prefetch, tiers)
are `passes/optimize/offload/cache_plan.py`; no bundle codegen yet. Facts read from the command:
`offload_options` (gpu_memory_bytes | expert_cache, hardware, batch, max_length, prompt_tokens,
validation_fraction, seed) and `progress` (a callable for progress lines). `offload_options`
turns the flags (planner/pipeline/flags.py) into those options, for this target and for torchrun's.
"""
from __future__ import annotations

import re
from pathlib import Path

from moeplan.core.errors import UserError
from moeplan.core.pass_manager import Pass
from moeplan.planner.pipeline.common import IMPORT, TRACE, plan_reads_back, trace_matches_model
from moeplan.core.plan import Plan


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
PASSES = [IMPORT, TRACE, PLAN]

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def parse_bytes(text: str, option: str = "--gpu-memory") -> int:
    """'25769803776', '24GiB', '24GB' (10^9), '16g' -> bytes; UserError otherwise."""
    m = _SIZE.match(str(text))
    if not m:
        raise UserError(f"{option} {text!r} is not a size; give bytes (25769803776) or a unit (24GiB, 24GB)")
    unit = (m.group(2) or "").lower().rstrip("b")
    return int(float(m.group(1)) * _UNITS[unit])


def offload_options(values: dict, target: str = "offload"):
    """The pipeline's `offload_options` from the flags' values; None for torchrun/kubernetes without
    --gpu-memory/--expert-cache (no expert cache). Bad values are UserErrors."""
    gpu_memory, expert_cache, prefetch = values["gpu_memory"], values["expert_cache"], values["prefetch"]
    host_compute = None if values.get("host_compute") in (None, "auto") else values["host_compute"]
    if target != "offload" and gpu_memory is None and expert_cache is None:
        for flag, name in (("eviction", "--eviction"), ("host_memory", "--host-memory"), ("prefetch", "--prefetch")):
            if values[flag] is not None:
                raise UserError(f"{name} needs --gpu-memory BYTES or --expert-cache N (an expert cache to serve)")
        if host_compute is not None:
            raise UserError("--host-compute needs --gpu-memory BYTES or --expert-cache N (an expert cache to serve)")
        return None
    if prefetch is not None:  # a pair that cannot run stops here, before any pass (the trace's speculation comes later)
        from moeplan.passes.optimize.offload.ranks import prefetch_candidates

        prefetch_candidates(values["eviction"], prefetch, trace_known=False)
    if (gpu_memory is None) == (expert_cache is None):
        raise UserError(f"--target {target} needs exactly one of --gpu-memory BYTES or --expert-cache N")
    for name, value in (("--batch", values["batch"]), ("--max-length", values["max_length"])):
        if value < 1:
            raise UserError(f"{name} must be at least 1, got {value}")
    if values["prompt_tokens"] < 0:
        raise UserError(f"--prompt-tokens must be 0 or more, got {values['prompt_tokens']}")
    if not 0 < values["validation_fraction"] < 1:
        raise UserError(f"--validation-fraction must be between 0 and 1, got {values['validation_fraction']}")
    options = {"gpu_memory_bytes": parse_bytes(gpu_memory) if gpu_memory is not None else None,
               "expert_cache": expert_cache, "hardware": values["hardware"] if target == "offload" else None,
               "batch": values["batch"],
               "host_memory_bytes": parse_bytes(values["host_memory"], "--host-memory") if values["host_memory"] is not None else None,
               "max_length": values["max_length"], "prompt_tokens": values["prompt_tokens"],
               "validation_fraction": values["validation_fraction"], "seed": values["seed"]}
    if target != "offload":  # the bundle's policy and prefetcher; --target offload compares them all
        options.update(eviction=values["eviction"], prefetch=prefetch)
    if host_compute is not None:  # auto (the default) is recorded by leaving it out: plans keep their bytes
        options["host_compute"] = host_compute
    return options


def inputs(model: str, trace: str, out, values: dict) -> dict:
    """The facts `moeplan plan --target offload` starts from (an unknown --hardware stops here, before any pass)."""
    from moeplan.core.hardware import DEFAULT_OFFLOAD_HARDWARE, load_profile

    load_profile(values["hardware"], DEFAULT_OFFLOAD_HARDWARE)
    return {"model_spec": str(model), "trace_path": str(trace), "offload_options": offload_options(values)}


def summary(facts: dict) -> dict:
    """The --json summary's fields of an offload plan."""
    the_plan = facts["plan"]
    p, c = the_plan.predicted, the_plan.communication
    return {"expert_cache": c["expert_cache"], "total_experts": c["memory"]["total_experts"], "eviction": c["eviction"],
            "prefetch": c["prefetch"], "hit_ratio": p["hit_ratio"], "seconds_per_token": p["seconds_per_token"],
            "belady_gap_points": p["belady_gap_points"]}


def describe(summary: dict, facts: dict) -> str:
    """What an offload plan holds."""
    the_plan = facts["plan"]
    p, c = the_plan.predicted, the_plan.communication
    m = c["memory"]
    return "\n".join([
        f"expert cache {c['expert_cache']} of {m['total_experts']} experts "
        f"({m['expert_bytes'] / 2**20:.1f} MiB each), eviction {c['eviction']}, prefetch {c['prefetch']}",
        f"GPU memory: dense {m['dense_bytes'] / 2**30:.2f} GiB, KV {m['kv_cache_bytes'] / 2**30:.2f} GiB, "
        f"activations {m['activation_bytes'] / 2**30:.2f} GiB, reserve {m['reserve_bytes'] / 2**30:.2f} GiB; "
        f"tiers: host {c['tiers']['host_experts']} experts, disk {c['tiers']['disk_experts']}",
        f"predicted on held-out sequences: hit ratio {p['hit_ratio']:.3f} (Belady {p['policies']['belady']['hit_ratio']:.3f}), "
        f"{p['seconds_per_token'] * 1e3:.3f} ms/token, {p['resident_at_layer_start']:.3f} resident at layer start",
        f"planning took {summary['seconds']:.1f} s"])


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
    from moeplan.passes.optimize.offload.ranks import plan_rank_caches

    require_routing(facts["trace"], "an expert cache (per-token expert requests)")
    loaded = facts["model"]
    config = getattr(loaded.module, "config", None) if loaded.module is not None else None
    hardware = facts["cost_options"]["hardware"]  # the plan's one profile (default_cost_options filled it in)
    body = plan_rank_caches(loaded.ir, facts["trace"], facts["placement"].hosts(), _offload_request(o, hardware),
                            kv_bytes_per_token(config, loaded.ir), eviction=o.get("eviction"),
                            prefetch=o.get("prefetch"), ranks_per_node=facts["placement"].topology.gpus_per_node)
    return {"expert_cache": body}


def recorded_options(o: dict) -> dict:
    """The offload options as plan.json's inputs record them: `prefetch` only when it prefetches
    (so that --prefetch none plans byte for byte as before the flag existed)."""
    return {k: v for k, v in o.items() if not (k == "prefetch" and v in (None, "none"))}


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
    from moeplan.passes.optimize.placement.contract import placement_from_dict

    spec = plan["communication"]["expert_cache"]
    data = torch.load(Path(out_dir) / "expert_cache.pt", weights_only=True)
    masks = rank_keys(placement_from_dict(json.loads((Path(root) / "placement.json").read_text())).hosts())
    streams = [stream_from_log(log) for log in data["logs"]]
    simulated = replay_rank_logs(spec, streams, masks)
    measured = summary["expert_cache"]
    forwards = simulated.pop("forwards")
    modelled = simulated.pop("modelled_seconds_by_rank")
    seconds = {"measured_wall": summary["elapsed_s"] / forwards if forwards else 0.0,
               "modelled_for_these_tokens": max(modelled) / forwards if forwards and "timing" in spec else None,
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
