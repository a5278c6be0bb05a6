"""The offload options from the flags' values (`offload_options`: the offload target's, and torchrun's
with --gpu-memory / --expert-cache), checked before any pass runs, and as plan.json's inputs record them.
"""
from __future__ import annotations

import re

from moeplan.core.errors import UserError

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)

_UNITS = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}

def parse_bytes(text: str, option: str = "--gpu-memory") -> int:
    """'25769803776', '24GiB', '24GB' (10^9), '16g' -> bytes; UserError otherwise."""
    m = _SIZE.match(str(text))
    if not m:
        raise UserError(f"{option} {text!r} is not a size; give bytes (25769803776) or a unit (24GiB, 24GB)")
    unit = (m.group(2) or "").lower().rstrip("b")
    return int(float(m.group(1)) * _UNITS[unit])


def offload_options(values: dict, target: str = "offload"):
    """The pipeline's `offload_options` from the flags' values; None for torchrun/kubernetes without
    --gpu-memory/--expert-cache (no expert cache). Bad values are UserErrors."""
    gpu_memory, expert_cache, prefetch = values["gpu_memory"], values["expert_cache"], values["prefetch"]
    host_compute = None if values.get("host_compute") in (None, "auto") else values["host_compute"]
    if target != "offload" and gpu_memory is None and expert_cache is None:
        for flag, name in (("eviction", "--eviction"), ("host_memory", "--host-memory"), ("prefetch", "--prefetch")):
            if values[flag] is not None:
                raise UserError(f"{name} needs --gpu-memory BYTES or --expert-cache N (an expert cache to serve)")
        if host_compute is not None:
            raise UserError("--host-compute needs --gpu-memory BYTES or --expert-cache N (an expert cache to serve)")
        return None
    if prefetch is not None:  # a pair that cannot run stops here, before any pass (the trace's speculation comes later)
        from moeplan.passes.optimize.offload.rank_caches import prefetch_candidates

        prefetch_candidates(values["eviction"], prefetch, trace_known=False)
    if (gpu_memory is None) == (expert_cache is None):
        raise UserError(f"--target {target} needs exactly one of --gpu-memory BYTES or --expert-cache N")
    for name, value in (("--batch", values["batch"]), ("--max-length", values["max_length"])):
        if value < 1:
            raise UserError(f"{name} must be at least 1, got {value}")
    prompt_tokens = 0 if values["prompt_tokens"] is None else values["prompt_tokens"]  # (lambda's default differs)
    if prompt_tokens < 0:
        raise UserError(f"--prompt-tokens must be 0 or more, got {prompt_tokens}")
    if not 0 < values["validation_fraction"] < 1:
        raise UserError(f"--validation-fraction must be between 0 and 1, got {values['validation_fraction']}")
    options = {"gpu_memory_bytes": parse_bytes(gpu_memory) if gpu_memory is not None else None,
               "expert_cache": expert_cache, "hardware": values["hardware"] if target == "offload" else None,
               "batch": values["batch"],
               "host_memory_bytes": parse_bytes(values["host_memory"], "--host-memory") if values["host_memory"] is not None else None,
               "max_length": values["max_length"], "prompt_tokens": prompt_tokens,
               "validation_fraction": values["validation_fraction"], "seed": values["seed"]}
    if target != "offload":  # the bundle's policy and prefetcher; --target offload compares them all
        options.update(eviction=values["eviction"], prefetch=prefetch)
    if host_compute is not None:  # auto (the default) is recorded by leaving it out: plans keep their bytes
        options["host_compute"] = host_compute
    return options


def recorded_options(o: dict) -> dict:
    """The offload options as plan.json's inputs record them: `prefetch` only when it prefetches
    (so that --prefetch none plans byte for byte as before the flag existed)."""
    return {k: v for k, v in o.items() if not (k == "prefetch" and v in (None, "none"))}
