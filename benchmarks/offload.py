"""Offloading benchmark: every expert-cache policy side by side on trained models, plus prefetch.

Models: TinyMoE (examples/tiny_moe: 6 MoE layers x 16 experts, top-2) and an OLMoE-like model
(64 experts, top-8, 4 MoE layers, same code and corpus; trained by this script into
build/olmoe_like if missing: examples/tiny_moe/train.py --steps 150, ~110 CPU s).
For each model: a planning trace of the training corpus and a held-out trace of the held-out
corpus (byte tokens, 128-token sequences). For each cache size (10-50% of all (layer, expert)
entries) the offload planner plans from the planning trace (`--expert-cache`), and the held-out
stream runs through LRU, LFU, LIFO (Expert Buffer), MoE-Infinity, Belady and moeplan from the
plan's residents (demand), then the timed prefetch modes: demand only, MoE-Infinity (EAMC +
its cache priority) and moeplan, under the `a5000-pcie4` profile (MoE-Infinity's GPU) with
Switch-Large-128-sized experts (28 MB, the paper's figure; dense 16.8 MB per layer), because the
trained models' experts (KBs) would make every copy free.

    .venv/bin/python benchmarks/offload.py [--fractions 0.1 0.2 0.3 0.4 0.5] [--plan-tokens 8192]
        [--heldout-tokens 2048] [--models tiny olmoe] [--json]

`--side-by-side` (issue 33) runs instead one table of the offloading schemes at production widths:
models examples/tiny_moe, examples/qwen3_moe and transformers' OLMoE 64 x top-8 (trained by
benchmarks/speculation.py), traced with `--speculate 2` (block output) on the training corpus
(planning) and the held-out corpus; each priced at the widths of a production model of its
architecture (as benchmarks/placement_deployment.py does: examples/configs/mixtral-8x7b.json for
TinyMoE's top-2, qwen3-30b-a3b.json, olmoe-1b-7b.json, with the traced model's experts, top-k and
MoE layers; bf16 weights, every expert in host memory); hardware profiles rtx4090-pcie4 and
h100-sxm (core/hardware_data/); caches of 10, 25 and 50% of the (layer, expert)
keys; also at the trained models' own widths (`native`: KB-sized experts, where the link can carry
the speculated copies within a layer's compute; 25% cache, rtx4090-pcie4). The offload planner
plans each cache (on rtx4090-pcie4's clock; its choice is reported for that profile) on the planning trace (residents, next-use model, EAMC,
the speculative prefetcher's depth); the held-out stream then runs, side by side: demand LRU,
MoE-Infinity's prefetch (its cache priority), moeplan's prefetch (next-use eviction; also as
issue 13 modelled it, copies allowed to start before the routing that chose them), the
speculative prefetcher (next-use eviction), each with and without host compute on a miss. Per
row: seconds per token, share of requests resident at their layer start, bytes moved per token,
host-computed rows per token. The held-out stream is its first whole tokens up to --max-requests
(60,000: TinyMoE ~5,000 tokens, Qwen3-MoE ~7,500, OLMoE 64 x 8 ~940) to keep the run under an hour.

    .venv/bin/python benchmarks/offload.py --side-by-side [--models tiny qwen3 olmoe64]
        [--profiles rtx4090-pcie4 h100-sxm] [--fractions 0.1 0.25 0.5] [--tokens 8192] [--json]

`--json`: the last line is {"cases": [{"model", "fraction", "capacity", "policies": {name:
{"hit_ratio", ...}}, "belady_gap_points", "prefetch": {mode: {...}}}], "summary": {...},
"published": {...}}.
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BUILD = REPO / "build" / "offload_bench"
sys.path.insert(0, str(Path(__file__).resolve().parent))
OLMOE_DIR = REPO / "build" / "olmoe_like"
OLMOE_CONFIG = {"moeplan_loader": "model.py:load", "model_type": "tiny_moe", "vocab_size": 256, "hidden_size": 96,
                "num_layers": 4, "num_heads": 4, "num_experts": 64, "top_k": 8, "expert_hidden": 32,
                "shared_experts": 0, "max_positions": 256, "norm_eps": 1e-05}
SWITCH_LARGE = {"expert_bytes": 28_000_000, "dense_bytes_per_layer": 16_800_000}
# MoE-Infinity (early arXiv version), cache hit ratio: ours, oracle (Belady-like), best baseline
PUBLISHED = {
    "switch-large-128": {"cache": "15 GB = 535 of 3072 experts (17.4%)", "moe-infinity": 0.46, "oracle": 0.56, "best_baseline": 0.32},
    "nllb-moe-128": {"cache": "8 GB = 60 of 1536 experts (3.9%)", "moe-infinity": 0.34, "oracle": 0.43, "best_baseline": 0.21},
}
SETTING = ("published: Switch-Large-128 / NLLB-MoE-128 (encoder-decoder, top-1, 128 experts), BIGBench/FLAN/MMLU "
           "requests served in batches, GPU+DRAM tiers, prefetch counted in the hit ratio; here: small byte-level "
           "decoder-only models trained on pydoc text (top-2 of 16, top-8 of 64), batch 1 decode, demand hit ratio "
           "from the same initial residents, Belady as the oracle")


def olmoe_model() -> Path:
    """The OLMoE-like model directory, trained deterministically if its weights are missing."""
    if not (OLMOE_DIR / "model.safetensors").exists():
        OLMOE_DIR.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(REPO / "examples" / "tiny_moe" / "model.py", OLMOE_DIR / "model.py")
        (OLMOE_DIR / "config.json").write_text(json.dumps(OLMOE_CONFIG, indent=2) + "\n")
        subprocess.run([sys.executable, str(REPO / "examples" / "tiny_moe" / "train.py"), "--out", str(OLMOE_DIR),
                        "--steps", "150"], check=True)
    return OLMOE_DIR


def trace_of(model: Path, name: str, corpus: str, tokens: int) -> Path:
    """A cached routing trace of `tokens` tokens of a corpus file."""
    out = BUILD / f"{name}_{corpus}_{tokens}.npz"
    if not out.exists():
        BUILD.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "moeplan.planner.cli", "trace", str(model), "--data",
                        str(REPO / "examples" / "tiny_moe" / f"corpus_{corpus}.txt"), "--max-tokens", str(tokens),
                        "--out", str(out), "--quiet"], check=True)
    return out


def switch_large_timing():
    from moeplan.passes.optimize.offload.simulator import Timing
    from moeplan.core.hardware import load_hardware

    hw = load_hardware("a5000-pcie4")
    bw = hw.memory_bytes_per_s * hw.memory_efficiency
    b = SWITCH_LARGE["expert_bytes"]
    return hw, Timing(layer_s=hw.layer_overhead_s + SWITCH_LARGE["dense_bytes_per_layer"] / bw, expert_compute_s=b / bw,
                      pcie_copy_s=hw.copy_latency_s + b / hw.host_to_device_bytes_per_s,
                      nvme_copy_s=b / hw.disk_read_bytes_per_s, expert_bytes=b)


def run_case(model_dir: Path, plan_trace, held_stream, capacity: int, timing, hw) -> dict:
    from moeplan.passes.optimize.offload.evaluate import gap_to_belady, run_demand, run_prefetch
    from moeplan.passes.optimize.offload.cache_plan import OffloadRequest, kv_bytes_per_token, plan_offload
    from moeplan.passes.importers import load_model

    ir = load_model(str(model_dir)).ir
    body = plan_offload(ir, plan_trace, OffloadRequest(hardware=hw, expert_cache=capacity, max_sim_requests=20_000), kv_bytes_per_token(None, ir))
    E = ir.moe_stages[0].num_experts
    resident = [l * E + e for l, e in body["placement"]["resident"]]
    from moeplan.runtime.offload.next_use import NextUseModel
    import numpy as np

    model = NextUseModel.from_dict(body["communication"]["policy_model"])
    eamc = np.asarray(body["communication"]["eamc"], dtype=np.int64).reshape(-1, ir_layers(ir), E)
    demand = run_demand(held_stream, capacity, resident, model)
    prefetch = run_prefetch(held_stream, capacity, resident, model, eamc, timing)
    return {"capacity": capacity, "policies": {k: {"hit_ratio": round(v["hit_ratio"], 4), "loads": v["loads"]} for k, v in demand.items()},
            "belady_gap_points": round(gap_to_belady(demand), 2), "moeplan_mix": model.mix,
            "planner_choice": {"eviction": body["communication"]["eviction"], "prefetch": body["communication"]["prefetch"]},
            "prefetch": {k: {"resident_at_layer_start": round(v["resident_at_layer_start"], 4), "hit_ratio": round(v["hit_ratio"], 4),
                             "ms_per_token": round(v["seconds_per_token"] * 1e3, 4), "gb_moved": round(v["loads"] * timing.expert_bytes / 1e9, 3)}
                         for k, v in prefetch.items()}}


def ir_layers(ir) -> int:
    return len(ir.moe_stages)


# --- issue 33: the offloading schemes side by side at production widths ---------------------------

SIDE_MODELS = {"tiny": "mixtral", "qwen3": "qwen3_moe", "olmoe64": "olmoe"}  # model -> architecture priced
SCHEMES = (("demand LRU", "none", "lru"), ("MoE-Infinity", "moe-infinity", "moe-infinity"),
           ("moeplan prefetch", "moeplan", "moeplan"), ("speculative", "speculative", "moeplan"))
ISSUE13 = "moeplan prefetch, issue 13's model"
PUBLISHED_SIDE = {
    "mixtral-offloading": "Eliseev & Mazur, arXiv 2312.17238: Mixtral-8x7B with 4-bit attention and 2-3-bit experts, LRU "
                          "cache of k experts per layer plus speculative loading from the next layer's gate on the current "
                          "hidden state; 2-3 tokens/s on consumer GPUs (RTX 3060/3080 Mobile), ~2 tokens/s on a Colab T4 "
                          "vs 0.6 with naive offloading; LRU hit ratios ~40-60%, speculative loads correct in >80% of cases",
    "fate": "Fate, arXiv 2502.12224: Qwen1.5-MoE and DeepSeek-MoE on edge GPUs (RTX 1080 Ti class), prefetch from the "
            "previous layer's gate input ~97% accurate, expert hit rate ~99% with a shallow-favouring ARC cache and INT2/INT4 "
            "transfers; decoding up to 4.1x faster than load-on-demand, 2.2x than activation-path prefetch",
    "moe-infinity": "MoE-Infinity (early arXiv version): Switch-Base-128 99 ms/token on one GPU (batched serving), "
                    "Switch-Large-128 cache hit 46% vs oracle 56% at 17% cache, prefetch recall 55% at 256 experts",
}
SIDE_SETTING = ("published systems quantise experts (2-4 bits: 4-8x fewer bytes per copy) and run full-depth models with "
                "their own kernels; here: bf16 experts priced by the cost model on the trained small models' routing "
                "(4-8 MoE layers), batch 1 decode, one PCIe link, host compute modelled from the profile's host memory "
                "and FLOP rates; no run on the hardware (benchmarks/gpu/offload_check.sh measures one)")


def production_ir(name: str, trace):
    """The IR (meta device, no weights) of the production config of `name`'s architecture with the
    trace's experts, top-k and MoE layers (benchmarks/placement_deployment.py's table)."""
    import hashlib

    from placement_deployment import CONFIGS, PRODUCTION
    from moeplan.passes.importers import load_model

    file, experts_key, layer_keys = PRODUCTION[SIDE_MODELS[name]]
    config = {**json.loads((CONFIGS / file).read_text()), experts_key: trace.num_experts,
              "num_experts_per_tok": trace.top_k, **dict.fromkeys(layer_keys, trace.num_layers)}
    text = json.dumps(config, sort_keys=True)
    path = BUILD / f"config-{hashlib.sha256(text.encode()).hexdigest()[:12]}.json"
    BUILD.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return load_model(str(path)).ir


def run_scheme(stream, capacity, policy, timing, prefetcher, resident, causal=True) -> dict:
    """One held-out run: seconds per token, resident at layer start, bytes moved and host rows per token."""
    from moeplan.runtime.offload.stepper import TimedCache

    cache = TimedCache(stream, capacity, policy, timing, prefetcher, resident)
    cache.causal = causal
    first = [0, 0]  # requests and resident ones at each token's first MoE layer (nothing speculates them)
    stall = [0.0, 0.0]  # seconds the blocks waited for weights (copies or the host), all layers and first layers
    for s in range(len(stream.step_layer)):
        requests, resident_before = cache.requests, cache.resident_at_start
        cache.serve(s)
        waited = cache.block_done - cache.router_at - (cache.requests - requests) * timing.expert_compute_s
        stall[0] += waited
        cache.decide(s)
        if stream.step_layer[s] == 0:
            first[0] += cache.requests - requests
            first[1] += cache.resident_at_start - resident_before
            stall[1] += waited
    tokens = max(stream.num_tokens, 1)
    later = max(cache.requests - first[0], 1)
    return {"seconds_per_token": cache.now / tokens, "resident_at_layer_start": cache.resident_at_start / max(cache.requests, 1),
            "resident_after_first_layer": (cache.resident_at_start - first[1]) / later,
            "hit_ratio": cache.hits / max(cache.requests, 1), "bytes_moved_per_token": cache.loads * timing.expert_bytes / tokens,
            "host_rows_per_token": cache.host_rows / tokens, "prefetches": cache.prefetches, "prefetch_hits": cache.prefetch_hits,
            # where the time goes: waiting for weights beyond the experts' own compute (at first layers: no
            # speculation reaches them), the link's busy time, and the copies of prefetched keys never hit
            "stall_s_per_token": stall[0] / tokens, "first_layer_stall_s_per_token": stall[1] / tokens,
            "link_s_per_token": cache.loads * timing.pcie_copy_s / tokens,
            "unused_prefetch_s_per_token": (cache.prefetches - cache.prefetch_hits) * timing.pcie_copy_s / tokens}


def side_plan(plan_trace, ir, hw, capacity: int) -> dict:
    """The offload planner on the planning trace (its held-out part chooses; `hw` is the planning profile)."""
    from moeplan.passes.optimize.offload.cache_plan import OffloadRequest, kv_bytes_per_token, plan_offload

    return plan_offload(ir, plan_trace, OffloadRequest(hardware=hw, expert_cache=capacity, max_sim_requests=20_000),
                        kv_bytes_per_token(None, ir))


def side_case(name: str, body: dict, stream, ir, hw, fraction: float, capacity: int, log) -> dict:
    """Every scheme on the held-out stream for one model, profile and cache size, from the plan `body`."""
    import numpy as np

    from moeplan.runtime.offload.next_use import NextUseModel
    from moeplan.passes.optimize.offload.cache_plan import timing_for
    from moeplan.runtime.offload.policies import make_policy
    from moeplan.runtime.offload.prefetch import make_prefetcher
    from moeplan.passes.optimize.offload.simulator import simulate_demand

    E = stream.num_experts
    resident = [l * E + e for l, e in body["placement"]["resident"]]
    comm = body["communication"]
    model = NextUseModel.from_dict(comm["policy_model"])
    eamc = np.asarray(comm["eamc"], dtype=float)
    depth = body["predicted"]["prefetch"]["speculative"]["depth"]
    speculation = body["inputs_extra"]["speculation"]  # the planning part's recall weighs the copies
    timings = {host: timing_for(ir, hw, host_compute=host) for host in (False, True)}
    rows = {}
    for label, mode, eviction in SCHEMES:
        for host in (False, True):
            rows[label + (" + host compute" if host else "")] = run_scheme(
                stream, capacity, make_policy(eviction, model), timings[host],
                make_prefetcher(mode, eamc, depth=depth, speculation=speculation), resident)
    rows[ISSUE13] = run_scheme(stream, capacity, make_policy("moeplan", model), timings[False], make_prefetcher("moeplan"),
                               resident, causal=False)
    t = timings[False]
    # no copy-only scheme beats its link (at least Belady's, the fewest possible, loads one copy at a time)
    # nor its compute (every layer step and expert), even with both perfectly overlapped
    belady = simulate_demand(stream, capacity, make_policy("belady"), resident=resident)
    compute = len(stream.step_layer) * t.layer_s + stream.num_requests * t.expert_compute_s
    floor = max(belady.loads * t.pcie_copy_s, compute) / max(stream.num_tokens, 1)
    planner = comm["prefetch"] + (" + host compute" if comm.get("host_compute") else "")
    best = rows["moeplan prefetch"]["seconds_per_token"]
    per_step = stream.num_requests / max(len(stream.step_layer), 1)
    case = {"model": name, "profile": hw.name, "fraction": fraction, "capacity": capacity, "keys": stream.num_keys,
            "tokens": stream.num_tokens, "expert_mib": t.expert_bytes / 2**20, "copy_ms": t.pcie_copy_s * 1e3,
            "host_expert_ms": timings[True].host_expert_s * 1e3,
            "layer_compute_ms": (t.layer_s + per_step * t.expert_compute_s) * 1e3, "requests_per_layer": per_step,
            "speculative_depth": depth, "speculation_recall": speculation["recall"],
            "compute_s_per_token": compute / max(stream.num_tokens, 1),
            "belady_link_s_per_token": belady.loads * t.pcie_copy_s / max(stream.num_tokens, 1),
            "copy_only_floor_s_per_token": floor, "copy_only_floor_over_moeplan": floor / rows["moeplan prefetch"]["seconds_per_token"],
            "planner_choice": planner if body["hardware"] == hw.name else None, "rows": rows,
            "speculative_over_moeplan": rows["speculative"]["seconds_per_token"] / best,
            "speculative_host_over_moeplan": rows["speculative + host compute"]["seconds_per_token"] / best,
            "speculative_over_issue13_moeplan": rows["speculative"]["seconds_per_token"] / rows[ISSUE13]["seconds_per_token"]}
    log(f"{name:<8} {hw.name:<14} {fraction:>4.0%} cache {capacity:>4}/{stream.num_keys}: expert {case['expert_mib']:.3f} MiB, "
        f"copy {case['copy_ms']:.4f} ms, host {case['host_expert_ms']:.4f} ms, layer {case['layer_compute_ms']:.4f} ms; "
        f"planner: {case['planner_choice']} (depth {depth}); copy-only floor (max of Belady's loads on the link, compute) "
        f"{floor * 1e3:.4f} ms/token = x{case['copy_only_floor_over_moeplan']:.3f}")
    for label, r in rows.items():
        log(f"    {label:<36} {r['seconds_per_token'] * 1e3:9.4f} ms/token  resident {r['resident_at_layer_start']:.3f} "
            f"(after layer 0: {r['resident_after_first_layer']:.3f})  "
            f"{r['bytes_moved_per_token'] / 2**20:10.3f} MiB/token  host rows {r['host_rows_per_token']:.2f}/token  "
            f"stall {r['stall_s_per_token'] * 1e3:.4f} ms (first layer {r['first_layer_stall_s_per_token'] * 1e3:.4f})  "
            f"link {r['link_s_per_token'] * 1e3:.4f} ms (unused prefetches {r['unused_prefetch_s_per_token'] * 1e3:.4f})  "
            f"x{r['seconds_per_token'] / best:.3f}")
    return case


def side_by_side(args) -> int:
    from speculation import emit, traced

    from moeplan.passes.analysis.trace.format import load_trace
    from moeplan.core.hardware import load_hardware
    from moeplan.passes.optimize.offload.stream import build_stream

    log = (lambda m: print(m, file=sys.stderr, flush=True)) if args.json else (lambda m: print(m, flush=True))
    cases = []
    from speculation import model_dir
    from moeplan.passes.importers import load_model

    from moeplan.passes.optimize.offload.cache_plan import capped

    for name in args.models:
        plan_trace = load_trace(traced(name, "train", "block-output", 2, args.tokens))
        held = load_trace(traced(name, "heldout", "block-output", 2, args.tokens))
        stream = capped(build_stream(held), args.max_requests)
        irs = {"production": production_ir(name, held), "native": load_model(str(model_dir(name))).ir}
        for widths in args.widths:
            fractions = args.fractions if widths == "production" else [0.25]
            profiles = args.profiles if widths == "production" else args.profiles[:1]
            for fraction in fractions:
                capacity = max(1, int(round(fraction * stream.num_keys)))
                body = side_plan(plan_trace, irs[widths], load_hardware(args.profiles[0]), capacity)
                body["hardware"] = args.profiles[0]
                for profile in profiles:
                    case = side_case(name, body, stream, irs[widths], load_hardware(profile), fraction, capacity, log)
                    cases.append({"widths": widths, **case})
    summary = {f"{w}_{p}_25pct": {c["model"]: {k: round(c[k], 4) for k in ("speculative_over_moeplan", "speculative_host_over_moeplan",
                                                                           "speculative_over_issue13_moeplan")}
                                 | {"speculative_resident": round(c["rows"]["speculative"]["resident_at_layer_start"], 4),
                                    "speculative_resident_after_first_layer":
                                        round(c["rows"]["speculative"]["resident_after_first_layer"], 4),
                                    "copy_over_layer": round(c["copy_ms"] / c["layer_compute_ms"], 3),
                                    "copy_only_floor_over_moeplan": round(c["copy_only_floor_over_moeplan"], 4)}
                                 for c in cases if c["fraction"] == 0.25 and c["widths"] == w and c["profile"] == p}
               for w in args.widths for p in args.profiles}
    summary.update(target_ratio=0.6, target_resident=0.85)
    out = {"cases": cases, "summary": summary, "published": dict(PUBLISHED_SIDE, setting_difference=SIDE_SETTING)}
    emit(out, args.json, PUBLISHED_SIDE, SIDE_SETTING)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--side-by-side", action="store_true", help="issue 33's table (module docstring)")
    ap.add_argument("--models", nargs="+", default=None, choices=["tiny", "olmoe", "qwen3", "olmoe64"])
    ap.add_argument("--profiles", nargs="+", default=["rtx4090-pcie4", "h100-sxm"])
    ap.add_argument("--fractions", type=float, nargs="+", default=None)
    ap.add_argument("--tokens", type=int, default=8192, help="--side-by-side: tokens per trace")
    ap.add_argument("--max-requests", type=int, default=60_000,
                    help="--side-by-side: the held-out stream's first whole tokens holding at most this many requests")
    ap.add_argument("--widths", nargs="+", default=["production", "native"], choices=["production", "native"],
                    help="--side-by-side: price at a production model's widths, or the trained model's own")
    ap.add_argument("--plan-tokens", type=int, default=8192)
    ap.add_argument("--heldout-tokens", type=int, default=2048)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.side_by_side:
        args.models = args.models or list(SIDE_MODELS)
        args.fractions = args.fractions or [0.1, 0.25, 0.5]
        return side_by_side(args)
    args.models = args.models or ["tiny", "olmoe"]
    args.fractions = args.fractions or [0.1, 0.2, 0.3, 0.4, 0.5]
    from moeplan.passes.analysis.trace.format import load_trace
    from moeplan.passes.optimize.offload.stream import build_stream

    hw, timing = switch_large_timing()
    cases = []
    for name in args.models:
        model_dir = REPO / "examples" / "tiny_moe" if name == "tiny" else olmoe_model()
        plan_trace = load_trace(trace_of(model_dir, name, "train", args.plan_tokens))
        held = load_trace(trace_of(model_dir, name, "heldout", args.heldout_tokens))
        stream = build_stream(held)
        for frac in args.fractions:
            capacity = max(1, int(round(frac * stream.num_keys)))
            case = {"model": name, "fraction": frac, **run_case(model_dir, plan_trace, stream, capacity, timing, hw)}
            cases.append(case)
            if True:  # progress (stderr with --json, so the last stdout line stays the JSON)
                out = sys.stderr if args.json else sys.stdout
                pol = case["policies"]
                print(f"{name:<6} {frac:>4.0%} cache {capacity:>4}: " + "  ".join(f"{k} {v['hit_ratio']:.3f}" for k, v in pol.items())
                      + f"  | gap to Belady {case['belady_gap_points']:.1f} pts", file=out, flush=True)
                pre = case["prefetch"]
                print("      prefetch (Switch-Large-sized experts, a5000-pcie4): " + "  ".join(
                    f"{k}: resident {v['resident_at_layer_start']:.3f}, {v['ms_per_token']:.2f} ms/token, {v['gb_moved']:.1f} GB" for k, v in pre.items()),
                    file=out, flush=True)
    beats = all(c["policies"]["moeplan"]["hit_ratio"] > max(c["policies"][b]["hit_ratio"] for b in ("lru", "lfu", "lifo")) for c in cases)
    gaps = [c["belady_gap_points"] for c in cases]
    summary = {"moeplan_beats_lru_lfu_lifo_everywhere": beats,
               "moeplan_beats_moe_infinity_everywhere": all(c["policies"]["moeplan"]["hit_ratio"] > c["policies"]["moe-infinity"]["hit_ratio"] for c in cases),
               "mean_gap_to_belady_points": round(sum(gaps) / len(gaps), 2), "max_gap_to_belady_points": max(gaps),
               "moeplan_over_belady": round(sum(c["policies"]["moeplan"]["hit_ratio"] / c["policies"]["belady"]["hit_ratio"] for c in cases) / len(cases), 3),
               "moeplan_prefetch_speedup_vs_demand": round(sum(c["prefetch"]["none"]["ms_per_token"] / c["prefetch"]["moeplan"]["ms_per_token"] for c in cases) / len(cases), 3),
               "moeplan_prefetch_speedup_vs_moe_infinity": round(sum(c["prefetch"]["moe-infinity"]["ms_per_token"] / c["prefetch"]["moeplan"]["ms_per_token"] for c in cases) / len(cases), 3)}
    published = dict(PUBLISHED, setting_difference=SETTING,
                     moe_infinity_over_oracle={k: round(v["moe-infinity"] / v["oracle"], 3) for k, v in PUBLISHED.items()})
    if args.json:
        print(json.dumps({"cases": cases, "summary": summary, "published": published}, sort_keys=True))
        return 0
    print(f"summary: {json.dumps(summary, sort_keys=True)}")
    for k, v in PUBLISHED.items():
        print(f"published {k} ({v['cache']}): MoE-Infinity {v['moe-infinity']:.2f} vs oracle {v['oracle']:.2f} vs best baseline "
              f"{v['best_baseline']:.2f} (MoE-Infinity/oracle {v['moe-infinity'] / v['oracle']:.2f})")
    print("setting difference: " + SETTING)
    return 0


if __name__ == "__main__":
    sys.exit(main())
