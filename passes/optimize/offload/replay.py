"""The simulator's replay of a bundle run's expert caches: what `moeplan run --verify` compares with
the counters the ranks measured (issue 13).

Each rank logged the requests it served (runtime/expert_cache.OnlineStream). Replaying
that stream through the stepper with the plan's capacity, residents, eviction policy, prefetcher
(restricted to the rank's experts) and timing must give exactly the rank's hits, loads,
prefetches, prefetched keys that hit, requests resident at layer start and bytes moved: the
runtime drove the same stepper on the same steps. With prefetch "none" no decision reads the
clock (the plan records no timing) and the replay is demand paging. The replay's loads (demand
and prefetch) are split into disk reads and host-tier copies by the plan's host tier (tiers.py);
requests computed on the host (the plan's host_compute rule) are compared too, with the disk
reads of those outside the host tier. A speculative prefetcher reads the speculation the rank
logged (computed live with the model's own routers, runtime/offload/speculation.py).
"""
from __future__ import annotations

import numpy as np

from moeplan.runtime.offload.stepper import TimedCache, Timing, pair_keys, plan_stepper
from moeplan.passes.optimize.offload.tiers import TIER_COUNTERS, LoadRecorder, tier_totals

COMPARED = ("requests", "hits", "loads", "prefetches", "prefetch_hits", "resident_at_layer_start", "bytes_moved",
            "host_computed", "host_rows", *TIER_COUNTERS)


def rank_stepper(spec: dict, rank: int, allowed: np.ndarray, stream, timing: Timing | None = None,
                 wrap=lambda policy: policy) -> TimedCache:
    """A fresh stepper for `rank` of the plan's expert_cache section `spec` over `stream`, with the
    rank's planned capacity and residents (`runtime/offload/stepper.py: plan_stepper`; `timing`: another clock)."""
    new = plan_stepper(spec, rank, allowed, stream.num_experts, timing, wrap)
    return new(stream, int(spec["capacity"][rank]), pair_keys(spec["resident"][rank], stream.num_experts))


def replay_rank_logs(spec: dict, streams: list, masks: list) -> dict:
    """Summed replay counters (COMPARED, hit_ratio), per-rank modelled seconds and the forwards
    served, for the ranks' logged streams (`stream.stream_from_log`; masks: bool [L * E] per rank,
    its experts)."""
    host = spec.get("host") or {"resident": [[] for _ in streams]}  # plans before the host tier: all disk
    host_bytes = int(spec["runtime_expert_bytes"])
    caches = []
    for r, stream in enumerate(streams):
        cache = rank_stepper(spec, r, masks[r], stream, wrap=LoadRecorder)
        for s in range(len(stream.step_layer)):
            cache.step(s)
        caches.append(cache)
    out = {"requests": sum(c.requests for c in caches), "hits": sum(c.hits for c in caches),
           "loads": sum(c.loads for c in caches), "prefetches": sum(c.prefetches for c in caches),
           "prefetch_hits": sum(c.prefetch_hits for c in caches),
           "resident_at_layer_start": sum(c.resident_at_start for c in caches),
           "host_computed": sum(c.host_computed for c in caches), "host_rows": sum(c.host_rows for c in caches)}
    out.update(tier_totals([c.policy.loaded for c in caches],
                           [pair_keys(tier, s.num_experts) for tier, s in zip(host["resident"], streams)],
                           int(spec.get("disk_expert_bytes", host_bytes)), host_bytes,
                           [c.host_keys_computed for c in caches]))
    out["bytes_moved"] = out["loads"] * host_bytes
    out["hit_ratio"] = out["hits"] / out["requests"] if out["requests"] else 0.0
    out["modelled_seconds_by_rank"] = [c.now for c in caches]
    out["forwards"] = max((s.num_tokens for s in streams), default=0)
    return out


def matches(measured: dict, simulated: dict) -> bool:
    return all(measured[k] == simulated[k] for k in COMPARED)
