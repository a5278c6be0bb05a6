"""Per-rank results and their merge: logits, routing of every token, counters, throughput.

Each rank writes `rank-<r>.pt`; rank 0 merges them into `result.json` (JSON summary),
`logits.pt` (keys, logits sorted by sequence and position) and `routing.pt` (expert ids and
weights [T, L, K] in the same order), which `moeplan run --verify` compares with the source model
and the planner's prediction.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from .counters import sum_counters


def write_rank(out_dir, rank: int, engine, out: dict, mode: str) -> None:
    """`rank-<r>.pt`: a recording engine's logits and routing beside `static_batch.run_batch`'s results
    `out` (its max_len is the keys' stride: key = sequence x max_len + position)."""
    keys, logits = engine.recorded_logits()
    routing = engine.recorded_routing()
    cache = getattr(engine.model, "expert_cache", None)  # offloading: counters and request log
    extra = {"expert_cache": cache.record()} if cache is not None else {}
    torch.save({"mode": mode, "logit_keys": keys, "logits": logits, "routing": routing,
                "weight_dtype": getattr(engine.model, "weight_dtype", "float32"),
                "expert_weight_dtype": getattr(engine.model, "expert_weight_dtype", None), **extra, **out},
               Path(out_dir) / f"rank-{rank}.pt")


def _summarise(counters: dict, generated_tokens: int) -> dict:
    per_layer = []
    totals = {"all_to_all_bytes": 0, "all_to_all_messages": 0, "control_bytes": 0, "control_messages": 0,
              "context_bytes": 0, "context_messages": 0}
    local = slots = 0
    for i, layer in enumerate(counters["layers"]):
        a2a_bytes = sum(layer[p]["bytes"] for p in ("dispatch", "combine", "merge"))
        a2a_msgs = sum(layer[p]["messages"] for p in ("dispatch", "combine", "merge"))
        ctrl = sum(layer[p]["control_bytes"] for p in ("dispatch", "combine", "merge", "context"))
        ctrl_msgs = sum(layer[p]["control_messages"] for p in ("dispatch", "combine", "merge", "context"))
        per_layer.append({"layer": i, "all_to_all_bytes": a2a_bytes, "all_to_all_messages": a2a_msgs,
                          "dispatch_bytes": layer["dispatch"]["bytes"], "combine_bytes": layer["combine"]["bytes"],
                          "merge_bytes": layer["merge"]["bytes"], "context_bytes": layer["context"]["bytes"],
                          "local_slots": layer["local_slots"], "slots": layer["slots"]})
        totals["all_to_all_bytes"] += a2a_bytes
        totals["all_to_all_messages"] += a2a_msgs
        totals["control_bytes"] += ctrl
        totals["control_messages"] += ctrl_msgs
        totals["context_bytes"] += layer["context"]["bytes"]
        totals["context_messages"] += layer["context"]["messages"]
        local += layer["local_slots"]
        slots += layer["slots"]
    step = counters["step"]
    sync_bytes = sum(v for k, v in step.items() if k.endswith("_bytes") and not k.endswith("control_bytes"))
    totals["sync_bytes"] = sync_bytes
    totals["total_bytes"] = (totals["all_to_all_bytes"] + totals["control_bytes"] + totals["context_bytes"]
                             + sum(v for k, v in step.items() if k.endswith("bytes")))
    g = max(generated_tokens, 1)
    return {
        "per_layer": per_layer,
        "totals": totals,
        "bytes_per_token": totals["all_to_all_bytes"] / g,
        "messages_per_token": totals["all_to_all_messages"] / g,
        "total_bytes_per_token": totals["total_bytes"] / g,
        "gpu_local_fraction": local / slots if slots else 1.0,
    }


def merge(out_dir, world: int, prompts: list, decode) -> dict:
    out_dir = Path(out_dir)
    ranks = [torch.load(out_dir / f"rank-{r}.pt", weights_only=True) for r in range(world)]
    generated = {}
    for r in ranks:
        generated.update(r["generated"])
    keys = torch.cat([r["logit_keys"] for r in ranks])
    logits = torch.cat([r["logits"] for r in ranks if r["logits"].numel()])
    order = torch.argsort(keys)
    keys, logits = keys[order], logits[order]
    torch.save({"keys": keys, "logits": logits, "max_len": ranks[0]["max_len"]}, out_dir / "logits.pt")
    layers = sorted({layer for r in ranks for layer in r["routing"]})
    experts, weights = [], []
    for layer in layers:
        k = torch.cat([r["routing"][layer][0] for r in ranks if layer in r["routing"]])
        ids = torch.cat([r["routing"][layer][1] for r in ranks if layer in r["routing"]])
        w = torch.cat([r["routing"][layer][2] for r in ranks if layer in r["routing"]])
        o = torch.argsort(k)
        if not torch.equal(k[o], keys):
            raise RuntimeError(f"routing of layer {layer} does not cover the same tokens as the logits")
        experts.append(ids[o])
        weights.append(w[o])
    torch.save({"keys": keys, "experts": torch.stack(experts, 1), "weights": torch.stack(weights, 1),
                "max_len": ranks[0]["max_len"]}, out_dir / "routing.pt")
    counters = sum_counters([r["counters"] for r in ranks])
    elapsed = max(r["elapsed_s"] for r in ranks)
    gen = [generated[s] for s in range(len(prompts))]
    n_gen = sum(len(g) for g in gen)
    summary = {
        "mode": ranks[0]["mode"],
        "world_size": world,
        "weight_dtype": ranks[0].get("weight_dtype", "float32"),  # what the ranks held (runtime/precision.py)
        "expert_weight_dtype": ranks[0].get("expert_weight_dtype") or ranks[0].get("weight_dtype", "float32"),
        "prompts": [decode(p) for p in prompts],
        "prompt_ids": [list(map(int, p)) for p in prompts],
        "texts": [decode(g) for g in gen],
        "generated": gen,
        "generated_tokens": n_gen,
        "processed_tokens": int(keys.numel()),
        "elapsed_s": elapsed,
        "tokens_per_second": n_gen / elapsed if elapsed > 0 else 0.0,
        "counters": counters,
        "context": ranks[0].get("context", []),  # coherent: per block [hidden | kv, elements per token]
        **_summarise(counters, n_gen),
    }
    if "expert_cache" in ranks[0]:
        summary["expert_cache"] = merge_expert_caches(out_dir, ranks)
    (out_dir / "result.json").write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    return summary


def merge_expert_caches(out_dir: Path, ranks: list) -> dict:
    """Offloading: per-rank cache counters summed (result.json) and the request logs (expert_cache.pt)."""
    per_rank = [r["expert_cache"]["stats"] for r in ranks]
    torch.save({"logs": [r["expert_cache"]["log"] for r in ranks], "resident": [r["expert_cache"]["resident"] for r in ranks]},
               out_dir / "expert_cache.pt")
    total = {k: sum(s.get(k, 0) for s in per_rank) for k in ("requests", "hits", "loads", "bytes_moved", "prefetches",
                                                             "prefetch_hits", "resident_at_layer_start", "host_computed",
                                                             "host_rows", "prefetch_waits",
                                                             "prefetch_wait_s", "disk_loads", "disk_bytes", "host_loads",
                                                             "host_bytes", "preload_bytes")}
    total["hit_ratio"] = total["hits"] / total["requests"] if total["requests"] else 0.0
    return {**total, "ranks": per_rank}
