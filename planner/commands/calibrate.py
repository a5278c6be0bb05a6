"""`moeplan calibrate --out FILE`: measure this machine into a cpu-gloo hardware profile.

Why: the cost model's CPU predictions are only as good as its constants, and a CPU's matmul rate,
framework overhead and gloo latency depend on the machine and its load. A short micro-benchmark
(about a minute): one-thread matmul throughput, a large copy, the host's rates for computing an
expert on all cores (host compute on a miss, docs/offload.md), the runtime engine itself on one
rank (to fit the cost of one of the engine's framework calls, `op_overhead_s`),
and gloo `all_to_all_single` over loopback at 2 and 4 ranks (small messages for latency, large
for bandwidth), the same call the runtime makes. The YAML it writes has the keys of
`planner/hardware_data/*.yaml`, each with its source; pass it to `compile --hardware FILE`.
"""
from __future__ import annotations

import os
import socket

import click

from moeplan.planner.errors import UserError

WORLDS = (2, 4)
SMALL_REPS = 60
LARGE_BYTES = 1 << 21  # per peer


def _best_per_call(fn, reps: int) -> float:
    """Median of `reps` timed calls after two warm-ups (median: robust on a loaded machine)."""
    from moeplan.passes.analysis.profile.host_rates import median_seconds

    return median_seconds(fn, reps)


def measure_compute() -> dict:
    """One thread: matmul FLOP/s (256 x 256 x 256 float32), copy bandwidth, the replica-choice loop."""
    import torch

    torch.set_num_threads(1)
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    mm = _best_per_call(lambda: a @ b, 30)
    big = torch.randn(1 << 22)
    copy = _best_per_call(lambda: big.clone(), 10)
    table = torch.empty(64, 2, dtype=torch.int64)

    def choose_loop():  # the runtime's replica choice: a Python loop storing one rank per slot
        for i in range(64):
            for s in range(2):
                table[i, s] = i & 1

    slot = _best_per_call(choose_loop, 20) / 128
    return {"flops_per_s": 2 * 256 ** 3 / mm, "memory_bytes_per_s": 2 * big.numel() * 4 / copy,
            "python_slot_s": slot}


# The engine run that fits op_overhead_s: TinyMoE at the example model's size, 8 requests of 32
# prompt tokens and 8 new tokens on one rank (no communication), random seeded weights.
ENGINE_CONFIG = {"vocab_size": 256, "hidden_size": 128, "num_layers": 6, "num_heads": 4, "num_experts": 16,
                 "top_k": 2, "expert_hidden": 64, "shared_experts": 0, "max_positions": 256, "norm_eps": 1e-5}
ENGINE_WORKLOAD = (8, 32, 8)
ENGINE_OPS_PER_SEQUENCE = 20  # the runtime engine's attention: mask, two einsums, softmax, gathers per sequence


def _tiny_weights(c: dict, torch) -> dict:
    g = torch.Generator().manual_seed(0)
    D, H, V, E = c["hidden_size"], c["expert_hidden"], c["vocab_size"], c["num_experts"]

    def r(*shape):
        return torch.randn(*shape, generator=g) * 0.1

    w = {"embed.weight": r(V, D), "pos_embed.weight": r(c["max_positions"], D), "final_norm.weight": torch.ones(D),
         "head.weight": r(V, D)}
    for l in range(c["num_layers"]):
        p = f"blocks.{l}"
        w.update({f"{p}.attn_norm.weight": torch.ones(D), f"{p}.attn.qkv.weight": r(3 * D, D),
                  f"{p}.attn.out.weight": r(D, D), f"{p}.moe_norm.weight": torch.ones(D), f"{p}.moe.gate.weight": r(E, D)})
        for e in range(E):
            w.update({f"{p}.moe.experts.{e}.w_gate.weight": r(H, D), f"{p}.moe.experts.{e}.w_up.weight": r(H, D),
                      f"{p}.moe.experts.{e}.w_down.weight": r(D, H)})
    return w


