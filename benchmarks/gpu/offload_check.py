"""The offloading runtime on a real GPU (issue 33, item 5): the CUDA copy path issue 13 wrote but
never ran (pinned host memory, copies on a side stream ordered by events), the speculative
prefetcher and host compute on a miss, each run verified (logits and tokens against the library's
model, measured cache counters == the simulator's replay) and its measured wall seconds per token
written beside the seconds the plan's clock models for the same tokens.

Run by benchmarks/gpu/offload_check.sh on a machine with a CUDA GPU (never in CI). Steps, all
through the real CLI from this checkout:
1. the machine: GPU, torch, and three rates measured here beside the offload profile's: pinned
   host -> device copy bandwidth, device memory bandwidth, the host's expert rates
   (`passes/analysis/profile/host_rates.py`, what `moeplan calibrate` measures);
2. two models: examples/qwen3_moe (trained; small experts) and a wide Qwen3-MoE built here with
   seeded random weights at Qwen3-30B-A3B's expert width (hidden 2048, expert 768: 18 MiB per
   float32 expert; 4 MoE layers x 16 experts, top-4), so that a copy takes real PCIe time;
3. each traced with `--speculate 2` on the training corpus;
4. per model one `moeplan plan --target torchrun --expert-cache C` (a quarter of the keys, moeplan
   eviction, the speculative prefetcher's settings); per scheme (demand, demand + host compute,
   moeplan prefetch, speculative, speculative + host compute) a copy of it with that prefetcher,
   that rule and the clock of this GPU's offload profile (h100-sxm, h200-sxm or a100-sxm), then
   `moeplan codegen` and `moeplan run --verify` on 4 prompts x 32 new tokens;
5. $OUT/offload_check.json: per run verified, matches_simulation, the counters, measured wall and
   modelled seconds per token and their ratio; $OUT/summary.txt the same as a table.

On a machine without CUDA it still runs end to end (`--allow-cpu`, smaller): a dry run of the
script, whose seconds mean nothing.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CORPUS = REPO / "examples" / "tiny_moe" / "corpus_train.txt"
PROMPTS = ["The module defines a class that", "def read(path):\n    with open(path) as f:",
           "Keyword arguments are passed", "Return the number of items in"]
SCHEMES = (("none", "never"), ("none", "cheaper"), ("moeplan", "never"), ("speculative", "never"),
           ("speculative", "cheaper"))
PROFILE_OF = (("H200", "h200-sxm"), ("H100", "h100-sxm"), ("A100", "a100-sxm"))


def cli(args: list, log, timeout: int = 900) -> str:
    """`moeplan ARGS` from this checkout; its stdout (stderr goes to the log)."""
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "moeplan.planner.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout)
    log(f"$ moeplan {' '.join(map(str, args))}  ({time.perf_counter() - t0:.1f} s, exit {proc.returncode})")
    if proc.returncode != 0:
        log(proc.stdout[-2000:] + proc.stderr[-4000:])
        raise RuntimeError(f"moeplan {args[0]} failed")
    return proc.stdout


def measure_machine(device) -> dict:
    """Rates measured here, beside the profile's."""
    import torch

    from moeplan.passes.analysis.profile.host_rates import measure_host_experts

    out = {"torch": torch.__version__, "device": str(device), "cpu_cores": os.cpu_count()}
    if device.type == "cuda":
        out["gpu"] = torch.cuda.get_device_name(device)
        host = torch.empty(64 << 20, dtype=torch.uint8).pin_memory()
        dev = torch.empty_like(host, device=device)
        stream = torch.cuda.Stream(device)
        for _ in range(3):
            with torch.cuda.stream(stream):
                dev.copy_(host, non_blocking=True)
        stream.synchronize()
        t0 = time.perf_counter()
        for _ in range(10):
            with torch.cuda.stream(stream):
                dev.copy_(host, non_blocking=True)
        stream.synchronize()
        out["pinned_h2d_bytes_per_s"] = 10 * host.numel() / (time.perf_counter() - t0)
        big = torch.empty(1 << 30, dtype=torch.uint8, device=device)
        other = torch.empty_like(big)
        other.copy_(big)
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(10):
            other.copy_(big)
        torch.cuda.synchronize(device)
        out["device_copy_bytes_per_s"] = 2 * 10 * big.numel() / (time.perf_counter() - t0)  # read + write
        del big, other, dev
    out.update(measure_host_experts())
    return out


