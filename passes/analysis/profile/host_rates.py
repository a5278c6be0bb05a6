"""The host CPU's rates for computing one expert (host compute on a miss, docs/offload.md): what
`moeplan calibrate` writes as host_memory_bytes_per_s and host_flops_per_s, and what the GPU check
(benchmarks/gpu/offload_check.py) measures beside a profile's figures.

All cores, float32, an expert of Qwen3-30B-A3B's width (a SwiGLU of hidden 2048 and width 768:
three matrices, 18 MiB). One decode row through it is memory-bound: bytes / time is the rate the
host reads an expert's weights. 256 rows are compute-bound: FLOPs / time is its matmul rate.
Medians of timed calls after two warm-ups, so a loaded machine's outliers do not decide.
"""
from __future__ import annotations

import os
import time

HIDDEN, WIDTH, ROWS = 2048, 768, 256


def median_seconds(fn, reps: int) -> float:
    fn()
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def measure_host_experts() -> dict:
    """{"host_memory_bytes_per_s", "host_flops_per_s"} of this machine (module docstring)."""
    import torch

    before = torch.get_num_threads()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    torch.set_num_threads(max(1, cores))
    try:
        gen = torch.Generator().manual_seed(0)
        gate, up = torch.randn(WIDTH, HIDDEN, generator=gen), torch.randn(WIDTH, HIDDEN, generator=gen)
        down = torch.randn(HIDDEN, WIDTH, generator=gen)

        def expert(x):
            return torch.nn.functional.linear(torch.nn.functional.silu(x @ gate.T) * (x @ up.T), down)

        one, many = torch.randn(1, HIDDEN, generator=gen), torch.randn(ROWS, HIDDEN, generator=gen)
        with torch.no_grad():
            row = median_seconds(lambda: expert(one), 20)
            rows = median_seconds(lambda: expert(many), 10)
    finally:
        torch.set_num_threads(before)
    weights = 3 * HIDDEN * WIDTH
    return {"host_memory_bytes_per_s": weights * 4 / row, "host_flops_per_s": ROWS * 2 * weights / rows}
