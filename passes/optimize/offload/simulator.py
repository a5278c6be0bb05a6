"""Trace-driven, deterministic simulation of a GPU expert cache (demand and prefetch).

Demand mode (`simulate_demand`): requests in stream order; a miss loads the key, evicting the
policy's victim when the cache is full (forced admission). Hit ratio = hits / requests.

Timed mode (`simulate_timed`), for prefetch: one host-to-GPU link copies one expert at a time
(`Timing.copy_s(key)`: PCIe, plus NVMe first for keys outside the host tier). Per step (one
token or prefill chunk at one MoE layer), at time `now` its router has run: its keys resident
and arrived by `now` count as "resident at layer start", keys in flight are waited for, missing
keys are fetched on demand or, with host compute, computed on the host when that is sooner; the
layer computes; the prefetcher sees the step and the copies of its list that start while the link
is free before the next router (and not before what decided them was known) are decided (an
`idle_only` prefetcher copies only what arrives by then, so that it never delays a demand fetch).
The steps are `runtime/offload/stepper.py: TimedCache`'s, which a bundle's runtime drives too
(runtime/offload/stepper.py has the details).
With no prefetcher this is the demand mode with time added; the hit ratio equals `simulate_demand`'s.
"""
from __future__ import annotations

from dataclasses import dataclass

from moeplan.runtime.offload.policies import Policy
from moeplan.runtime.offload.stepper import Timing, TimedCache, admit_on_demand, start_cache

__all__ = ["Result", "Timing", "simulate_demand", "simulate_timed"]


@dataclass
class Result:
    policy: str
    requests: int
    hits: int
    loads: int  # demand + prefetch copies
    prefetches: int = 0
    resident_at_start: int = 0
    seconds: float = 0.0
    tokens: int = 0
    expert_bytes: int = 0
    prefetch_hits: int = 0  # prefetched keys whose first request after the copy hit
    host_computed: int = 0  # requests computed on the host (host compute on a miss)
    host_rows: int = 0  # their token rows

    @property
    def hit_ratio(self) -> float:
        return self.hits / self.requests if self.requests else 0.0

    def to_dict(self) -> dict:
        d = {"hit_ratio": self.hit_ratio, "requests": self.requests, "hits": self.hits, "loads": self.loads,
             "bytes_moved": self.loads * self.expert_bytes}
        if self.seconds:
            d.update({"prefetches": self.prefetches, "prefetch_hits": self.prefetch_hits, "resident_at_layer_start": self.resident_at_start / max(self.requests, 1),
                      "seconds_per_token": self.seconds / max(self.tokens, 1)})
        if self.host_computed:
            d.update({"host_computed": self.host_computed, "host_rows": self.host_rows})
        return d


def simulate_demand(stream, capacity: int, policy: Policy, resident=(), expert_bytes: int = 0) -> Result:
    """Demand paging of `stream` through a `capacity`-key cache under `policy`."""
    cached, size = start_cache(stream, capacity, policy, resident)
    keys, step = stream.keys, stream.step
    hits = loads = 0
    cur = -1
    for r in range(len(keys)):
        s = step[r]
        if s != cur:
            cur = s
            policy.begin_step(int(s))
        key = int(keys[r])
        if cached[key]:
            hits += 1
            policy.touch(r, key, True)
            continue
        size, _ = admit_on_demand(cached, size, capacity, policy, key, r)
        policy.touch(r, key, False)
        loads += 1
    return Result(policy.name, len(keys), hits, loads, expert_bytes=expert_bytes)


def simulate_timed(stream, capacity: int, policy: Policy, timing: Timing, prefetcher=None, resident=()) -> Result:
    """Demand + optional prefetch with the link and compute times of `timing`: the stepper's steps
    over the whole stream (runtime/offload/stepper.py; a bundle's runtime drives the same
    steps as it serves)."""
    cache = TimedCache(stream, capacity, policy, timing, prefetcher, resident)
    for s in range(len(stream.step_layer)):
        cache.step(s)
    return Result(policy.name, cache.requests, cache.hits, cache.loads, prefetches=cache.prefetches,
                  resident_at_start=cache.resident_at_start, seconds=cache.now, tokens=stream.num_tokens,
                  expert_bytes=timing.expert_bytes, prefetch_hits=cache.prefetch_hits,
                  host_computed=cache.host_computed, host_rows=cache.host_rows)
