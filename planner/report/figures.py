"""A plan's decisions and predicted figures as flat {name: value} maps: what `moeplan diff` compares.

Figures are every number under `predicted` by dotted path (lists of numbers, e.g. per-layer
affinity, by index; large tables such as cap searches are left out), plus headline aliases that
mean the same thing for every target, so one `--fail-on` works across targets:
`seconds_per_token`, `bytes_per_token`, `cost`, `latency`, `throughput`, `hit_ratio`,
`max_over_mean_load`, `gpu_local_fraction`, `node_local_fraction`; the engine targets' serving
prediction adds `tpot`, `ttft`, `memory_per_gpu` (and `throughput`: output tokens per second).
`alias_paths` names the path each alias reads, so that `moeplan diff` lists a figure once.
"""
from __future__ import annotations

import hashlib
import json

from moeplan.planner.report.summary import at, hardware_name

ALIASES = ("seconds_per_token", "bytes_per_token", "cost", "latency", "throughput", "hit_ratio", "max_over_mean_load",
           "gpu_local_fraction", "node_local_fraction", "tpot", "ttft", "memory_per_gpu")
# left out: large tables, and a lambda plan's `request_cost`, the request cost model's inputs (per-part
# seconds on a token grid, shares, platform prices), not figures ('moeplan simulate --new-tokens' prices it);
# an engine plan's serving `op_prices` (its per-op table; `price_sources` sums it) and `layout` (a decision)
SKIP = ("cap_search", "prices", "profile", "solves", "bo_history", "context", "dense_partition", "request_cost",
        "op_prices", "layout")
MAX_LIST = 64


def _numbers(node, prefix: str, out: dict) -> None:
    if isinstance(node, bool) or node is None:
        return
    if isinstance(node, (int, float)):
        out[prefix] = node
    elif isinstance(node, dict):
        for key in sorted(node):
            if key not in SKIP:
                _numbers(node[key], f"{prefix}.{key}" if prefix else str(key), out)
    elif isinstance(node, list) and len(node) <= MAX_LIST:
        name = next((k for k in ("label", "source") if all(isinstance(v, dict) and k in v for v in node)), None)
        if node and name:  # candidates by label, price sources by source: not by position
            for v in node:
                _numbers({k: x for k, x in v.items() if k not in ("modes",)}, f"{prefix}[{v[name]}]", out)
        else:
            for i, v in enumerate(node):
                _numbers(v, f"{prefix}.{i}", out)


def alias_paths(plan: dict) -> dict:
    """{alias: the plan.json path it reads} for the aliases this plan has (one meaning across targets)."""
    out = {}
    target = plan.get("target")
    cost = at(plan, "predicted.cost")
    if isinstance(cost, dict) and cost.get("mode") in cost.get("modes", {}):
        base = f"predicted.cost.modes.{cost['mode']}"
        out.update(seconds_per_token=f"{base}.seconds_per_token", bytes_per_token=f"{base}.total_bytes_per_token")
    if target == "offload":
        out.update(seconds_per_token="predicted.seconds_per_token", hit_ratio="predicted.hit_ratio",
                   bytes_per_token="predicted.bytes_moved_per_token")
    if target == "lambda":
        # a lambda plan's cost and latency: of the API call it prices (predicted.api_call), not of the sized batch
        out.update(cost="predicted.api_call.usd.total", latency="predicted.api_call.latency_s",
                   throughput="predicted.throughput_tokens_per_s")
    if isinstance(at(plan, "predicted.serving"), dict):
        out.update(tpot="predicted.serving.tpot_s", ttft="predicted.serving.ttft_s",
                   throughput="predicted.serving.output_tokens_per_s",
                   memory_per_gpu="predicted.serving.memory_per_gpu_bytes")
    if isinstance(at(plan, "predicted.expert_cache"), dict):
        out["hit_ratio"] = "predicted.expert_cache.hit_ratio"
    for key in ("max_over_mean_load", "gpu_local_fraction", "node_local_fraction"):
        out[key] = f"predicted.{key}"
    return {k: p for k, p in out.items() if isinstance(at(plan, p), (int, float)) and not isinstance(at(plan, p), bool)}


def headline(plan: dict) -> dict:
    """The aliases: one meaning across targets (absent where a target has no such figure)."""
    return {k: at(plan, p) for k, p in alias_paths(plan).items()}


