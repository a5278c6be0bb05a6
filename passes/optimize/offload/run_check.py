"""`moeplan run` on a bundle with expert caches: the counters the ranks measured beside the simulator's
replay of the requests each rank logged (`replay.py`).
"""
from __future__ import annotations

from pathlib import Path


def cache_beside_simulation(root, plan: dict, out_dir, summary: dict) -> dict:
    """`moeplan run` on a bundle with expert caches: the measured counters beside the simulator's
    replay of the requests each rank logged (passes/optimize/offload/replay.py: same policy,
    prefetcher, timing, capacity and residents; its loads split into disk reads and host-tier copies
    by the plan's host tier), whether those requests are the ones the run's routing implies
    (routing.pt; exact order on one rank), and the measured wall seconds per token beside the
    modelled ones (reported, not checked: the plan models its hardware profile)."""
    import json

    import torch

    from moeplan.passes.optimize.offload.rank_caches import rank_keys
    from moeplan.passes.optimize.offload.replay import matches, replay_rank_logs
    from moeplan.passes.optimize.offload.stream import stream_from_log
    from moeplan.passes.optimize.placement.schema import placement_from_dict

    spec = plan["communication"]["expert_cache"]
    data = torch.load(Path(out_dir) / "expert_cache.pt", weights_only=True)
    masks = rank_keys(placement_from_dict(json.loads((Path(root) / "placement.json").read_text())).hosts())
    streams = [stream_from_log(log) for log in data["logs"]]
    simulated = replay_rank_logs(spec, streams, masks)
    measured = summary["expert_cache"]
    forwards = simulated.pop("forwards")
    modelled = simulated.pop("modelled_seconds_by_rank")
    seconds = {"measured_wall": summary["elapsed_s"] / forwards if forwards else 0.0,
               "modelled_for_these_tokens": max(modelled) / forwards if forwards and "timing" in spec else None,
               "planned": plan["predicted"].get("expert_cache", {}).get("seconds_per_token"), "forwards": forwards}
    return {"expert_cache": {"eviction": spec["eviction"], "prefetch": spec.get("prefetch", "none"), "capacity": spec["capacity"],
                             "measured": measured, "simulated": simulated, "matches_simulation": matches(measured, simulated),
                             "seconds_per_token": seconds,
                             "requests_match_routing": _requests_match_routing(out_dir, summary, streams)}}


def _requests_match_routing(out_dir, summary: dict, streams: list) -> bool:
    """One rank: the logged stream is exactly the batched engine's stream of routing.pt (order
    included). More ranks: per (forward, layer), the union of the ranks' requested experts is the
    set the routing implies."""
    import numpy as np
    import torch

    from moeplan.passes.optimize.offload.stream import batched_stream

    routing = torch.load(Path(out_dir) / "routing.pt", weights_only=True)
    keys, experts, max_len = routing["keys"].numpy(), routing["experts"].numpy(), int(routing["max_len"])
    seq, pos = keys // max_len, keys % max_len
    prompt_len = np.array([len(p) for p in summary["prompt_ids"]])[seq]
    forward = np.where(pos < prompt_len, 0, pos - prompt_len + 1)
    order = np.lexsort((keys, forward))
    expected = batched_stream(experts[order], forward[order], streams[0].num_experts)
    if len(streams) == 1:
        got = streams[0]
        return all(np.array_equal(getattr(got, f), getattr(expected, f))
                   for f in ("keys", "step_start", "step_layer", "step_token"))

    def pairs(s):
        return {(int(s.step_token[st]), int(k)) for st, k in zip(s.step, s.keys)}

    return set().union(*(pairs(s) for s in streams)) == pairs(expected)
