"""The timed expert cache, one step at a time: what `simulate_timed` runs over a whole stream and
what a bundle's runtime runs as its ranks serve tokens (shipped as `runtime/offload_stepper.py`).

Why one stepper: prefetch decisions made on the wall clock would depend on thread scheduling, so
no run could be checked against a prediction. Here every decision (which keys are prefetched,
which are evicted, which requests hit) follows from the request stream and a *modelled* clock
(`Timing`: a layer step's compute, one expert's copy), so the runtime and the simulator, driving
this same code with the same steps, decide the same things (numpy and the other shipped offload
modules only). `plan_stepper` builds it from a plan's expert_cache section: the one recipe the
runtime and the simulator's replay of a run (passes/optimize/offload/replay.py) both follow.

One `step(s)` (step s = one token or prefill chunk at one MoE layer; its router has run at
`now`, its keys are in the stream):
1. the step's requests: keys cached (and arrived by `now`: "resident at layer start", else waited
   for) hit; missing keys are fetched on demand after any copy in flight, evicting the policy's
   victim when the cache is full (forced admission);
2. compute: now = (last arrival) + `Timing.layer_s` + keys x `Timing.expert_compute_s`;
3. the prefetcher sees the step and returns an ordered list of keys to copy next;
4. copies of that list that start while the link is free before `now` (the next router) are
   decided: each evicts a victim outside this step's keys (`prefetcher.victim_for`; None declines,
   which ends the list); an `idle_only` prefetcher copies only what arrives by `now`.
`step` returns (requests, copies): per request (key, hit, evicted key or None), and per decided
copy (key, evicted key or None), in decision order, so a runtime can move the weights. Copies are
decided at the end of a step (also after the last one): they take effect before the next step.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .offload_next_use import NextUseModel
from .offload_policies import DEMAND_POLICIES, make_policy
from .offload_prefetch import make_prefetcher


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


NO_TIME = Timing(0.0, 0.0, 0.0)  # demand paging only: without a prefetcher no decision reads the clock


def pair_keys(pairs, num_experts: int) -> list:
    """The cache keys (layer * E + expert) of a plan's [layer, expert] pairs."""
    return [int(l) * num_experts + int(e) for l, e in pairs]


def rank_timing(spec: dict, rank: int, num_experts: int) -> Timing:
    """One rank's modelled clock from a plan's expert_cache section ({"timing", "host"}): copies of
    keys outside the rank's host tier pay the NVMe read first (no host tier recorded: none do)."""
    host = spec.get("host")
    return Timing.from_dict(spec["timing"], None if host is None else pair_keys(host["resident"][rank], num_experts))


def start_cache(stream, capacity: int, policy, resident) -> tuple:
    """(cached bool [N], size) with `resident` (at most `capacity`) in place and the policy started."""
    if capacity < 1:
        raise ValueError("the expert cache needs at least one entry")
    resident = [int(k) for k in list(resident)[:capacity]]
    cached = np.zeros(stream.num_keys, dtype=bool)
    cached[resident] = True
    policy.start(stream, cached, resident)
    return cached, len(resident)


def admit_on_demand(cached, size: int, capacity: int, policy, key: int, r: int) -> tuple:
    """Insert a missed key, evicting the policy's victim when the cache is full; (size, evicted key or None)."""
    evicted = None
    if size >= capacity:
        evicted = int(policy.victim(r))
        cached[evicted] = False
        policy.evicted(evicted)
    else:
        size += 1
    cached[key] = True
    policy.inserted(key, r)
    return size, evicted


