"""`moeplan plan MODEL --trace T --target offload (--gpu-memory BYTES | --expert-cache N)`: plan one
GPU whose experts do not all fit (expert cache, residents, eviction, prefetch, tiers); see
passes/optimize/offload/plan.py. Prints the decisions; `--json` prints a summary as one JSON line.
"""
from __future__ import annotations

import json
import re
import time

import click

from moeplan.planner.errors import UserError

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def parse_bytes(text: str, option: str = "--gpu-memory") -> int:
    """'25769803776', '24GiB', '24GB' (10^9), '16g' -> bytes; UserError otherwise."""
    m = _SIZE.match(str(text))
    if not m:
        raise UserError(f"{option} {text!r} is not a size; give bytes (25769803776) or a unit (24GiB, 24GB)")
    unit = (m.group(2) or "").lower().rstrip("b")
    return int(float(m.group(1)) * _UNITS[unit])


OFFLOAD_FLAGS = ("gpu_memory", "expert_cache", "host_memory", "serve_batch", "max_length", "prompt_tokens", "eviction",
                 "prefetch")
EVICTIONS = ("moeplan", "lru", "lfu", "lifo", "moe-infinity")
PREFETCHES = ("none", "moeplan", "moe-infinity")


def offload_options(f):
    """The options only `--target offload` reads (--hardware is the cost model's option: one profile
    system, planner/hardware.py; the offload target's default profile is rtx4090-pcie4)."""
    options = [
        click.option("--gpu-memory", default=None, help="offload: GPU memory for the model, bytes or e.g. 24GiB"),
        click.option("--expert-cache", type=int, default=None, help="offload: expert cache entries ((layer, expert) pairs) instead of --gpu-memory"),
        click.option("--host-memory", default=None,
                     help="offload: host memory for the experts' host tier, bytes or e.g. 48GiB, per machine (shared by "
                          "its ranks); the rest are read from disk on every load (default: the hardware profile's host "
                          "memory less 8 GiB)"),
        click.option("--batch", "serve_batch", type=int, default=1, show_default=True, help="offload: sequences served at once (KV cache sizing)"),
        click.option("--max-length", type=int, default=4096, show_default=True, help="offload: tokens per sequence (KV cache sizing)"),
        click.option("--prompt-tokens", type=int, default=0, show_default=True, help="offload: first P tokens of a sequence are one prefill step"),
        click.option("--eviction", type=click.Choice(EVICTIONS), default=None,
                     help="torchrun/kubernetes with --gpu-memory/--expert-cache: the ranks' eviction policy "
                          "(default: the best on held-out sequences)"),
        click.option("--prefetch", type=click.Choice(PREFETCHES), default=None,
                     help="torchrun/kubernetes with --gpu-memory/--expert-cache: the ranks' prefetcher (none: demand "
                          "paging only; default: the fastest on held-out sequences; docs/offload.md)"),
    ]
    for opt in reversed(options):
        f = opt(f)
    return f


