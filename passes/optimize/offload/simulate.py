"""Trace-driven, deterministic simulation of a GPU expert cache (demand and prefetch).

Demand mode (`simulate_demand`): requests in stream order; a miss loads the key, evicting the
policy's victim when the cache is full (forced admission). Hit ratio = hits / requests.

Timed mode (`simulate_timed`), for prefetch: one host-to-GPU link copies one expert at a time
(`Timing.copy_s(key)`: PCIe, plus NVMe first for keys outside the host tier). Per step (one
token or prefill chunk at one MoE layer), at time `now` its router has run:
1. copies from the prefetch list of the previous step start while the link is free before `now`
   (each evicts a victim outside the previous step's keys, which are computing; a prefetcher
   may decline, which ends the list; an `idle_only` prefetcher copies only what arrives by
   `now`, so that it never delays a demand fetch);
2. the step's keys resident and arrived by `now` count as "resident at layer start"; keys in
   flight are waited for; missing keys are fetched on demand (after any copy in flight);
3. the layer computes when its last key has arrived: now = ready + `Timing.layer_s`;
4. the prefetcher sees the step and returns an ordered list of keys to copy next.
With no prefetcher this is the demand mode with time added; the hit ratio equals `simulate_demand`'s.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from moeplan.passes.optimize.offload.policies import Policy


@dataclass(frozen=True)
class Timing:
    """Seconds per layer step and per expert copy.

    layer_s: compute of one MoE layer step with its dense share (decode, memory-bound)
    expert_compute_s: added per expert a step uses
    pcie_copy_s: one expert host -> GPU
    nvme_copy_s: one expert disk -> host (keys outside `host_keys` pay it before PCIe)
    """

    layer_s: float
    expert_compute_s: float
    pcie_copy_s: float
    nvme_copy_s: float = 0.0
    expert_bytes: int = 0
    host_keys: frozenset = field(default=None)

    def to_dict(self) -> dict:
        """Times in nanoseconds (plans round floats to 6 decimals), bytes as an integer."""
        return {"layer_ns": round(self.layer_s * 1e9, 3), "expert_compute_ns": round(self.expert_compute_s * 1e9, 3),
                "pcie_copy_ns": round(self.pcie_copy_s * 1e9, 3), "nvme_copy_ns": round(self.nvme_copy_s * 1e9, 3),
                "expert_bytes": int(self.expert_bytes)}

    @classmethod
    def from_dict(cls, d: dict, host_keys=None) -> "Timing":
        return cls(layer_s=d["layer_ns"] * 1e-9, expert_compute_s=d["expert_compute_ns"] * 1e-9,
                   pcie_copy_s=d["pcie_copy_ns"] * 1e-9, nvme_copy_s=d["nvme_copy_ns"] * 1e-9,
                   expert_bytes=int(d["expert_bytes"]),
                   host_keys=None if host_keys is None else frozenset(int(k) for k in host_keys))

    def copy_s(self, key: int) -> float:
        if self.host_keys is None or key in self.host_keys:
            return self.pcie_copy_s
        return self.pcie_copy_s + self.nvme_copy_s


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

    @property
    def hit_ratio(self) -> float:
        return self.hits / self.requests if self.requests else 0.0

    def to_dict(self) -> dict:
        d = {"hit_ratio": self.hit_ratio, "requests": self.requests, "hits": self.hits, "loads": self.loads,
             "bytes_moved": self.loads * self.expert_bytes}
        if self.seconds:
            d.update({"prefetches": self.prefetches, "resident_at_layer_start": self.resident_at_start / max(self.requests, 1),
                      "seconds_per_token": self.seconds / max(self.tokens, 1)})
        return d


def _start(stream, capacity: int, policy: Policy, resident):
    if capacity < 1:
        raise ValueError("the expert cache needs at least one entry")
    resident = [int(k) for k in list(resident)[:capacity]]
    cached = np.zeros(stream.num_keys, dtype=bool)
    cached[resident] = True
    policy.start(stream, cached, resident)
    return cached, len(resident)


def _admit_on_demand(cached, size: int, capacity: int, policy: Policy, key: int, r: int) -> tuple:
    """Insert a missed key, evicting the policy's victim when the cache is full; (size, evicted key or None)."""
    evicted = None
    if size >= capacity:
        evicted = policy.victim(r)
        cached[evicted] = False
        policy.evicted(evicted)
    else:
        size += 1
    cached[key] = True
    policy.inserted(key, r)
    return size, evicted


def simulate_demand(stream, capacity: int, policy: Policy, resident=(), expert_bytes: int = 0) -> Result:
    """Demand paging of `stream` through a `capacity`-key cache under `policy`."""
    cached, size = _start(stream, capacity, policy, resident)
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
        size, _ = _admit_on_demand(cached, size, capacity, policy, key, r)
        policy.touch(r, key, False)
        loads += 1
    return Result(policy.name, len(keys), hits, loads, expert_bytes=expert_bytes)


def simulate_timed(stream, capacity: int, policy: Policy, timing: Timing, prefetcher=None, resident=()) -> Result:
    """Demand + optional prefetch with the link and compute times of `timing` (see module)."""
    cached, size = _start(stream, capacity, policy, resident)
    keys, starts = stream.keys, stream.step_start
    ready = {}
    now = link_free = 0.0
    hits = loads = prefetches = resident_at_start = 0
    queue, prev_keys = [], set()
    if prefetcher is not None:
        prefetcher.start(stream, cached, policy)
    idle_only = bool(getattr(prefetcher, "idle_only", False))
    for s in range(len(stream.step_layer)):
        # 1. prefetch copies that started before this router
        while queue and link_free < now:
            key = queue.pop(0)
            if cached[key]:
                continue
            if idle_only and link_free + timing.copy_s(key) > now:
                break
            if size >= capacity:
                v = prefetcher.victim_for(key, prev_keys) if prefetcher else None
                if v is None:
                    queue = []
                    break
                cached[v] = False
                policy.evicted(v)
                ready.pop(v, None)
            else:
                size += 1
            cached[key] = True
            policy.inserted(key, -1)
            link_free += timing.copy_s(key)
            ready[key] = link_free
            loads += 1
            prefetches += 1
        # 2. the step's requests
        policy.begin_step(s)
        a, b = starts[s], starts[s + 1]
        step_keys = set(int(k) for k in keys[a:b])
        done = now
        for r in range(a, b):
            key = int(keys[r])
            if cached[key]:
                hits += 1
                arrival = ready.get(key, 0.0)
                if arrival <= now:
                    resident_at_start += 1
                done = max(done, arrival)
                policy.touch(r, key, True)
                continue
            size, evicted = _admit_on_demand(cached, size, capacity, policy, key, r)
            if evicted is not None:
                ready.pop(evicted, None)
            link_free = max(link_free, now) + timing.copy_s(key)
            ready[key] = link_free
            done = max(done, link_free)
            policy.touch(r, key, False)
            loads += 1
        # 3. compute
        now = done + timing.layer_s + (b - a) * timing.expert_compute_s
        # 4. what to copy next
        prev_keys = step_keys
        if prefetcher is not None:
            queue = prefetcher.after_step(s)
    return Result(policy.name, len(keys), hits, loads, prefetches=prefetches, resident_at_start=resident_at_start,
                  seconds=now, tokens=stream.num_tokens, expert_bytes=timing.expert_bytes)