def basis(plan: dict) -> str:
    """What the plan's figures are for, in a few words: 'workload 8x32+8 on cpu-gloo, planning trace
    (4,000 tokens)'; each part only where the plan records it (a target without a workload has none)."""
    parts = []
    workload = at(plan, "predicted.cost.workload") or at(plan, "predicted.serving.workload")
    if workload:
        parts.append(f"workload {workload}")
    hw = hardware_name(plan) or at(plan, "predicted.serving.hardware") or at(plan, "topology.hardware")
    if hw:
        parts.append(f"on {hw}")
    tokens = at(plan, "inputs.trace_tokens")
    parts.append("planning trace" + (f" ({tokens:,} tokens)" if isinstance(tokens, int) else ""))
    return " ".join(parts[:-1]) + (", " if len(parts) > 1 else "") + parts[-1]


def figures(plan: dict) -> dict:
    """{name: number}: the aliases, then every number under `predicted` by path."""
    out = headline(plan)
    _numbers(plan.get("predicted", {}), "predicted", out)
    return out


def _digest(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:12]


def decisions(plan: dict) -> dict:
    """{name: text}: what the planner decided (and what it was given), comparable as strings."""
    out = {"target": plan.get("target"), "model": at(plan, "model.name"), "weights_sha256": at(plan, "model.weights_sha256"),
           "trace_sha256": at(plan, "inputs.trace_sha256"),
           "topology": f"{at(plan, 'topology.nodes')}x{at(plan, 'topology.gpus_per_node')}",
           "placement.policy": at(plan, "placement.policy"), "communication.mode": at(plan, "communication.mode"),
           "hardware": hardware_name(plan) or at(plan, "topology.hardware"),
           "workload": at(plan, "predicted.cost.workload")}
    chosen = [a.get("label") for a in at(plan, "predicted.cost.alternatives") or [] if a.get("chosen")]
    if chosen:
        out["candidate"] = chosen[0]
    layers = at(plan, "placement.layers")
    if isinstance(layers, list) and layers and isinstance(layers[0], dict) and "devices" in layers[0]:
        out["placement.layout"] = _digest(layers)
        for layer in layers:
            out[f"placement.layer.{layer.get('layer')}"] = _digest(layer.get("devices"))
    if plan.get("target") == "offload":
        for k in ("expert_cache", "eviction", "prefetch"):
            out[f"communication.{k}"] = at(plan, f"communication.{k}")
        out["placement.resident"] = _digest(at(plan, "placement.resident"))
        tiers = at(plan, "communication.tiers") or {}
        out["tiers"] = f"gpu {tiers.get('gpu_experts')}, host {tiers.get('host_experts')}, disk {tiers.get('disk_experts')}"
    if plan.get("target") == "lambda":
        out["communication.methods"] = ",".join(at(plan, "communication.methods") or [])
        out["functions"] = at(plan, "topology.functions")
        for i, layer in enumerate(layers or []):
            if isinstance(layer, dict) and "experts" in layer:
                out[f"placement.layer.{i}"] = _digest(layer)
        out["dense_slices"] = _digest(at(plan, "placement.dense_slices"))
    cache = at(plan, "communication.expert_cache")
    if isinstance(cache, dict):
        out["expert_cache"] = f"{cache.get('capacity')} entries, {cache.get('eviction')}, prefetch {cache.get('prefetch')}"
    if plan.get("target") in ("sglang", "vllm", "trtllm"):
        out["redundant"] = at(plan, "communication.redundant")
        for key in ("attention_tp", "attention_dp", "moe_ep", "max_running_requests", "moe_a2a"):
            out[f"deployment.{key}"] = at(plan, f"deployment.{key}")
        eplb = at(plan, "deployment.eplb")
        if isinstance(eplb, dict):
            out["deployment.eplb"] = ", ".join(f"{k}={v}" for k, v in sorted(eplb.items()))
    serving = at(plan, "predicted.serving")
    if isinstance(serving, dict):
        layout = serving.get("layout") or {}
        out["hardware"] = serving.get("hardware")
        out["workload"] = serving.get("workload")
        out["serving.layout"] = (f"{layout.get('gpus')} GPUs, attention tp{layout.get('attention_tp')} x "
                                 f"dp{layout.get('attention_dp')}, moe ep{layout.get('moe_ep')} x tp{layout.get('moe_tp')}, "
                                 f"redundant {layout.get('redundant_experts')}, max running "
                                 f"{layout.get('max_running_requests')}, {layout.get('moe_a2a')}")
        out["serving.fits"] = serving.get("fits")
    return {k: ("" if v is None else str(v)) for k, v in out.items() if v is not None}
