"""Every policy on one request stream, side by side: what `moeplan simulate`, the planner's
validation and benchmarks/offload.py report (one function, so the three agree).

Demand: LRU, LFU, LIFO, MoE-Infinity, Belady and moeplan from the same initial resident set.
Prefetch (timed): demand-only with the moeplan policy ("none"), MoE-Infinity (EAMC prefetch +
its cache priority), moeplan (next-use prefetch + next-use eviction) and, on a stream with
speculation, the speculative prefetcher (next-use eviction), each also with host compute on a
miss ("<mode>+host") where the profile has the host's rates.
"""
from __future__ import annotations

from moeplan.runtime.offload.policies import DEMAND_POLICIES, make_policy
from moeplan.runtime.offload.prefetch import PREFETCHERS, make_prefetcher
from moeplan.passes.optimize.offload.simulator import simulate_demand, simulate_timed

PREFETCH_MODES = PREFETCHERS
PAIRED_EVICTION = {"none": "moeplan", "moe-infinity": "moe-infinity", "moeplan": "moeplan",
                   "speculative": "moeplan"}  # each prefetcher's own cache policy


def modes_for(stream, modes=PREFETCH_MODES) -> tuple:
    """The prefetch modes that can run on `stream` (speculative: only with its speculation)."""
    return tuple(m for m in modes if m != "speculative" or stream.spec_depth)


def run_demand(stream, capacity, resident, model, policies=DEMAND_POLICIES, expert_bytes: int = 0, known=None) -> dict:
    """{policy: Result.to_dict()} in demand mode; `known` {policy: result} already simulated on the
    same stream, capacity, residents and model (the planner's mix tuning ran moeplan) is reused."""
    known = known or {}
    return {name: known[name] if name in known else
            simulate_demand(stream, capacity, make_policy(name, model), resident=resident, expert_bytes=expert_bytes).to_dict()
            for name in policies}


def run_prefetch(stream, capacity, resident, model, eamc, timing, modes=PREFETCH_MODES, depth: int = 1,
                 speculation: dict | None = None) -> dict:
    """{mode: Result.to_dict()} of the timed simulation with each prefetcher that can run on the
    stream (`modes_for`); the speculative one looks `depth` layers ahead (`speculation`: the
    trace's settings, `speculation_settings`)."""
    return {mode: simulate_timed(stream, capacity, make_policy(PAIRED_EVICTION[mode], model), timing,
                                 prefetcher=make_prefetcher(mode, eamc, depth=depth, speculation=speculation),
                                 resident=resident).to_dict() for mode in modes_for(stream, modes)}


def gap_to_belady(policies: dict) -> float:
    """Belady's hit ratio minus moeplan's, in points (0-100)."""
    return 100.0 * (policies["belady"]["hit_ratio"] - policies["moeplan"]["hit_ratio"])


HOST = "+host"


def variant_label(mode: str, host: bool) -> str:
    return mode + (HOST if host else "")


def parse_variant(label: str) -> tuple:
    """"speculative+host" -> ("speculative", True)."""
    return (label[: -len(HOST)], True) if label.endswith(HOST) else (label, False)


def variant_order(label: str) -> tuple:
    """Tie order: fewer moving parts first (no prefetch, then the older prefetchers; host compute off)."""
    mode, host = parse_variant(label)
    return (PREFETCH_MODES.index(mode), host)


def speculation_settings(trace) -> dict | None:
    """{"depth", "source", "after_experts", "recall" {"d": share}} of a trace recorded with
    speculation (the planning part: the speculative prefetcher weighs its copies by this recall),
    else None."""
    if trace.speculation is None:
        return None
    from moeplan.passes.analysis.trace.speculate import KNOWN_AT_ROUTER, speculation_recall

    return {"depth": trace.speculation_depth, "source": trace.speculation_source,
            "after_experts": not KNOWN_AT_ROUTER[trace.speculation_source],
            "recall": {d: round(r, 6) for d, r in speculation_recall(trace.experts, trace.speculation).items()}}


def run_variants(stream, capacity, resident, model, eamc, timings: dict, speculation: dict | None,
                 modes=PREFETCH_MODES) -> dict:
    """{label: result} of every prefetcher with and without host compute (timings {host: Timing});
    the speculative one looks 1 and, where the trace speculated that far, 2 layers ahead, and keeps
    the faster (its result records "depth": l+2 only where it pays)."""
    out = {}
    for host, timing in timings.items():
        runs = run_prefetch(stream, capacity, resident, model, eamc, timing, modes, depth=1, speculation=speculation)
        if "speculative" in runs:
            runs["speculative"]["depth"] = 1
            if speculation is not None and speculation["depth"] >= 2:
                two = run_prefetch(stream, capacity, resident, model, eamc, timing, ("speculative",), depth=2,
                                   speculation=speculation)["speculative"]
                if two["seconds_per_token"] < runs["speculative"]["seconds_per_token"]:
                    runs["speculative"] = dict(two, depth=2)
        out.update({variant_label(m, host): r for m, r in runs.items()})
    return out