def wide_model(directory: Path, layers: int, experts: int, top_k: int, hidden: int, expert: int) -> Path:
    """A Qwen3-MoE with seeded random weights at a production expert width (tokenizer: the example's)."""
    import shutil

    import torch
    import transformers

    if (directory / "model.safetensors").is_file() or (directory / "model.safetensors.index.json").is_file():
        return directory
    config = transformers.Qwen3MoeConfig(
        vocab_size=384, hidden_size=hidden, intermediate_size=2 * expert, moe_intermediate_size=expert,
        num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=4, head_dim=hidden // 16,
        num_experts=experts, num_experts_per_tok=top_k, norm_topk_prob=True, max_position_embeddings=512,
        tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(directory)
    shutil.copy(REPO / "examples" / "qwen3_moe" / "tokenizer.json", directory / "tokenizer.json")
    return directory


def clock_for(plan: dict, profile: str, host: bool) -> dict:
    """The plan's expert-cache timing on `profile` (the offload planner's own `timing_for`)."""
    from moeplan.core.hardware import load_hardware
    from moeplan.passes.optimize.offload.cache_plan import timing_for
    from moeplan.core.ir import ModelIR

    ir = ModelIR.from_dict(plan["model"]["ir"])
    return timing_for(ir, load_hardware(profile), host_compute=host).to_dict()


def base_plan(model: Path, trace: Path, work: Path, capacity: int, log) -> dict:
    """One plan per model (moeplan eviction, the speculative prefetcher's settings); the schemes differ
    only in the prefetcher and the host compute rule written into copies of it."""
    plan_file = work / f"{model.name}-base.json"
    cli(["plan", model, "--trace", trace, "--target", "torchrun", "--policy", "contiguous", "--mode", "standard",
         "--nodes", "1", "--gpus-per-node", "1", "--expert-cache", capacity, "--eviction", "moeplan",
         "--prefetch", "speculative", "--host-compute", "never", "--out", plan_file, "--quiet", "--force"], log)
    return json.loads(plan_file.read_text())


def one_run(model: Path, base: dict, work: Path, prefetch: str, host: str, capacity: int, profile: str,
            prompts: Path, new_tokens: int, log) -> dict:
    name = f"{model.name}-{prefetch}-{host}"
    plan_file = work / f"{name}.json"
    plan = json.loads(json.dumps(base))
    spec = plan["communication"]["expert_cache"]
    spec["prefetch"] = prefetch
    if prefetch != "speculative":
        spec.pop("speculation", None)
    spec["timing"] = clock_for(plan, profile, host == "cheaper")
    spec.pop("host_compute", None)
    if host == "cheaper":
        spec["host_compute"] = "cheaper"
    plan_file.write_text(json.dumps(plan))
    bundle = work / name
    cli(["codegen", plan_file, "--out", bundle, "--force"], log)
    results = work / f"{name}-results"
    report = json.loads(cli(["run", bundle, "--verify", "--mode", "standard", "--new-tokens", new_tokens,
                             "--prompts", prompts, "--results", results, "--json"], log).strip().splitlines()[-1])
    cache = report["expert_cache"]
    t = cache["seconds_per_token"]
    row = {"model": model.name, "prefetch": prefetch, "host_compute": host, "capacity": capacity, "profile": profile,
           "verified": report["verified"], "max_abs_logit_diff": report["max_abs_logit_diff"],
           "matches_simulation": cache["matches_simulation"], "requests_match_routing": cache["requests_match_routing"],
           "measured": {k: cache["measured"][k] for k in ("requests", "hits", "loads", "prefetches", "prefetch_hits",
                                                           "resident_at_layer_start", "host_computed", "host_rows",
                                                           "bytes_moved", "prefetch_waits", "prefetch_wait_s")},
           "measured_wall_s_per_forward": t["measured_wall"], "modelled_s_per_forward": t["modelled_for_these_tokens"],
           "speculation": spec.get("speculation"), "timing": spec["timing"]}
    row["measured_over_modelled"] = (t["measured_wall"] / t["modelled_for_these_tokens"]
                                     if t["modelled_for_these_tokens"] else None)
    log(f"  {name}: verified {row['verified']}, matches {row['matches_simulation']}, wall {t['measured_wall'] * 1e3:.2f} "
        f"ms/forward, modelled {(t['modelled_for_these_tokens'] or 0) * 1e3:.2f} ms/forward")
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", str(REPO / "build" / "gpu_offload_check")))
    ap.add_argument("--work", default="/tmp/moeplan_offload_check")
    ap.add_argument("--allow-cpu", action="store_true", help="run without CUDA (a dry run: the seconds mean nothing)")
    ap.add_argument("--trace-tokens", type=int, default=4096)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--wide", default="4,16,4,2048,768", help="layers,experts,top_k,hidden,expert width of the wide model")
    ap.add_argument("--models", nargs="+", choices=("qwen3_moe", "wide"), default=["qwen3_moe", "wide"],
                    help="which models to run (a short lease: wide alone, whose copies take real PCIe time)")
    args = ap.parse_args(argv)
    import torch

    out, work = Path(args.out), Path(args.work)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    log_file = (out / "log.txt").open("w")

    def log(msg: str) -> None:
        print(msg, flush=True)
        log_file.write(msg + "\n")
        log_file.flush()

    cuda = torch.cuda.is_available()
    if not cuda and not args.allow_cpu:
        log("error: no CUDA device here; run this on a GPU machine (or pass --allow-cpu for a dry run)")
        return 2
    device = torch.device("cuda:0" if cuda else "cpu")
    machine = measure_machine(device)
    gpu = machine.get("gpu", "")
    profile = next((p for key, p in PROFILE_OF if key in gpu), "h100-sxm")
    machine["profile"] = profile
    from moeplan.core.hardware import load_hardware

    machine["profile_rates"] = load_hardware(profile).to_dict()
    log("machine: " + json.dumps(machine, sort_keys=True))
    (out / "machine.json").write_text(json.dumps(machine, indent=1, sort_keys=True))
    prompts = work / "prompts.txt"
    prompts.write_text("\n".join(p.replace("\n", " ") for p in PROMPTS) + "\n")
    layers, experts, top_k, hidden, width = (int(x) for x in args.wide.split(","))
    models = ([REPO / "examples" / "qwen3_moe"] if "qwen3_moe" in args.models else []) + \
        ([wide_model(work / "wide_qwen3_moe", layers, experts, top_k, hidden, width)] if "wide" in args.models else [])
    rows = []
    for model in models:
        trace = work / f"{model.name}.npz"
        cli(["trace", model, "--data", CORPUS, "--max-tokens", args.trace_tokens, "--speculate", "2", "--out", trace,
             "--quiet", "--force"], log)
        stats = json.loads(cli(["trace", "stats", trace, "--json"], log))
        log(f"{model.name}: speculation recall {stats['speculation_recall']}")
        keys = stats["num_layers"] * stats["num_experts"]
        base = base_plan(model, trace, work, max(1, keys // 4), log)
        for prefetch, host in SCHEMES:
            try:
                rows.append(one_run(model, base, work, prefetch, host, max(1, keys // 4), profile, prompts,
                                    args.new_tokens, log))
                rows[-1]["speculation_recall"] = stats["speculation_recall"]
            except (RuntimeError, subprocess.TimeoutExpired) as exc:
                rows.append({"model": model.name, "prefetch": prefetch, "host_compute": host, "error": str(exc)})
            (out / "offload_check.json").write_text(json.dumps({"machine": machine, "runs": rows}, indent=1, sort_keys=True))
    lines = [f"{'model':<16} {'prefetch':<12} {'host':<8} {'ok':<5} {'hits/req':>10} {'on host':>8} {'wall ms':>9} "
             f"{'model ms':>9} {'wall/model':>10}"]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['model']:<16} {r['prefetch']:<12} {r['host_compute']:<8} error: {r['error']}")
            continue
        m = r["measured"]
        ok = r["verified"] and r["matches_simulation"] and r["requests_match_routing"]
        modelled = r["modelled_s_per_forward"] or 0.0
        lines.append(f"{r['model']:<16} {r['prefetch']:<12} {r['host_compute']:<8} {str(ok):<5} "
                     f"{m['hits']:>4}/{m['requests']:<5} {m['host_computed']:>8} {r['measured_wall_s_per_forward'] * 1e3:>9.3f} "
                     f"{modelled * 1e3:>9.3f} {r['measured_over_modelled'] or 0:>10.2f}")
    (out / "summary.txt").write_text("\n".join(lines) + "\n")
    log("\n".join(lines))
    return 0 if all("error" not in r and r["verified"] and r["matches_simulation"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