def offload_request(flags: dict, validation_fraction: float, seed: int, hardware=None, target: str = "offload"):
    """The pipeline's `offload_options` from the offload flags; None for torchrun/kubernetes without
    --gpu-memory/--expert-cache (no expert cache). Bad values are UserErrors."""
    gpu_memory, expert_cache = flags["gpu_memory"], flags["expert_cache"]
    prefetch = flags.get("prefetch")
    if target != "offload" and gpu_memory is None and expert_cache is None:
        for flag, name in (("eviction", "--eviction"), ("host_memory", "--host-memory"), ("prefetch", "--prefetch")):
            if flags.get(flag) is not None:
                raise UserError(f"{name} needs --gpu-memory BYTES or --expert-cache N (an expert cache to serve)")
        return None
    if target == "offload" and flags["eviction"] is not None:
        raise UserError("--eviction sets a bundle's policy (compile --target torchrun); --target offload compares them all")
    if target == "offload" and prefetch is not None:
        raise UserError("--prefetch sets a bundle's prefetcher (compile --target torchrun); --target offload compares them all")
    if prefetch is not None:  # a pair that cannot run stops here, before any pass
        from moeplan.passes.optimize.offload.ranks import prefetch_candidates

        prefetch_candidates(flags["eviction"], prefetch)
    if (gpu_memory is None) == (expert_cache is None):
        raise UserError(f"--target {target} needs exactly one of --gpu-memory BYTES or --expert-cache N")
    for name, value in (("--batch", flags["serve_batch"]), ("--max-length", flags["max_length"])):
        if value < 1:
            raise UserError(f"{name} must be at least 1, got {value}")
    if flags["prompt_tokens"] < 0:
        raise UserError(f"--prompt-tokens must be 0 or more, got {flags['prompt_tokens']}")
    if not 0 < validation_fraction < 1:
        raise UserError(f"--validation-fraction must be between 0 and 1, got {validation_fraction}")
    return {"gpu_memory_bytes": parse_bytes(gpu_memory) if gpu_memory is not None else None,
            "expert_cache": expert_cache, "hardware": hardware, "batch": flags["serve_batch"],
            "host_memory_bytes": parse_bytes(flags["host_memory"], "--host-memory") if flags["host_memory"] is not None else None,
            "max_length": flags["max_length"], "prompt_tokens": flags["prompt_tokens"],
            "validation_fraction": validation_fraction, "seed": seed, "eviction": flags["eviction"],
            "prefetch": prefetch}


def plan_offload_command(model, trace_path, out, validation_fraction, seed, as_json, quiet, *, hardware, **flags):
    from moeplan.planner.atomic import write_text_atomic
    from moeplan.planner.pass_manager import PassManager
    from moeplan.planner.pipeline.offload import PASSES

    options = offload_request(flags, validation_fraction, seed, hardware)
    options.pop("eviction")
    options.pop("prefetch", None)
    say = (lambda msg: None) if quiet or as_json else (lambda msg: click.echo(msg, err=True))
    t0 = time.perf_counter()
    facts = PassManager(PASSES, quiet=True).run({"model_spec": str(model), "trace_path": str(trace_path),
                                                 "offload_options": options, "progress": say})
    the_plan = facts["plan"]
    write_text_atomic(out, the_plan.to_json())
    p, c = the_plan.predicted, the_plan.communication
    summary = {"out": str(out), "expert_cache": c["expert_cache"], "total_experts": c["memory"]["total_experts"],
               "eviction": c["eviction"], "prefetch": c["prefetch"], "hit_ratio": p["hit_ratio"],
               "seconds_per_token": p["seconds_per_token"], "belady_gap_points": p["belady_gap_points"],
               "seconds": round(time.perf_counter() - t0, 3)}
    if as_json:
        click.echo(json.dumps(summary, sort_keys=True))
        return
    if quiet:
        return
    m = c["memory"]
    click.echo(f"wrote {out}: expert cache {c['expert_cache']} of {m['total_experts']} experts "
               f"({m['expert_bytes'] / 2**20:.1f} MiB each), eviction {c['eviction']}, prefetch {c['prefetch']}")
    click.echo(f"GPU memory: dense {m['dense_bytes'] / 2**30:.2f} GiB, KV {m['kv_cache_bytes'] / 2**30:.2f} GiB, "
               f"activations {m['activation_bytes'] / 2**30:.2f} GiB, reserve {m['reserve_bytes'] / 2**30:.2f} GiB; "
               f"tiers: host {c['tiers']['host_experts']} experts, disk {c['tiers']['disk_experts']}")
    click.echo(f"predicted on held-out sequences: hit ratio {p['hit_ratio']:.3f} (Belady {p['policies']['belady']['hit_ratio']:.3f}), "
               f"{p['seconds_per_token'] * 1e3:.3f} ms/token, {p['resident_at_layer_start']:.3f} resident at layer start")
    click.echo(f"planning took {summary['seconds']:.1f} s")