class TimedCache:
    """A `capacity`-key cache under `policy` and an optional prefetcher on the clock of `timing`.

    Counters: requests, hits, loads (demand + prefetch copies), prefetches, prefetch_hits (prefetched
    keys whose first request after the copy hit), resident_at_start, now (modelled seconds)."""

    def __init__(self, stream, capacity: int, policy, timing: Timing = NO_TIME, prefetcher=None, resident=()):
        self.stream, self.capacity, self.policy, self.timing, self.prefetcher = stream, capacity, policy, timing, prefetcher
        self.cached, self.size = start_cache(stream, capacity, policy, resident)
        self.ready = {}  # key -> modelled arrival of its last copy
        self.now = self.link_free = 0.0
        self.requests = self.hits = self.loads = self.prefetches = self.prefetch_hits = self.resident_at_start = 0
        self.unused_prefetch = set()
        if prefetcher is not None:
            prefetcher.start(stream, self.cached, policy)
        self.idle_only = bool(getattr(prefetcher, "idle_only", False))

    def _forget(self, key) -> None:
        if key is not None:
            self.ready.pop(key, None)
            self.unused_prefetch.discard(key)

    def step(self, s: int) -> tuple:
        """Serve step s, advance the clock, decide the next copies: (requests, copies) (module doc)."""
        st, policy, timing = self.stream, self.policy, self.timing
        policy.begin_step(s)
        a, b = int(st.step_start[s]), int(st.step_start[s + 1])
        keys = st.keys[a:b]
        done, served = self.now, []
        for r in range(a, b):
            key = int(keys[r - a])
            self.requests += 1
            if self.cached[key]:
                self.hits += 1
                arrival = self.ready.get(key, 0.0)
                self.resident_at_start += arrival <= self.now
                if key in self.unused_prefetch:
                    self.prefetch_hits += 1
                    self.unused_prefetch.discard(key)
                done = max(done, arrival)
                policy.touch(r, key, True)
                served.append((key, True, None))
                continue
            self.size, evicted = admit_on_demand(self.cached, self.size, self.capacity, policy, key, r)
            self._forget(evicted)
            self.link_free = max(self.link_free, self.now) + timing.copy_s(key)
            self.ready[key] = self.link_free
            done = max(done, self.link_free)
            policy.touch(r, key, False)
            self.loads += 1
            served.append((key, False, evicted))
        self.now = done + timing.layer_s + (b - a) * timing.expert_compute_s
        if self.prefetcher is None:
            return served, []
        return served, self._prefetch(self.prefetcher.after_step(s), set(int(k) for k in keys))

    def _prefetch(self, queue: list, computing: set) -> list:
        """The copies of `queue` that start before the next router (`now`), decided in order."""
        timing, copies = self.timing, []
        for key in queue:
            if not self.link_free < self.now:
                break
            key = int(key)
            if self.cached[key]:
                continue
            if self.idle_only and self.link_free + timing.copy_s(key) > self.now:
                break
            victim = None
            if self.size >= self.capacity:
                victim = self.prefetcher.victim_for(key, computing)
                if victim is None:
                    break
                victim = int(victim)
                self.cached[victim] = False
                self.policy.evicted(victim)
                self._forget(victim)
            else:
                self.size += 1
            self.cached[key] = True
            self.policy.inserted(key, -1)
            self.link_free += timing.copy_s(key)
            self.ready[key] = self.link_free
            self.unused_prefetch.add(key)
            self.loads += 1
            self.prefetches += 1
            copies.append((key, victim))
        return copies


def plan_stepper(spec: dict, rank: int, allowed, num_experts: int, timing: Timing | None = None,
                 wrap=lambda policy: policy):
    """(stream, capacity, resident) -> a fresh `TimedCache` for `rank` of a plan's expert_cache
    section `spec`: its eviction policy (passed through `wrap`), its prefetcher restricted to
    `allowed` (bool [L * E], the rank's experts; None: all) and the rank's clock, or `timing`
    (another clock, e.g. a demand-only run modelled on a prefetch plan's hardware)."""
    name, prefetch = spec["eviction"], spec.get("prefetch", "none")
    if name == "belady" or name not in DEMAND_POLICIES:
        raise ValueError(f"eviction policy '{name}' cannot run online; plan with lru, lfu, lifo, moe-infinity or moeplan")
    model = NextUseModel.from_dict(spec["policy_model"]) if name == "moeplan" else None
    if timing is None:
        timing = NO_TIME if prefetch == "none" else rank_timing(spec, rank, num_experts)
    eamc = np.asarray(spec["eamc"], dtype=float) if prefetch == "moe-infinity" else None
    return lambda stream, capacity, resident: TimedCache(stream, capacity, wrap(make_policy(name, model)), timing,
                                                         make_prefetcher(prefetch, eamc, allowed), resident)
