"""`moeplan calibrate --out FILE`: measure this machine into a cpu-gloo hardware profile.

Why: the cost model's CPU predictions are only as good as its constants, and a CPU's matmul rate,
framework overhead and gloo latency depend on the machine and its load. A short micro-benchmark
(about a minute): one-thread matmul throughput, the time of one small torch op, a large copy,
and gloo `all_to_all_single` over loopback at 2 and 4 ranks (small messages for latency, large
for bandwidth), the same call the runtime makes. The YAML it writes has the keys of
`planner/hardware_data/*.yaml`, each with its source; pass it to `compile --hardware FILE`.
"""
from __future__ import annotations

import os
import socket
import time

import click

from moeplan.planner.errors import UserError

WORLDS = (2, 4)
SMALL_REPS = 60
LARGE_BYTES = 1 << 21  # per peer


def _best_per_call(fn, reps: int) -> float:
    """Median of `reps` timed calls after two warm-ups (median: robust on a loaded machine)."""
    fn()
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    times.sort()
    return times[len(times) // 2]


ENGINE_MIX_OPS = 18


def _engine_mix(torch, F, x, w, idx):
    """18 calls of the kinds the runtime engine makes on a few rows (norm, linear, gathers, packing)."""
    h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
    y = F.linear(h, w)
    z = F.silu(y) * y
    m = (idx == 2).nonzero().flatten()
    out = torch.zeros_like(x).index_add(0, idx, x[idx])
    parts = torch.split(torch.cat([out, x], dim=0), [4, 12], dim=0)
    return torch.tensor(m.tolist(), dtype=torch.int64), z, parts


def measure_compute() -> dict:
    """One thread: matmul FLOP/s (256 x 256 x 256 float32), one engine-like op, copy bandwidth."""
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(1)
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    mm = _best_per_call(lambda: a @ b, 30)
    x, w, idx = torch.randn(8, 128), torch.randn(64, 128), torch.tensor([0, 2, 4])
    op = _best_per_call(lambda: _engine_mix(torch, F, x, w, idx), 200) / ENGINE_MIX_OPS
    big = torch.randn(1 << 22)
    copy = _best_per_call(lambda: big.clone(), 10)
    return {"flops_per_s": 2 * 256 ** 3 / mm, "op_overhead_s": op, "memory_bytes_per_s": 2 * big.numel() * 4 / copy}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, queue) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        out = {}
        for label, per_peer in (("small", 2), ("kilo", 256), ("large", LARGE_BYTES // 4)):
            send = torch.zeros(world * per_peer)
            recv = torch.empty_like(send)
            reps = SMALL_REPS if label != "large" else 8

            def call():
                dist.all_to_all_single(recv, send)

            dist.barrier()
            out[label] = _best_per_call(call, reps)
        if rank == 0:
            queue.put(out)
    finally:
        dist.destroy_process_group()


def measure_gloo(world: int) -> dict:
    """Median seconds per all_to_all_single call at 8 B, 1 KiB and 2 MiB per peer among `world` ranks."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, queue)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        result = queue.get(timeout=300)
    finally:
        for p in procs:
            p.join(timeout=60)
    if any(p.exitcode != 0 for p in procs):
        raise UserError(f"the gloo micro-benchmark at {world} ranks failed; check that loopback TCP works")
    return result


def calibrate() -> dict:
    """The cpu-gloo profile of this machine, as a YAML-ready dict."""
    compute = measure_compute()
    gloo = {w: measure_gloo(w) for w in WORLDS}
    lo, hi = WORLDS
    per_peer = max((gloo[hi]["small"] - gloo[lo]["small"]) / (hi - lo), 1e-7)
    base = max(gloo[lo]["small"] - per_peer * (lo - 1), 1e-7)
    message = max((gloo[lo]["kilo"] - gloo[lo]["small"]) / (lo - 1), 1e-7)
    bandwidth = LARGE_BYTES * (lo - 1) / max(gloo[lo]["large"] - gloo[lo]["small"], 1e-9)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    measured = (f"moeplan calibrate on this machine ({cores} cores): median of timed calls")
    return {
        "name": "cpu-gloo",
        "flops_per_s": float(f"{compute['flops_per_s']:.4g}"),
        "memory_bytes_per_s": float(f"{compute['memory_bytes_per_s']:.4g}"),
        "op_overhead_s": float(f"{compute['op_overhead_s']:.4g}"),
        "parallel_ranks": cores,
        "collective_latency_base_s": float(f"{base:.4g}"),
        "collective_latency_per_peer_s": float(f"{per_peer:.4g}"),
        "bandwidth_bytes_per_s": {"same_node": float(f"{bandwidth:.4g}"), "other_node": float(f"{bandwidth:.4g}")},
        "message_latency_s": {"same_node": float(f"{message:.4g}"), "other_node": float(f"{message:.4g}")},
        "sources": {
            "flops_per_s": f"{measured}, 256x256x256 float32 matmul, one thread",
            "memory_bytes_per_s": f"{measured}, clone of 16 MiB",
            "op_overhead_s": f"{measured}, a mix of {ENGINE_MIX_OPS} engine-like calls on 8 x 128 rows, per call",
            "parallel_ranks": "os.sched_getaffinity (cores this process may use)",
            "collective_latency_base_s": f"{measured}, gloo all_to_all_single 8 B per peer at {lo} and {hi} ranks",
            "collective_latency_per_peer_s": f"{measured}, slope between {lo} and {hi} ranks",
            "bandwidth_bytes_per_s": f"{measured}, 2 MiB per peer at {lo} ranks over loopback (both tiers: one machine)",
            "message_latency_s": f"{measured}, 1 KiB minus 8 B per peer at {lo} ranks",
        },
    }


@click.command("calibrate")
@click.option("--out", required=True, type=click.Path(dir_okay=False), help="YAML profile to write (cpu-gloo keys)")
@click.option("--json", "as_json", is_flag=True, help="print the profile as one JSON object")
def calibrate_cmd(out, as_json):
    """Measure matmul rate, op overhead and gloo all-to-all latency/bandwidth into a hardware profile."""
    import json
    from pathlib import Path

    import yaml

    from moeplan.planner.atomic import write_text_atomic
    from moeplan.planner.hardware import profile_from_dict

    path = Path(out)
    if path.exists() and not path.is_file():
        raise UserError(f"--out '{path}' is not a file; give a YAML file path")
    data = calibrate()
    profile_from_dict(data, str(path))  # what we write must load
    header = "# cpu-gloo hardware profile written by `moeplan calibrate` (this machine; re-run to refresh).\n"
    write_text_atomic(path, header + yaml.safe_dump(data, sort_keys=False))
    if as_json:
        click.echo(json.dumps(data, sort_keys=True))
    else:
        click.echo(f"wrote {path}: matmul {data['flops_per_s'] / 1e9:.1f} GFLOP/s, op {data['op_overhead_s'] * 1e6:.1f} us, "
                   f"all_to_all {data['collective_latency_base_s'] * 1e6:.0f} us + {data['collective_latency_per_peer_s'] * 1e6:.0f} us/peer, "
                   f"{data['bandwidth_bytes_per_s']['same_node'] / 1e9:.2f} GB/s, {data['parallel_ranks']} cores")
