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
* prefetch: given, or of none, MoE-Infinity's EAMC prefetch and ours
  (runtime/offload/prefetch.py) the one with the lowest held-out seconds per token on
  the hardware profile's timing (the slowest rank's; ties: none first). Without --eviction each
  prefetcher brings its own cache policy (none: the best demand policy; moe-infinity:
  MoE-Infinity's; moeplan: ours, which its prefetcher needs); with --eviction only the prefetchers
  that can run beside it compete. A rank prefetches its own experts only. The plan records the
  timing (and for moe-infinity the EAMC) the runtime's stepper needs; with prefetch none the
  section is what it was before prefetch existed.
* host tier: the machine's host memory for experts (--host-memory, else the profile's less a
  reserve) split evenly among its ranks; each rank holds its most popular keys that fit, as the
  copies the runtime keeps (`runtime_expert_bytes`: at its held precision), and reads the others from disk at
  every load (tiers.py). Recorded per rank, with the held-out disk/host bytes per token.
The runtime drives the simulator's stepper (runtime/offload/stepper.py): its hits, loads, prefetches, bytes and
disk/host split must equal the simulator's replay of the same requests.
"""
from __future__ import annotations

import numpy as np

from moeplan.passes.analysis.activation import build_eamc, popularity_by_layer
from moeplan.passes.optimize.offload.evaluate import (PAIRED_EVICTION, PREFETCH_MODES, parse_variant,
                                                     speculation_settings, variant_label, variant_order)
from moeplan.runtime.offload.next_use import fit_next_use
from moeplan.passes.optimize.offload.cache_plan import (MIXES, ONLINE_POLICIES, OffloadRequest, capped,
                                                       host_compute_options, host_compute_record, host_tier_bytes,
                                                       memory_budget, popular_keys, split_by_sequence, timing_for)
from moeplan.runtime.offload.policies import make_policy
from moeplan.runtime.offload.prefetch import make_prefetcher
from moeplan.passes.optimize.offload.simulator import Timing, simulate_demand
from moeplan.runtime.offload.stepper import TimedCache, pair_keys, rank_timing
from moeplan.passes.optimize.offload.stream import build_stream, restrict
from moeplan.passes.optimize.offload.tiers import LoadRecorder, tier_totals
from moeplan.core.errors import UserError
from moeplan.passes.cost.capacity import MAX_PREFILL_TOKENS

RUNTIME_POLICIES = ONLINE_POLICIES  # what a bundle can run (Belady needs the future)


def runtime_expert_bytes(ir, hardware) -> int:
    """Bytes one expert load moves in the runtime: one expert as the ranks hold it on `hardware`
    (`runtime/precision.py: model_weight_bytes`, as the cache's capacity counts it)."""
    from moeplan.runtime.precision import model_weight_bytes

    return model_weight_bytes(ir, on_gpu=not hardware.device_is_host, precision=hardware.precision,
                              expert_cache=True)["expert"]


def rank_keys(hosts: np.ndarray) -> list:
    """Per rank, the bool [L * E] mask of the keys it hosts (hosts: bool [L, E, D])."""
    L, E, D = hosts.shape
    return [hosts[:, :, d].reshape(L * E) for d in range(D)]


def prefetch_candidates(eviction, prefetch, speculation: dict | None = None, trace_known: bool = True) -> list:
    """[(prefetch, eviction or None = the best demand policy)] the planner compares; UserError for
    a pair that cannot run (ours prefetches by our policy's scores; the speculative one needs a
    trace recorded with --speculate from the block output, what the runtime computes live).
    `trace_known` False: the flags alone are checked (the trace's speculation comes later)."""
    if prefetch == "moeplan" and eviction not in (None, "moeplan"):
        raise UserError(f"--prefetch moeplan needs --eviction moeplan (it ranks experts by that policy's scores), "
                        f"got --eviction {eviction}; drop --eviction or choose another --prefetch")
    runnable = speculation is not None and speculation["source"] == "block-output"
    if prefetch == "speculative" and trace_known and not runnable:
        got = "no speculation" if speculation is None else f"speculation from the {speculation['source']}"
        raise UserError(f"--prefetch speculative runs the block-output speculation live, but the trace holds {got}; "
                        "record it with 'moeplan trace MODEL --data TEXT --speculate D --out T.npz'")
    modes = [prefetch] if prefetch is not None else [m for m in PREFETCH_MODES
                                                     if not (m == "moeplan" and eviction not in (None, "moeplan"))
                                                     and not (m == "speculative" and not runnable)]
    return [(m, eviction or (None if m == "none" else PAIRED_EVICTION[m])) for m in modes]


def price_prefetcher(mode: str, eviction: str, per_rank: list, capacities: list, residents: list, masks: list, model,
                     timings: list, eamc, depth: int = 1, speculation: dict | None = None) -> tuple:
    """One prefetcher with its eviction policy on every rank's held-out stream, on each rank's
    modelled clock: ({seconds per token of the slowest rank, prefetches, prefetched keys that hit,
    hit ratios, host-computed requests}, per rank the keys it loaded, demand and prefetch, and the
    keys it computed on the host, for the tier split)."""
    recorders = [LoadRecorder(make_policy(eviction, model)) for _ in per_rank]
    caches = []
    for s, c, r, mask, rec, t in zip(per_rank, capacities, residents, masks, recorders, timings):
        cache = TimedCache(s, c, rec, t, make_prefetcher(mode, eamc, mask, depth=depth, speculation=speculation), r)
        for step in range(len(s.step_layer)):
            cache.step(step)
        caches.append(cache)
    hits = [x.hits / x.requests if x.requests else 0.0 for x in caches]
    return ({"eviction": eviction, "seconds_per_token": max(x.now for x in caches) / max(per_rank[0].num_tokens, 1),
             "prefetches": sum(x.prefetches for x in caches), "prefetch_hits": sum(x.prefetch_hits for x in caches),
             "hit_ratio": sum(x.hits for x in caches) / max(sum(x.requests for x in caches), 1),
             "hit_ratio_by_rank": hits, "host_computed": sum(x.host_computed for x in caches),
             "resident_at_layer_start": sum(x.resident_at_start for x in caches) / max(sum(x.requests for x in caches), 1),
             **({"depth": depth} if mode == "speculative" else {})},
            ([rec.loaded for rec in recorders], [x.host_keys_computed for x in caches]))


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
                     say=lambda m: None, prefetch=None, ranks_per_node: int = 1) -> dict:
    """{"communication": the plan's expert_cache section, "predicted": per-rank held-out figures}."""
    if eviction is not None and eviction not in RUNTIME_POLICIES:
        raise UserError(f"--eviction {eviction} cannot run in a bundle; use one of {', '.join(RUNTIME_POLICIES)}")
    if prefetch is not None and prefetch not in PREFETCH_MODES:
        raise UserError(f"--prefetch {prefetch} is not a prefetcher; use one of {', '.join(PREFETCH_MODES)}")
    fit_rows, val_rows = split_by_sequence(trace, req.validation_fraction)
    fit, val = trace.select(fit_rows), trace.select(val_rows)
    speculation = speculation_settings(fit)
    candidates = prefetch_candidates(eviction, prefetch, speculation)
    # activations as serving capacity reserves them (passes/cost/capacity.py), so that the caches leave
    # exactly the --batch x --max-length KV cache the service then finds
    budget = memory_budget(ir, kv_per_token, req, prefill_tokens=MAX_PREFILL_TOKENS)
    masks = rank_keys(hosts)
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
        """Demand paging per rank: (results, per rank the keys it loaded, for the tier split)."""
        recorders = [LoadRecorder(make_policy(name, m)) for _ in per_rank]
        runs = [simulate_demand(s, c, rec, resident=r) for s, c, r, rec in zip(per_rank, capacities, residents, recorders)]
        return runs, [rec.loaded for rec in recorders]

    mix_hits = {w: sum(x.hits for x in hits("moeplan", model.with_mix(w))[0]) for w in MIXES}
    model = model.with_mix(max(MIXES, key=lambda w: (mix_hits[w], -w)))
    results, demand_loaded = {}, {}
    for name in RUNTIME_POLICIES:
        results[name], demand_loaded[name] = hits(name, model)
    total = {name: sum(x.hits for x in rs) for name, rs in results.items()}
    best_demand = max(RUNTIME_POLICIES, key=lambda p: (total[p], -RUNTIME_POLICIES.index(p)))
    candidates = [(m, ev or best_demand) for m, ev in candidates]
    E = ir.moe_stages[0].num_experts
    host_bytes, disk_bytes = runtime_expert_bytes(ir, req.hardware), int(ir.moe_stages[0].expert_param_bytes)
    host = host_tiers(masks, popularity, req, ranks_per_node, host_bytes)
    timed, loaded, timings_of, eamc = {}, {}, {}, None
    hosts = host_compute_options(req, ir.architecture) if prefetch != "none" or req.host_compute == "cheaper" else (False,)
    if prefetch != "none" or True in hosts:  # --prefetch none (and no host compute) plans exactly as before prefetch existed
        eamc = build_eamc(fit, val, seed=req.seed).eamc if any(m == "moe-infinity" for m, _ in candidates) else None
        for on_host in hosts:
            timing = Timing.from_dict(timing_for(ir, req.hardware, host_compute=on_host).to_dict())  # what the plan stores
            timings = [rank_timing({"timing": timing.to_dict(), "host": host}, r, E) for r in range(len(masks))]
            for m, ev in candidates:
                label = variant_label(m, on_host)
                timings_of[label] = timing
                depths = (1, 2) if m == "speculative" and speculation["depth"] >= 2 else (1,)
                for depth in depths:  # l+2 only where it pays
                    run, moved = price_prefetcher(m, ev, per_rank, capacities, residents, masks, model, timings, eamc, depth,
                                                  speculation)
                    if label not in timed or run["seconds_per_token"] < timed[label]["seconds_per_token"]:
                        timed[label], loaded[label] = run, moved
    label = min(timed, key=lambda m: (timed[m]["seconds_per_token"], variant_order(m))) if timed else "none"
    mode, on_host = parse_variant(label)
    chosen = timed[label]["eviction"] if timed else candidates[0][1]
    requests = sum(x.requests for x in results[chosen])
    moved, computed = loaded[label] if label in loaded else (demand_loaded[chosen], None)  # demand paging: the chosen policy's
    split = tier_totals(moved, [pair_keys(tier, E) for tier in host["resident"]], disk_bytes, host_bytes, computed)
    say(f"expert caches: {capacities} of {[int(m.sum()) for m in masks]} experts per rank, eviction {chosen}, prefetch {mode}, "
        f"host compute {'cheaper' if on_host else 'never'}; host tier {host['capacity']} experts per rank")
    tokens = max(stream.num_tokens, 1)
    communication = {"capacity": capacities, "eviction": chosen, "prefetch": mode, **host_compute_record(on_host),
                     "resident": [[[k // E, k % E] for k in r] for r in residents],
                     "memory": budget, "policy_model": model.to_dict(),
                     "runtime_expert_bytes": host_bytes, "disk_expert_bytes": disk_bytes, "host": host}
    if mode != "none" or on_host:  # what the runtime's stepper needs besides the policy
        communication["timing"] = timings_of[label].to_dict()
    if mode == "moe-infinity":
        communication["eamc"] = eamc.tolist()
    if mode == "speculative":
        communication["speculation"] = dict(speculation, depth=timed[label]["depth"])
    predicted = {"hit_ratio": total[chosen] / requests if requests else 0.0,
                 "hit_ratio_by_rank": [x.hit_ratio for x in results[chosen]],
                 "policies": {name: total[name] / requests if requests else 0.0 for name in RUNTIME_POLICIES},
                 "validation_tokens": stream.num_tokens,
                 "disk_bytes_per_token": split["disk_bytes"] / tokens, "host_bytes_per_token": split["host_bytes"] / tokens}
    if timed:  # with prefetch the hits are the timed run's (prefetched keys hit too)
        predicted.update(hit_ratio=timed[label]["hit_ratio"], hit_ratio_by_rank=timed[label]["hit_ratio_by_rank"],
                         seconds_per_token=timed[label]["seconds_per_token"], prefetch=timed, hardware=req.hardware.name)
    return {"communication": communication, "predicted": predicted}
