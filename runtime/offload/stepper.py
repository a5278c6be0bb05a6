"""The timed expert cache, one step at a time: what `simulate_timed` runs over a whole stream and
what a bundle's runtime runs as its ranks serve tokens (shipped as `runtime/offload/stepper.py`).

Why one stepper: prefetch decisions made on the wall clock would depend on thread scheduling, so
no run could be checked against a prediction. Here every decision (which keys are prefetched,
which are evicted, which requests hit) follows from the request stream and a *modelled* clock
(`Timing`: a layer step's compute, one expert's copy), so the runtime and the simulator, driving
this same code with the same steps, decide the same things (numpy and the other shipped offload
modules only). `plan_stepper` builds it from a plan's expert_cache section: the one recipe the
runtime and the simulator's replay of a run (passes/optimize/offload/replay.py) both follow.

One `step(s)` = `serve(s)` then `decide(s)` (step s = one token or prefill chunk at one MoE
layer; its router has run at `now`, its keys are in the stream):
1. `serve`: the step's requests: keys cached (and arrived by `now`: "resident at layer start",
   else waited for) hit; a missing key is either fetched on demand after any copy in flight,
   evicting the policy's victim when the cache is full (forced admission), or, with host compute
   (`Timing.host_compute`), computed on the host where its weights are when that finishes first:
   the host is one queue (`host_free`), an expert's rows take `Timing.host_s(key, rows)` there, and
   the key is neither admitted nor shown to the policy (only its activations move);
2. compute: the device's experts finish at (last arrival) + device keys x `Timing.expert_compute_s`,
   the block when those and the host's are done (`block_done`); now = block_done + `Timing.layer_s`
   (the next layer's dense share: its attention, norms, router);
3. `decide`: the prefetcher sees the step and returns an ordered list of keys to copy next; no copy
   starts before what it is based on is known: the step's router (`now` of step 1), or, for a
   prefetcher `after_experts` (speculation from the block's output), `block_done`;
4. copies of that list that start while the link is free before `now` (the next router) are
   decided: each evicts a victim outside this step's keys (`prefetcher.victim_for`; None declines,
   which ends the list); an `idle_only` prefetcher copies only what arrives by `now`.
`serve` returns per request (key, hit, evicted key or None, computed on the host), `decide` per
decided copy (key, evicted key or None), in decision order, so a runtime can move the weights (it
may call `decide` later than `serve`, once its speculation is known: the clock is the model's).
Copies are decided at the end of a step (also after the last one): they take effect before the
next step.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .next_use import NextUseModel
from .policies import DEMAND_POLICIES, make_policy
from .prefetch import make_prefetcher


@dataclass(frozen=True)
class Timing:
    """Seconds per layer step and per expert copy.

    layer_s: compute of one MoE layer step with its dense share (decode, memory-bound)
    expert_compute_s: added per expert a step uses
    pcie_copy_s: one expert host -> GPU
    nvme_copy_s: one expert disk -> host (keys outside `host_keys` pay it before PCIe)
    host_expert_s: host compute of one expert, reading its weights (memory-bound); 0: no host compute
    host_row_s: host compute per token row (2 x expert parameters / the host's FLOP/s)
    host_overhead_s: per host-computed expert: activations to the host and back, launch
    """

    layer_s: float
    expert_compute_s: float
    pcie_copy_s: float
    nvme_copy_s: float = 0.0
    expert_bytes: int = 0
    host_keys: frozenset = field(default=None)
    host_expert_s: float = 0.0
    host_row_s: float = 0.0
    host_overhead_s: float = 0.0

    @property
    def host_compute(self) -> bool:
        return self.host_expert_s > 0

    def to_dict(self) -> dict:
        """Times in nanoseconds (plans round floats to 6 decimals), bytes as an integer; the host
        compute times only when host compute is on (so plans without it are unchanged)."""
        out = {"layer_ns": round(self.layer_s * 1e9, 3), "expert_compute_ns": round(self.expert_compute_s * 1e9, 3),
               "pcie_copy_ns": round(self.pcie_copy_s * 1e9, 3), "nvme_copy_ns": round(self.nvme_copy_s * 1e9, 3),
               "expert_bytes": int(self.expert_bytes)}
        if self.host_compute:
            out.update(host_expert_ns=round(self.host_expert_s * 1e9, 3), host_row_ns=round(self.host_row_s * 1e9, 3),
                       host_overhead_ns=round(self.host_overhead_s * 1e9, 3))
        return out

    @classmethod
    def from_dict(cls, d: dict, host_keys=None) -> Timing:
        return cls(layer_s=d["layer_ns"] * 1e-9, expert_compute_s=d["expert_compute_ns"] * 1e-9,
                   pcie_copy_s=d["pcie_copy_ns"] * 1e-9, nvme_copy_s=d["nvme_copy_ns"] * 1e-9,
                   expert_bytes=int(d["expert_bytes"]),
                   host_keys=None if host_keys is None else frozenset(int(k) for k in host_keys),
                   host_expert_s=d.get("host_expert_ns", 0.0) * 1e-9, host_row_s=d.get("host_row_ns", 0.0) * 1e-9,
                   host_overhead_s=d.get("host_overhead_ns", 0.0) * 1e-9)

    def on_disk(self, key: int) -> bool:
        return self.host_keys is not None and key not in self.host_keys

    def copy_s(self, key: int) -> float:
        return self.pcie_copy_s + (self.nvme_copy_s if self.on_disk(key) else 0.0)

    def host_s(self, key: int, rows: int) -> float:
        """Computing `rows` token rows of `key` on the host: its disk read first if it is not in
        host memory, then the larger of reading its weights and the rows' FLOPs, plus the overhead."""
        return ((self.nvme_copy_s if self.on_disk(key) else 0.0) + self.host_overhead_s
                + max(self.host_expert_s, rows * self.host_row_s))


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
    keys whose first request after the copy hit), resident_at_start, host_computed (requests
    computed on the host) and host_rows (their token rows), host_keys_computed (their keys, in
    order: a key outside the host tier is read from disk for it), now (modelled seconds)."""

    # A copy starts no earlier than what decided it is known. Issue 13's model let a prefetch start
    # in idle link time before the step whose routing chose it; benchmarks/offload.py sets this
    # False only to show what that model predicted.
    causal = True

    def __init__(self, stream, capacity: int, policy, timing: Timing = NO_TIME, prefetcher=None, resident=()):
        self.stream, self.capacity, self.policy, self.timing, self.prefetcher = stream, capacity, policy, timing, prefetcher
        self.cached, self.size = start_cache(stream, capacity, policy, resident)
        self.ready = {}  # key -> modelled arrival of its last copy
        self.now = self.link_free = self.host_free = self.router_at = self.block_done = 0.0
        self.requests = self.hits = self.loads = self.prefetches = self.prefetch_hits = self.resident_at_start = 0
        self.host_computed = self.host_rows = 0
        self.host_keys_computed = []
        self.unused_prefetch = set()
        self.served_step = None
        if prefetcher is not None:
            prefetcher.start(stream, self.cached, policy)
            if hasattr(prefetcher, "price_misses"):
                prefetcher.price_misses(timing)
        self.idle_only = bool(getattr(prefetcher, "idle_only", False))

    def _forget(self, key) -> None:
        if key is not None:
            self.ready.pop(key, None)
            self.unused_prefetch.discard(key)

    def step(self, s: int) -> tuple:
        """Serve step s, advance the clock, decide the next copies: (requests, copies) (module doc)."""
        return self.serve(s), self.decide(s)

    def serve(self, s: int) -> list:
        """Serve step s and advance the clock: per request (key, hit, evicted key or None, on host)."""
        st, policy, timing = self.stream, self.policy, self.timing
        policy.begin_step(s)
        a, b = int(st.step_start[s]), int(st.step_start[s + 1])
        keys = st.keys[a:b]
        start = self.router_at = self.now
        done, host_done, on_device, served = start, start, 0, []
        for r in range(a, b):
            key = int(keys[r - a])
            self.requests += 1
            if self.cached[key]:
                self.hits += 1
                arrival = self.ready.get(key, 0.0)
                self.resident_at_start += arrival <= start
                if key in self.unused_prefetch:
                    self.prefetch_hits += 1
                    self.unused_prefetch.discard(key)
                done = max(done, arrival)
                on_device += 1
                policy.touch(r, key, True)
                served.append((key, True, None, False))
                continue
            copied = max(self.link_free, start) + timing.copy_s(key)
            if timing.host_compute:
                rows = st.request_rows(r)
                computed = max(self.host_free, start) + timing.host_s(key, rows)
                if computed < copied:  # the cheaper of the two: computed where the weights are
                    self.host_free = host_done = max(host_done, computed)
                    self.host_computed += 1
                    self.host_rows += rows
                    self.host_keys_computed.append(key)
                    served.append((key, False, None, True))
                    continue
            self.size, evicted = admit_on_demand(self.cached, self.size, self.capacity, policy, key, r)
            self._forget(evicted)
            self.link_free = copied
            self.ready[key] = copied
            done = max(done, copied)
            on_device += 1
            policy.touch(r, key, False)
            self.loads += 1
            served.append((key, False, evicted, False))
        self.block_done = max(done + on_device * timing.expert_compute_s, host_done)
        self.now = self.block_done + timing.layer_s
        self.served_step = (s, {int(k) for k in keys})
        return served

    def decide(self, s: int) -> list:
        """The copies decided after step s (served last): [(key, evicted key or None)] (module doc)."""
        if self.served_step is None or self.served_step[0] != s:
            raise ValueError(f"decide({s}) must follow serve({s})")
        computing = self.served_step[1]
        self.served_step = None
        if self.prefetcher is None:
            return []
        known = self.block_done if getattr(self.prefetcher, "after_experts", False) else self.router_at
        if self.causal:
            self.link_free = max(self.link_free, known)  # a copy cannot start before what decided it is known
        return self._prefetch(self.prefetcher.after_step(s), computing)

    def _prefetch(self, queue: list, computing: set) -> list:
        """The copies of `queue` that start before the next router (`now`), decided in order; a
        prefetcher with `latest_arrival` skips a copy that would arrive too late to pay."""
        timing, copies = self.timing, []
        limit = getattr(self.prefetcher, "latest_arrival", None)
        for key in queue:
            if not self.link_free < self.now:
                break
            key = int(key)
            if self.cached[key]:
                continue
            if self.idle_only and self.link_free + timing.copy_s(key) > self.now:
                break
            if limit is not None and self.link_free + timing.copy_s(key) > limit(key, self.now, self.now - self.router_at, timing):
                continue
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
        timing = NO_TIME if "timing" not in spec else rank_timing(spec, rank, num_experts)
    eamc = np.asarray(spec["eamc"], dtype=float) if prefetch == "moe-infinity" else None
    speculation = spec.get("speculation") or {}
    return lambda stream, capacity, resident: TimedCache(
        stream, capacity, wrap(make_policy(name, model)), timing,
        make_prefetcher(prefetch, eamc, allowed, depth=speculation.get("depth", 1), speculation=speculation), resident)