def measure_engine(partial: dict, runs: int = 3) -> float:
    """Fit op_overhead_s: the value for which the cost model predicts the measured time of the
    runtime engine (standard mode) on one rank. The cost model is linear in op_overhead_s there."""
    import numpy as np
    import torch

    from moeplan.backends.runtime.counters import Counters
    from moeplan.backends.runtime.engine import Engine
    from moeplan.backends.runtime.exchange import Exchanger
    from moeplan.backends.runtime.expert_table import ExpertTable
    from moeplan.backends.runtime.tiny_moe import TinyMoEArch
    from moeplan.passes.analysis.cost_model import ModelShape, Workload, predict
    from moeplan.planner.hardware import profile_from_dict

    torch.set_num_threads(1)
    c = ENGINE_CONFIG
    arch = TinyMoEArch(c, _tiny_weights(c, torch))
    E, L = c["num_experts"], c["num_layers"]
    table = ExpertTable.from_placement({"topology": {"nodes": 1, "gpus_per_node": 1},
                                        "layers": [{"layer": l, "devices": [list(range(E))]} for l in range(L)]})
    requests, length, new = ENGINE_WORKLOAD
    prompts = [[(7 * i + 3 * j) % c["vocab_size"] for j in range(length)] for i in range(requests)]
    times, engine = [], None
    for _ in range(runs):
        counters = Counters(L)
        engine = Engine(arch, table, Exchanger(0, 1, counters, torch.device("cpu")), counters, 0, 1, "standard",
                        torch.device("cpu"))
        times.append(engine.generate(prompts, new)["elapsed_s"])
    measured = sorted(times)[len(times) // 2]
    experts = {}
    for layer, keys, ids, _ in engine.trace:
        for k, row in zip(keys.tolist(), ids.tolist()):
            experts.setdefault((k // engine.max_len, k % engine.max_len), [None] * L)[layer] = row
    routing = {t: np.array(v) for t, v in experts.items()}
    D, H = c["hidden_size"], c["expert_hidden"]
    shape = ModelShape(hidden=D, top_k=c["top_k"], num_blocks=L, moe_blocks=tuple(range(L)),
                       attention_flops=2 * 4 * D * D + 4 * D * length, expert_flops=2 * 3 * D * H,
                       head_flops=2 * D * c["vocab_size"], expert_bytes=4 * 3 * D * H, attention_bytes=4 * 4 * D * D)
    workload = Workload((length,) * requests, new)
    hosts = np.ones((L, E, 1), dtype=bool)

    def predicted(op: float) -> float:
        profile = profile_from_dict(dict(partial, op_overhead_s=max(op, 1e-12)), "calibration")
        return sum(predict(hosts, 1, shape, "standard", workload, routing, profile).step_seconds)

    at0, at1 = predicted(1e-12), predicted(1.0)
    return max((measured - at0) / (at1 - at0), 1e-9)


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
    from moeplan.passes.analysis.profile.host_rates import measure_host_experts

    compute = measure_compute()
    host = measure_host_experts()
    gloo = {w: measure_gloo(w) for w in WORLDS}
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    partial = {"name": "cpu-gloo", "flops_per_s": compute["flops_per_s"], "memory_bytes_per_s": compute["memory_bytes_per_s"],
               "python_slot_s": compute["python_slot_s"], "parallel_ranks": cores,
               "attention_ops_per_sequence": ENGINE_OPS_PER_SEQUENCE, "op_overhead_s": 1e-6,
               "collective_latency_base_s": 1.0, "collective_latency_per_peer_s": 1.0,
               "bandwidth_bytes_per_s": {"same_node": 1.0, "other_node": 1.0},
               "message_latency_s": {"same_node": 1.0, "other_node": 1.0}}
    compute["op_overhead_s"] = measure_engine(partial)
    lo, hi = WORLDS
    per_peer = max((gloo[hi]["small"] - gloo[lo]["small"]) / (hi - lo), 1e-7)
    base = max(gloo[lo]["small"] - per_peer * (lo - 1), 1e-7)
    message = max((gloo[lo]["kilo"] - gloo[lo]["small"]) / (lo - 1), 1e-7)
    bandwidth = LARGE_BYTES * (lo - 1) / max(gloo[lo]["large"] - gloo[lo]["small"], 1e-9)
    measured = (f"moeplan calibrate on this machine ({cores} cores): median of timed calls")
    return {
        "name": "cpu-gloo",
        "flops_per_s": float(f"{compute['flops_per_s']:.4g}"),
        "memory_bytes_per_s": float(f"{compute['memory_bytes_per_s']:.4g}"),
        "op_overhead_s": float(f"{compute['op_overhead_s']:.4g}"),
        "python_slot_s": float(f"{compute['python_slot_s']:.4g}"),
        "attention_ops_per_sequence": ENGINE_OPS_PER_SEQUENCE,
        "parallel_ranks": cores,
        "collective_latency_base_s": float(f"{base:.4g}"),
        "collective_latency_per_peer_s": float(f"{per_peer:.4g}"),
        "bandwidth_bytes_per_s": {"same_node": float(f"{bandwidth:.4g}"), "other_node": float(f"{bandwidth:.4g}")},
        "message_latency_s": {"same_node": float(f"{message:.4g}"), "other_node": float(f"{message:.4g}")},
        **{k: float(f"{v:.4g}") for k, v in host.items()},
        "sources": {
            "flops_per_s": f"{measured}, 256x256x256 float32 matmul, one thread",
            "memory_bytes_per_s": f"{measured}, clone of 16 MiB",
            "op_overhead_s": f"{measured}: fitted so that the cost model predicts a one-rank run of the runtime engine "
                             f"(TinyMoE 128 hidden, 16 experts, top-2; 8 x 32 prompt tokens + 8 new; median of 3)",
            "attention_ops_per_sequence": "counted off backends/runtime/engine.py (_attention loops over sequences)",
            "python_slot_s": f"{measured}, a Python loop storing one int64 per slot into a [64, 2] tensor",
            "parallel_ranks": "os.sched_getaffinity (cores this process may use)",
            "collective_latency_base_s": f"{measured}, gloo all_to_all_single 8 B per peer at {lo} and {hi} ranks",
            "collective_latency_per_peer_s": f"{measured}, slope between {lo} and {hi} ranks",
            "bandwidth_bytes_per_s": f"{measured}, 2 MiB per peer at {lo} ranks over loopback (both tiers: one machine)",
            "message_latency_s": f"{measured}, 1 KiB minus 8 B per peer at {lo} ranks",
            "host_memory_bytes_per_s": f"{measured}, all cores: one row through a 2048 x 768 SwiGLU expert (float32, "
                                       "18 MiB of weights), bytes / time",
            "host_flops_per_s": f"{measured}, all cores: 256 rows through the same expert, FLOPs / time",
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
    write_text_atomic(path, header + yaml.safe_dump(data, sort_keys=False), kind="hardware")
    if as_json:
        click.echo(json.dumps(data, sort_keys=True))
    else:
        click.echo(f"wrote {path}: matmul {data['flops_per_s'] / 1e9:.1f} GFLOP/s, op {data['op_overhead_s'] * 1e6:.1f} us, "
                   f"all_to_all {data['collective_latency_base_s'] * 1e6:.0f} us + {data['collective_latency_per_peer_s'] * 1e6:.0f} us/peer, "
                   f"{data['bandwidth_bytes_per_s']['same_node'] / 1e9:.2f} GB/s, {data['parallel_ranks']} cores")
