"""Every policy on one request stream, side by side: what `moeplan simulate`, the planner's
validation and benchmarks/offload.py report (one function, so the three agree).

Demand: LRU, LFU, LIFO, MoE-Infinity, Belady and moeplan from the same initial resident set.
Prefetch (timed): demand-only with the moeplan policy ("none"), MoE-Infinity (EAMC prefetch +
its cache priority) and moeplan (next-use prefetch + next-use eviction).
"""
from __future__ import annotations

from moeplan.backends.runtime.offload_policies import DEMAND_POLICIES, make_policy
from moeplan.backends.runtime.offload_prefetch import PREFETCHERS, make_prefetcher
from moeplan.passes.optimize.offload.simulate import simulate_demand, simulate_timed

PREFETCH_MODES = PREFETCHERS
PAIRED_EVICTION = {"none": "moeplan", "moe-infinity": "moe-infinity", "moeplan": "moeplan"}  # each prefetcher's own cache policy


def run_demand(stream, capacity, resident, model, policies=DEMAND_POLICIES, expert_bytes: int = 0, known=None) -> dict:
    """{policy: Result.to_dict()} in demand mode; `known` {policy: result} already simulated on the
    same stream, capacity, residents and model (the planner's mix tuning ran moeplan) is reused."""
    known = known or {}
    return {name: known[name] if name in known else
            simulate_demand(stream, capacity, make_policy(name, model), resident=resident, expert_bytes=expert_bytes).to_dict()
            for name in policies}


def run_prefetch(stream, capacity, resident, model, eamc, timing, modes=PREFETCH_MODES) -> dict:
    """{mode: Result.to_dict()} of the timed simulation with each prefetcher."""
    return {mode: simulate_timed(stream, capacity, make_policy(PAIRED_EVICTION[mode], model), timing,
                                 prefetcher=make_prefetcher(mode, eamc), resident=resident).to_dict() for mode in modes}


def gap_to_belady(policies: dict) -> float:
    """Belady's hit ratio minus moeplan's, in points (0-100)."""
    return 100.0 * (policies["belady"]["hit_ratio"] - policies["moeplan"]["hit_ratio"])
