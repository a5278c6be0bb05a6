"""The offload planner: expert cache size, initial residents, eviction and prefetch policies,
host/disk tiers, and the predicted hit ratio and seconds per token (issue 13).

Memory (one GPU, `gpu_memory_bytes`): dense weights (everything but routed experts: attention,
norms, embeddings, head, routers, shared experts) + KV cache (batch x max_length tokens) +
activations (batch x prefill chunk x the widest stage's per-token activation x `ACT_BUFFERS`
working copies) + a fixed reserve (CUDA context, allocator slack). What is left holds
floor(left / expert_bytes) (layer, expert) entries. `expert_cache` N overrides the budget.

Decisions, all by simulation of the held-out part of the planning trace (its last
`validation_fraction` of sequences; the rest fits the models):
* the moeplan policy's frequency weight (runtime/offload/next_use.py);
* residents at start: the cache's worth of most popular (layer, expert) keys;
* eviction: the online policy with the best held-out hit ratio (ties: moeplan first);
* prefetch: none, MoE-Infinity's EAMC, ours, or (traces recorded with --speculate) the
  speculative one, each with and without host compute on a miss (where the profile has the host's
  rates), by the lowest simulated seconds per token;
* tiers: host DRAM holds the most popular experts that fit in --host-memory (default: the
  profile's host memory less a reserve), disk the rest.

Timing (decode, memory-bound): a layer step reads its dense share and its experts at the GPU's
memory bandwidth x efficiency, plus a per-layer overhead; an expert copy takes a fixed latency
plus bytes over PCIe (and over NVMe first for disk-tier experts).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moeplan.passes.analysis.activation import build_eamc, popularity_by_layer, sequence_ids, stream_order
from moeplan.passes.optimize.offload.evaluate import (PAIRED_EVICTION, gap_to_belady, parse_variant, run_demand,
                                                     run_variants, speculation_settings, variant_order)
from moeplan.runtime.offload.next_use import fit_next_use
from moeplan.runtime.offload.policies import make_policy
from moeplan.passes.optimize.offload.simulator import Timing, simulate_demand
from moeplan.passes.optimize.offload.stream import build_stream
from moeplan.core.errors import UserError
from moeplan.core.hardware import OFFLOAD_FIGURES, HardwareProfile

ACT_BUFFERS = 8
GIB = 1 << 30
ONLINE_POLICIES = ("moeplan", "lru", "lfu", "lifo", "moe-infinity")  # order = tie preference


@dataclass(frozen=True)
class OffloadRequest:
    hardware: HardwareProfile  # core/hardware.py: the plan's one profile
    gpu_memory_bytes: int | None = None
    expert_cache: int | None = None
    batch: int = 1
    max_length: int = 4096
    prefill_chunk: int = 512
    reserve_bytes: int = GIB
    host_reserve_bytes: int = 8 * GIB
    host_memory_bytes: int | None = None  # the host tier; None: the profile's host memory less host_reserve_bytes
    prompt_tokens: int = 0
    host_compute: str | None = None  # "cheaper" | "never" | None: by predicted time (where the profile can)
    validation_fraction: float = 0.2
    seed: int = 0
    max_sim_requests: int = 50_000


def kv_bytes_per_token(config, ir) -> int:
    """KV-cache bytes one token adds over all attention layers (MLA: the compressed latent)."""
    from moeplan.core.ir import dtype_bytes

    b = dtype_bytes(ir.dtype)
    layers = sum(1 for s in ir.stages if getattr(s, "kind", "") == "attention") or len(ir.moe_stages)
    get = (lambda name, default=None: getattr(config, name, default)) if config is not None else (lambda n, d=None: d)
    if get("kv_lora_rank"):
        per = get("kv_lora_rank") + (get("qk_rope_head_dim") or 0)
    elif get("num_key_value_heads") or get("num_attention_heads") or get("num_heads"):
        heads = get("num_attention_heads") or get("num_heads")
        kv = get("num_key_value_heads") or heads
        head_dim = get("head_dim") or ir.hidden_size // heads
        per = 2 * kv * head_dim
    else:
        per = 2 * ir.hidden_size
    return int(layers * per * b)


def memory_budget(ir, kv_per_token: int, req: OffloadRequest, prefill_tokens: int | None = None) -> dict:
    """Bytes of each GPU memory use and the expert cache capacity in (layer, expert) entries, at
    the precision the runtime holds the model on the plan's hardware (`runtime/precision.py:
    model_weight_bytes`, as serving capacity counts it); `kv_per_token` as `kv_bytes_per_token` gives it.
    `prefill_tokens`: the most tokens one step prefills (the torchrun service's bound, which serving
    capacity reserves activations for), else batch x prefill chunk."""
    from moeplan.core.ir import dtype_bytes
    from moeplan.runtime.precision import ITEMSIZE, model_weight_bytes

    held = model_weight_bytes(ir, on_gpu=not req.hardware.device_is_host, precision=req.hardware.precision,
                              expert_cache=True)
    per_element = ITEMSIZE[held["dtypes"]["dense"]] / dtype_bytes(ir.dtype)  # KV and activations at the dense dtype
    moe = ir.moe_stages
    expert_bytes = held["expert"]
    total_keys = sum(s.num_experts for s in moe)
    dense = held["dense"]
    kv = int(req.batch * req.max_length * round(kv_per_token * per_element))
    widest = max(s.activation_bytes_per_token for s in ir.stages) * per_element
    tokens = prefill_tokens if prefill_tokens is not None else req.batch * min(req.prefill_chunk, req.max_length)
    act = int(tokens * widest * ACT_BUFFERS)
    out = {"dense_bytes": dense, "kv_cache_bytes": kv, "activation_bytes": act, "reserve_bytes": int(req.reserve_bytes),
           "expert_bytes": expert_bytes, "total_experts": total_keys}
    if req.expert_cache is not None:
        if req.expert_cache < 1:
            raise UserError(f"--expert-cache must be at least 1 entry, got {req.expert_cache}")
        out["capacity"] = min(int(req.expert_cache), total_keys)
        out["gpu_memory_bytes"] = dense + kv + act + int(req.reserve_bytes) + out["capacity"] * expert_bytes
        return out
    if req.gpu_memory_bytes is None:
        req.hardware.require(("device_memory_bytes",), "sizing the expert cache without --gpu-memory")
    gpu = int(req.gpu_memory_bytes if req.gpu_memory_bytes is not None else req.hardware.device_memory_bytes)
    left = gpu - dense - kv - act - int(req.reserve_bytes)
    if left < expert_bytes:
        need = dense + kv + act + req.reserve_bytes + expert_bytes
        raise UserError(
            f"--gpu-memory {gpu} bytes ({gpu / GIB:.1f} GiB) cannot hold the dense weights ({dense / GIB:.2f} GiB), KV cache "
            f"({kv / GIB:.2f} GiB), activations ({act / GIB:.2f} GiB), reserve ({req.reserve_bytes / GIB:.2f} GiB) and one expert; "
            f"give at least {need} bytes, or lower --max-length / --batch")
    out["capacity"] = min(left // expert_bytes, total_keys)
    out["gpu_memory_bytes"] = gpu
    return out


def host_tier_bytes(req: OffloadRequest) -> int:
    """Host memory for experts (one machine): --host-memory, else the profile's less the host reserve."""
    if req.host_memory_bytes is not None:
        return max(0, int(req.host_memory_bytes))
    req.hardware.require(("host_memory_bytes",), "the host tier without --host-memory")
    return max(0, int(req.hardware.host_memory_bytes - req.host_reserve_bytes))


def timing_for(ir, hw: HardwareProfile, host_keys=None, host_compute: bool = False) -> Timing:
    """Per-step compute and per-expert copy times of `ir` on `hw` (decode, memory-bound); with
    `host_compute` (and a profile that has the host's rates) also the host's time for a missed
    expert: its weights read at the host's memory rate, 2 x its parameters FLOPs per row."""
    from moeplan.core.ir import dtype_bytes

    hw.require(OFFLOAD_FIGURES, "the expert cache's timing")
    moe = ir.moe_stages
    expert_bytes = int(moe[0].expert_param_bytes)
    routed = sum(s.num_experts * s.expert_param_bytes for s in moe)
    embedding = sum(s.param_bytes for s in ir.stages if getattr(s, "kind", "") == "embedding")
    dense_read = max(ir.total_param_bytes - routed - embedding, 0) / len(moe)
    bw = hw.memory_bytes_per_s * hw.memory_efficiency
    host = {}
    if host_compute and hw.host_compute:
        params = expert_bytes / dtype_bytes(ir.dtype)
        host = {"host_expert_s": expert_bytes / hw.host_memory_bytes_per_s, "host_row_s": 2.0 * params / hw.host_flops_per_s,
                "host_overhead_s": hw.host_overhead_s or 0.0}
    return Timing(layer_s=hw.layer_overhead_s + dense_read / bw, expert_compute_s=expert_bytes / bw,
                  pcie_copy_s=hw.copy_latency_s + expert_bytes / hw.host_to_device_bytes_per_s,
                  nvme_copy_s=expert_bytes / hw.disk_read_bytes_per_s, expert_bytes=expert_bytes,
                  host_keys=None if host_keys is None else frozenset(int(k) for k in host_keys), **host)


HOST_COMPUTE_RULES = ("never", "cheaper")


# blocks whose experts the runtime cannot run one at a time on the host (runtime/offload/host_compute.py)
NO_HOST_COMPUTE = ("Llama4", "JetMoe")


def host_compute_options(req: OffloadRequest, architecture: str = "") -> tuple:
    """The host compute settings the planner compares: (False,), (True,) or both (auto)."""
    able = req.hardware.host_compute and not architecture.startswith(NO_HOST_COMPUTE)
    if req.host_compute == "cheaper" and not able:
        raise UserError(f"--host-compute cheaper needs the host's memory and matmul rates (hardware profile "
                        f"'{req.hardware.name}': host_memory_bytes_per_s, host_flops_per_s) and experts the runtime can run "
                        f"one at a time ({architecture or 'this model'}: {'no' if architecture.startswith(NO_HOST_COMPUTE) else 'yes'}); "
                        "use --host-compute never")
    if req.host_compute is not None:
        return (req.host_compute == "cheaper",)
    return (False, True) if able else (False,)


def host_compute_record(host: bool) -> dict:
    """The plan's rule for a missed expert ({} when it is always copied: plans as before the rule existed)."""
    return {"host_compute": "cheaper"} if host else {}


def hardware_record(hw: HardwareProfile) -> dict:
    """The figures the offload plan used, under the keys plan.json's offload section (offload_version 1)
    has always had (gpu_memory_bandwidth is the profile's memory_bytes_per_s, pcie_bandwidth its
    host_to_device_bytes_per_s, nvme_bandwidth its disk_read_bytes_per_s); the host's rates only
    where the profile knows them."""
    return {"name": hw.name, "gpu_memory_bytes": hw.device_memory_bytes, "gpu_memory_bandwidth": hw.memory_bytes_per_s,
            "host_memory_bytes": hw.host_memory_bytes, "pcie_bandwidth": hw.host_to_device_bytes_per_s,
            "nvme_bandwidth": hw.disk_read_bytes_per_s, "memory_efficiency": hw.memory_efficiency,
            "layer_overhead_s": hw.layer_overhead_s, "copy_latency_s": hw.copy_latency_s,
            **({"host_memory_bytes_per_s": hw.host_memory_bytes_per_s, "host_flops_per_s": hw.host_flops_per_s,
                "host_overhead_s": hw.host_overhead_s or 0.0} if hw.host_compute else {})}


def split_by_sequence(trace, validation_fraction: float):
    """(fit rows, validation rows): the last `validation_fraction` of sequences in serving order."""
    order = stream_order(trace)
    seq = sequence_ids(trace)[order]
    starts = np.r_[0, np.flatnonzero(np.diff(seq)) + 1]
    n_val = max(1, int(round(len(starts) * validation_fraction))) if len(starts) > 1 else 0
    if n_val == 0:  # one sequence: split its tokens
        cut = int(len(order) * (1 - validation_fraction))
        return np.sort(order[:cut]), np.sort(order[cut:])
    cut = starts[len(starts) - n_val]
    return np.sort(order[:cut]), np.sort(order[cut:])


def popular_keys(popularity: np.ndarray, count: int) -> list:
    """The `count` most popular keys, least popular first (so the most popular is the most recent)."""
    flat = popularity.reshape(-1)
    order = np.lexsort((np.arange(len(flat)), -flat))[:count]
    return [int(k) for k in order[::-1]]


def capped(stream, max_requests: int):
    """The stream's first tokens holding at most `max_requests` requests (whole tokens)."""
    if stream.num_requests <= max_requests:
        return stream
    from moeplan.passes.optimize.offload.stream import truncate

    return truncate(stream, max_requests)


MIXES = (0.0, 0.25, 0.5, 0.75)  # 1.0 would drop the learned model for a (Bayesian) LFU


def tune_mix(model, stream, capacity: int, resident, expert_bytes: int = 0, results: dict | None = None) -> tuple:
    """The moeplan policy's frequency weight with the best demand hit ratio on `stream` (ties: the
    smaller weight), and every weight's hit ratio. With `results` (a dict), the chosen weight's
    simulation is stored there as results["moeplan"] (Result.to_dict()), so it is not run again."""
    runs = {w: simulate_demand(stream, capacity, make_policy("moeplan", model.with_mix(w)), resident=resident,
                               expert_bytes=expert_bytes) for w in MIXES}
    hits = {w: r.hit_ratio for w, r in runs.items()}
    best = max(MIXES, key=lambda w: (hits[w], -w))
    if results is not None:
        results["moeplan"] = runs[best].to_dict()
    return model.with_mix(best), hits


def plan_offload(ir, trace, req: OffloadRequest, kv_per_token: int, say=lambda m: None) -> dict:
    """The offload decisions and predictions (the plan's placement/communication/predicted parts)."""
    budget = memory_budget(ir, kv_per_token, req)
    capacity = int(budget["capacity"])
    fit_rows, val_rows = split_by_sequence(trace, req.validation_fraction)
    fit, val = trace.select(fit_rows), trace.select(val_rows)
    popularity = popularity_by_layer(fit)
    say(f"expert cache: {capacity} of {budget['total_experts']} (layer, expert) entries")
    model = fit_next_use(build_stream(fit), popularity)
    eamc = build_eamc(fit, val, seed=req.seed)
    say(f"EAMC: {eamc.capacity} entries (held-out recall {eamc.recall_by_capacity.get(eamc.capacity, 0):.3f})")
    resident = popular_keys(popularity, capacity)
    host_capacity = max(0, int(host_tier_bytes(req) // budget["expert_bytes"]))
    total = budget["total_experts"]
    host_keys = None if host_capacity >= total else popular_keys(popularity, host_capacity)
    timings = {host: Timing.from_dict(timing_for(ir, req.hardware, host_keys, host).to_dict(), host_keys)  # as the plan stores it
               for host in host_compute_options(req, ir.architecture)}
    stream = capped(build_stream(val, req.prompt_tokens), req.max_sim_requests)
    tuned = {}
    model, mix_hits = tune_mix(model, stream, capacity, resident, budget["expert_bytes"], tuned)
    say("moeplan policy mix (frequency weight): " + ", ".join(f"{w:g} -> {h:.4f}" for w, h in mix_hits.items()))
    demand = run_demand(stream, capacity, resident, model, expert_bytes=budget["expert_bytes"], known=tuned)
    eviction = max(ONLINE_POLICIES, key=lambda p: (demand[p]["hit_ratio"], -ONLINE_POLICIES.index(p)))
    speculation = speculation_settings(fit)
    prefetch = run_variants(stream, capacity, resident, model, eamc.eamc, timings, speculation)
    best = min(prefetch, key=lambda m: (prefetch[m]["seconds_per_token"], variant_order(m)))
    best_prefetch, host = parse_variant(best)
    if best_prefetch != "none":
        eviction = PAIRED_EVICTION[best_prefetch]
    chosen = prefetch[best]
    timing = timings[host]
    say(f"eviction {eviction}, prefetch {best_prefetch}, host compute {'cheaper' if host else 'never'}: hit ratio "
        f"{demand[eviction]['hit_ratio']:.3f}, {chosen['seconds_per_token'] * 1e3:.3f} ms/token")
    tokens = max(stream.num_tokens, 1)
    return {
        "placement": {"version": 1, "policy": "offload", "resident": [[k // ir.moe_stages[0].num_experts,
                                                                       k % ir.moe_stages[0].num_experts] for k in resident]},
        "communication": {
            "offload_version": 1, "expert_cache": capacity, "eviction": eviction, "prefetch": best_prefetch,
            **host_compute_record(host), **({"speculation": dict(speculation, depth=chosen["depth"])}
                                            if best_prefetch == "speculative" else {}),
            "memory": budget,
            "tiers": {"gpu_experts": capacity, "host_experts": min(host_capacity, total),
                      "disk_experts": max(total - host_capacity, 0),
                      "host_bytes": min(host_capacity, total) * budget["expert_bytes"],
                      "disk_bytes": max(total - host_capacity, 0) * budget["expert_bytes"]},
            "timing": timing.to_dict(),
            "host_resident": None if host_keys is None else sorted(host_keys),
            "hardware": hardware_record(req.hardware),
            "policy_model": model.to_dict(),
            "eamc": eamc.eamc.tolist(),
        },
        "predicted": {
            "hit_ratio": demand[eviction]["hit_ratio"],
            "seconds_per_token": chosen["seconds_per_token"],
            "resident_at_layer_start": chosen["resident_at_layer_start"],
            "bytes_moved_per_token": chosen["bytes_moved"] / tokens,
            "belady_gap_points": gap_to_belady(demand),
            "validation_tokens": stream.num_tokens,
            "policies": demand, "prefetch": prefetch,
        },
        "inputs_extra": {**({"speculation": speculation} if speculation is not None else {}), "eamc_capacity": eamc.capacity, "moeplan_mix_hit_ratio": {str(w): h for w, h in mix_hits.items()},
                         "eamc_recall_by_capacity": {str(k): v for k, v in sorted(eamc.recall_by_capacity.items())}},
    }
