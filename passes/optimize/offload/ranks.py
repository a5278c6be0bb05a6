"""Expert caches for an expert-parallel bundle (`moeplan compile --target torchrun --gpu-memory B |
--expert-cache N`): each rank caches among its own experts.

Why per rank: under expert parallelism a rank only ever runs the experts the placement gives it,
so its cache competes only among those keys; the request stream it sees is the planning stream
restricted to them (stream.restrict). Per rank r:
* capacity C_r = min(C, |experts of r|), C from the one-GPU memory budget (plan.memory_budget:
  dense weights, KV cache, activations, reserve; every rank holds the dense weights) or N;
* residents: its C_r most popular keys on the planning half;
* eviction: given, or the online policy with the most held-out hits summed over ranks (ties:
  moeplan first); the moeplan policy's frequency weight is tuned on the same sum;
* host tier: the machine's host memory for experts (--host-memory, else the profile's less a
  reserve) split evenly among its ranks; each rank holds its most popular keys that fit, as the
  float32 copies the runtime keeps (`runtime_expert_bytes`), and reads the others from disk at
  every load (tiers.py). Recorded per rank, with the held-out disk/host bytes per token.
The runtime runs demand paging (no prefetch): its hit ratio, bytes and disk/host split must equal
the simulator's.
"""
from __future__ import annotations

import numpy as np

from moeplan.passes.analysis.activation import popularity_by_layer
from moeplan.passes.optimize.offload.next_use import fit_next_use
from moeplan.passes.optimize.offload.plan import (MIXES, ONLINE_POLICIES, OffloadRequest, capped, host_tier_bytes,
                                                 memory_budget, popular_keys, split_by_sequence)
from moeplan.passes.optimize.offload.policies import make_policy
from moeplan.passes.optimize.offload.simulate import simulate_demand
from moeplan.passes.optimize.offload.stream import build_stream, restrict
from moeplan.passes.optimize.offload.tiers import TIER_COUNTERS, LoadRecorder, tier_split
from moeplan.planner.errors import UserError

RUNTIME_POLICIES = ONLINE_POLICIES  # what a bundle can run (Belady needs the future)


def runtime_expert_bytes(ir) -> int:
    """Bytes one expert load moves in the runtime, which holds weights as float32."""
    from moeplan.planner.ir import dtype_bytes

    return int(round(ir.moe_stages[0].expert_param_bytes / dtype_bytes(ir.dtype))) * 4


def rank_keys(hosts: np.ndarray) -> list:
    """Per rank, the bool [L * E] mask of the keys it hosts (hosts: bool [L, E, D])."""
    L, E, D = hosts.shape
    return [hosts[:, :, d].reshape(L * E) for d in range(D)]


def host_tiers(masks: list, popularity: np.ndarray, req: OffloadRequest, ranks_per_node: int, expert_bytes: int) -> dict:
    """The plan's host tier: {"memory_bytes" per rank, "capacity" [per rank], "resident" [per rank:
    sorted [layer, expert] pairs]}, each rank's most popular keys (popularity [L, E]) that fit."""
    per_rank = host_tier_bytes(req) // max(1, int(ranks_per_node))
    fits = per_rank // max(1, int(expert_bytes))
    E = popularity.shape[1]
    flat = popularity.reshape(-1)
    keys = [sorted(popular_keys(np.where(mask, flat, -1.0), int(min(fits, mask.sum())))) for mask in masks]
    return {"memory_bytes": int(per_rank), "capacity": [len(k) for k in keys],
            "resident": [[[k // E, k % E] for k in ks] for ks in keys]}


def plan_rank_caches(ir, trace, hosts: np.ndarray, req: OffloadRequest, kv_per_token: int, eviction=None,
                     say=lambda m: None, ranks_per_node: int = 1) -> dict:
    """{"communication": the plan's expert_cache section, "predicted": per-rank held-out figures}."""
    if eviction is not None and eviction not in RUNTIME_POLICIES:
        raise UserError(f"--eviction {eviction} cannot run in a bundle; use one of {', '.join(RUNTIME_POLICIES)}")
    budget = memory_budget(ir, kv_per_token, req)
    masks = rank_keys(hosts)
    fit_rows, val_rows = split_by_sequence(trace, req.validation_fraction)
    fit, val = trace.select(fit_rows), trace.select(val_rows)
    popularity = popularity_by_layer(fit)
    model = fit_next_use(build_stream(fit), popularity)
    flat_pop = popularity.reshape(-1)
    capacities, residents = [], []
    for mask in masks:
        local = int(mask.sum())
        cap = max(1, min(int(budget["capacity"]), local))
        capacities.append(cap)
        residents.append(popular_keys(np.where(mask, flat_pop, -1.0), min(cap, local)))
    stream = capped(build_stream(val, req.prompt_tokens), req.max_sim_requests)
    per_rank = [restrict(stream, m) for m in masks]

    def hits(name, m):
        return [simulate_demand(s, c, make_policy(name, m), resident=r) for s, c, r in zip(per_rank, capacities, residents)]

    mix_hits = {w: sum(x.hits for x in hits("moeplan", model.with_mix(w))) for w in MIXES}
    model = model.with_mix(max(MIXES, key=lambda w: (mix_hits[w], -w)))
    results = {name: hits(name, model) for name in RUNTIME_POLICIES}
    total = {name: sum(x.hits for x in rs) for name, rs in results.items()}
    chosen = eviction or max(RUNTIME_POLICIES, key=lambda p: (total[p], -RUNTIME_POLICIES.index(p)))
    requests = sum(x.requests for x in results[chosen])
    E = ir.moe_stages[0].num_experts
    host_bytes, disk_bytes = runtime_expert_bytes(ir), int(ir.moe_stages[0].expert_param_bytes)
    host = host_tiers(masks, popularity, req, ranks_per_node, host_bytes)
    split = dict.fromkeys(TIER_COUNTERS, 0)
    for s, c, r, tier in zip(per_rank, capacities, residents, host["resident"]):
        recorder = LoadRecorder(make_policy(chosen, model))
        simulate_demand(s, c, recorder, resident=r)
        one = tier_split(recorder.loaded, [l * E + e for l, e in tier], disk_bytes, host_bytes)
        split = {k: split[k] + one[k] for k in split}
    say(f"expert caches: {capacities} of {[int(m.sum()) for m in masks]} experts per rank, eviction {chosen}; "
        f"host tier {host['capacity']} experts per rank")
    tokens = max(stream.num_tokens, 1)
    return {
        "communication": {"capacity": capacities, "eviction": chosen, "prefetch": "none",
                          "resident": [[[k // E, k % E] for k in r] for r in residents],
                          "memory": budget, "policy_model": model.to_dict(),
                          "runtime_expert_bytes": host_bytes, "disk_expert_bytes": disk_bytes, "host": host},
        "predicted": {"hit_ratio": total[chosen] / requests if requests else 0.0,
                      "hit_ratio_by_rank": [x.hit_ratio for x in results[chosen]],
                      "policies": {name: total[name] / requests if requests else 0.0 for name in RUNTIME_POLICIES},
                      "validation_tokens": stream.num_tokens,
                      "disk_bytes_per_token": split["disk_bytes"] / tokens, "host_bytes_per_token": split["host_bytes"] / tokens},
    }
