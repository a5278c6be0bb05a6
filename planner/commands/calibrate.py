"""`moeplan calibrate [--out FILE]`: measure this machine into a cpu-gloo hardware profile.

Why: the cost model's CPU predictions are only as good as its constants, and a CPU's matmul rate,
framework overhead and gloo latency depend on the machine and its load. About three minutes:
one-thread matmul throughput, a large copy, the host's rates for computing an expert on all cores
(host compute on a miss, docs/offload.md), the runtime's own replica choice (`ExpertTable.choose`),
expert reads as the runtime's stores do them, gloo `all_to_all_single` over loopback at 2 and 4
ranks (message latency and bandwidth), and the runtime engine itself, as `moeplan run` measures
it (`calibrate_engine.py`: torchrun bundles of the engine model at 1, 2 and 4 ranks, both modes):
on one rank to fit the cost of one framework call (`op_overhead_s`), at 2 and 4 ranks to fit the
latency of one exchange call as the engine meets it. That latency is not the micro-benchmark's:
between calls the ranks compute, drift out of step and share the cores (4 ranks on 2 here), so
each call waits for the slowest; fitted on the micro-benchmark alone, the demo's multi-rank runs
were predicted 25-70 % fast. The YAML it writes has every key of `core/hardware_data/*.yaml`,
each with its source, and a `calibration` block (date, machine, machine key, load average) that
plans record.

Without `--out` the profile is this machine's cached calibration
(`$XDG_CACHE_HOME/moeplan/hardware/cpu-gloo-<machine key>.yaml`, the key naming the CPU model,
cores, memory, torch version and calibration method), measured once and reused (`--refresh`
measures again); `--hardware this-machine` prices plans with it. With `--out FILE` it writes FILE
(pass it as `--hardware FILE`).

The engine runs use a seeded random-weight Qwen3-MoE built by transformers at the example model's
size (`--model MODEL` runs a model directory instead, e.g. the one you plan: the cost model counts
one set of framework calls per block for every model, and models differ around it: the demo's
TinyMoE runs about 11 % faster than the Qwen3-MoE of the same sizes, docs/cost_model.md).
"""
from __future__ import annotations

import os
import socket
from datetime import datetime, timezone

import click

from moeplan.core.errors import UserError

WORLDS = (2, 4)
SMALL_REPS = 60
LARGE_BYTES = 1 << 21  # per peer
COPY_BYTES = 1 << 22   # host-to-device copy and expert read size (4 MiB)


def _median_per_call(fn, reps: int) -> float:
    """Median of `reps` timed calls after two warm-ups (median: robust on a loaded machine)."""
    from moeplan.passes.analysis.profile.host_rates import median_seconds

    return median_seconds(fn, reps)


def measure_compute() -> dict:
    """One thread: matmul FLOP/s (256 x 256 x 256 float32), copy bandwidth, the runtime's replica choice."""
    import torch

    from moeplan.runtime.ep.expert_table import ExpertTable

    torch.set_num_threads(1)
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    mm = _median_per_call(lambda: a @ b, 30)
    big = torch.randn(1 << 22)
    copy = _median_per_call(lambda: big.clone(), 10)
    # the runtime's replica choice (runtime/ep/expert_table.py) on 256 tokens x top-2 over 2 ranks
    table = ExpertTable.from_placement({"topology": {"nodes": 1, "gpus_per_node": 2},
                                        "layers": [{"layer": 0, "devices": [list(range(0, 16, 2)), list(range(1, 16, 2))]},
                                                   {"layer": 1, "devices": [list(range(8)), list(range(8, 16))]}]})
    g = torch.Generator().manual_seed(0)
    ids = torch.stack([torch.randperm(16, generator=g)[:2] for _ in range(256)])
    current = torch.arange(256) % 2
    slot = _median_per_call(lambda: table.choose(1, ids, current), 10) / ids.numel()
    return {"flops_per_s": 2 * 256 ** 3 / mm, "memory_bytes_per_s": 2 * big.numel() * 4 / copy, "python_slot_s": slot}


def measure_memory(scratch) -> dict:
    """Expert movement as a CPU rank does it: a float32 copy into a pool slot (host to device), a
    read of float16 weights from a safetensors file in the page cache converted to float32 (the
    rank's store), the fixed cost of one tensor read; the machine's memory."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    from moeplan.core.hardware import physical_memory_bytes

    torch.set_num_threads(1)
    src = torch.randn(COPY_BYTES // 4)
    slot = torch.empty_like(src)
    h2d = _median_per_call(lambda: slot.copy_(src), 30)
    path = os.path.join(scratch, "experts.safetensors")
    save_file({"expert": torch.randn(COPY_BYTES // 2).half(), "tiny": torch.randn(16).half()}, path)
    wide = torch.empty(COPY_BYTES // 2)  # the float32 copy of the stored float16 expert
    with safe_open(path, "pt") as f:
        f.get_tensor("expert")  # into the page cache
        read = _median_per_call(lambda: wide.copy_(f.get_tensor("expert").float()), 30)
        latency = _median_per_call(lambda: f.get_tensor("tiny").float(), 200)
    memory = physical_memory_bytes()
    return {"host_to_device_bytes_per_s": COPY_BYTES / h2d, "disk_read_bytes_per_s": COPY_BYTES / read,
            "copy_latency_s": latency, "device_memory_bytes": memory, "host_memory_bytes": memory}


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
                dist.all_to_all_single(recv, send)  # noqa: B023 (called within this iteration)

            dist.barrier()
            out[label] = _median_per_call(call, reps)
        if rank == 0:
            queue.put(out)
    finally:
        dist.destroy_process_group()


def measure_gloo(world: int) -> dict:
    """Median seconds per all_to_all_single call at 8 B, 1 KiB and 2 MiB per peer among `world` ranks."""
    return _spawn_ranks(_worker, world, (), f"the gloo micro-benchmark at {world} ranks", 300)


def _spawn_ranks(target, world: int, args: tuple, what: str, timeout: float):
    """Run target(rank, world, port, *args, queue) in `world` spawned processes joined over gloo on
    loopback; what rank 0 put on the queue."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=target, args=(r, world, port, *args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        result = queue.get(timeout=timeout)
    finally:
        for p in procs:
            p.join(timeout=120)
    if any(p.exitcode != 0 for p in procs):
        raise UserError(f"{what} failed; check that loopback TCP works")
    return result


def _g4(x: float) -> float:
    return float(f"{x:.4g}")


def calibrate(model_dir=None, now: datetime | None = None) -> dict:
    """The cpu-gloo profile of this machine, as a YAML-ready dict (every key, each with its source)."""
    import tempfile
    from pathlib import Path

    from moeplan.passes.cost.runtime_ops import ATTN_OPS, MOE_OPS
    from moeplan.planner.commands.calibrate_engine import engine_label, fit_engine
    from moeplan.core.hardware import machine_facts, machine_key

    from moeplan.passes.analysis.profile.host_rates import measure_host_experts

    facts = machine_facts()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    compute = measure_compute()
    host = measure_host_experts()
    with tempfile.TemporaryDirectory(prefix="moeplan-calibrate-") as scratch:
        memory = measure_memory(scratch)
        gloo = {w: measure_gloo(w) for w in WORLDS}
        cores = facts["cores"]
        lo, hi = WORLDS
        message = max((gloo[lo]["kilo"] - gloo[lo]["small"]) / (lo - 1), 1e-7)
        bandwidth = LARGE_BYTES * (lo - 1) / max(gloo[lo]["large"] - gloo[lo]["small"], 1e-9)
        partial = {"name": "cpu-gloo", "flops_per_s": compute["flops_per_s"], "memory_bytes_per_s": compute["memory_bytes_per_s"],
                   "python_slot_s": compute["python_slot_s"], "parallel_ranks": cores,
                   "attention_ops_per_sequence": 0, "op_overhead_s": 1e-6, "runtime_op_overhead_s": 1e-6, "runtime_op_row_s": 0.0,
                   "collective_latency_base_s": 1.0, "collective_latency_per_peer_s": 1.0,
                   "bandwidth_bytes_per_s": {"same_node": bandwidth, "other_node": bandwidth},
                   "message_latency_s": {"same_node": message, "other_node": message},
                   **dict.fromkeys(("device_memory_bytes", "host_memory_bytes", "host_to_device_bytes_per_s", "disk_read_bytes_per_s", "memory_efficiency", "layer_overhead_s", "copy_latency_s"))}
        engine = fit_engine(partial, Path(scratch), model_dir)  # op_overhead_s, then the exchange call's latency
        latency = engine["latency"]
    per_peer = max((latency[hi] - latency[lo]) / (hi - lo), 1e-7)
    base = latency[lo] - per_peer * (lo - 1)  # the line through both worlds' latencies (negative intercept allowed)
    micro = {w: gloo[w]["small"] for w in WORLDS}
    op = _g4(engine["op_overhead_s"])
    measured = f"moeplan calibrate on this machine ({cores} cores): median of timed calls"
    engine_model = engine_label(model_dir)
    when = (now or datetime.now(timezone.utc)).replace(microsecond=0)
    return {
        "name": "cpu-gloo",
        "flops_per_s": _g4(compute["flops_per_s"]),
        "memory_bytes_per_s": _g4(compute["memory_bytes_per_s"]),
        "op_overhead_s": op,
        "runtime_op_overhead_s": op,
        "runtime_op_row_s": _g4(engine["op_row_s"]),
        "python_slot_s": _g4(compute["python_slot_s"]),
        "attention_ops_per_sequence": 0,
        "parallel_ranks": cores,
        "collective_latency_base_s": _g4(base),
        "collective_latency_per_peer_s": _g4(per_peer),
        "bandwidth_bytes_per_s": {"same_node": _g4(bandwidth), "other_node": _g4(bandwidth)},
        "message_latency_s": {"same_node": _g4(message), "other_node": _g4(message)},
        "device_memory_bytes": int(memory["device_memory_bytes"]) or None,
        "host_memory_bytes": int(memory["host_memory_bytes"]) or None,
        "host_to_device_bytes_per_s": _g4(memory["host_to_device_bytes_per_s"]),
        "disk_read_bytes_per_s": _g4(memory["disk_read_bytes_per_s"]),
        "memory_efficiency": 1.0,
        "layer_overhead_s": _g4(op * (ATTN_OPS + MOE_OPS)),
        "copy_latency_s": _g4(memory["copy_latency_s"]),
        **{k: _g4(v) for k, v in host.items()},  # host_memory_bytes_per_s, host_flops_per_s
        "calibration": {"date": when.isoformat(), "machine_key": machine_key(facts), "machine": facts,
                        "load_average": None if load is None else round(load, 2), "engine_model": engine_model},
        "sources": {
            "flops_per_s": f"{measured}, 256x256x256 float32 matmul, one thread",
            "memory_bytes_per_s": f"{measured}, clone of 16 MiB",
            "op_overhead_s": f"moeplan calibrate on this machine: the least-squares fit of `moeplan run`'s prediction "
                             f"to its measurement of a 1-rank torchrun bundle of {engine_model} (8 x 32 prompt tokens "
                             f"+ 8 new, both modes, median of 5 launches; and of 2 prompts), the prediction pricing the "
                             f"runtime's counted ops (passes/cost/runtime_op_counts.json) at it + runtime_op_row_s x rows",
            "runtime_op_overhead_s": "the same fit: one op the runtime dispatches, as counted",
            "runtime_op_row_s": "the same fit, over the 1-rank runs of 8 and of 2 prompts (the rows a step runs on the "
                                "rank): what one op adds per row",
            "attention_ops_per_sequence": "zero: the runtime runs one batched library forward per step "
                                          "(runtime/ep/engine.py), no loop over sequences",
            "python_slot_s": f"{measured}, the runtime's replica choice (ExpertTable.choose) on 256 tokens x top-2, per slot",
            "parallel_ranks": "os.sched_getaffinity (cores this process may use)",
            "collective_latency_base_s": f"moeplan calibrate on this machine ({cores} cores): the line through one "
                                         f"exchange call's latency at {lo} and {hi} ranks ({latency[lo] * 1e6:.0f} and "
                                         f"{latency[hi] * 1e6:.0f} us), each the least-squares fit of `moeplan run`'s "
                                         f"prediction to its measurement of a torchrun bundle of {engine_model} at that "
                                         f"many ranks (both modes, median of 5 launches): a call as the engine meets it, "
                                         f"ranks out of step and cores shared (gloo all_to_all_single alone, 8 B per "
                                         f"peer back to back: {micro[lo] * 1e6:.0f} us at {lo} ranks, "
                                         f"{micro[hi] * 1e6:.0f} us at {hi}); its value at 1 rank, this intercept, may be "
                                         f"negative, as only {lo} ranks or more are priced",
            "collective_latency_per_peer_s": f"the same fit: slope between {lo} and {hi} ranks",
            "bandwidth_bytes_per_s": f"{measured}, 2 MiB per peer at {lo} ranks over loopback (both tiers: one machine)",
            "message_latency_s": f"{measured}, 1 KiB minus 8 B per peer at {lo} ranks",
            "device_memory_bytes": "physical memory (os.sysconf): a CPU rank keeps its experts in host memory",
            "host_memory_bytes": "physical memory (os.sysconf)",
            "host_to_device_bytes_per_s": f"{measured}, float32 copy of 4 MiB into a preallocated tensor (an expert "
                                          f"into its pool slot)",
            "disk_read_bytes_per_s": f"{measured}, safetensors read of 4 MiB float16 from a file in the page cache, "
                                     f"converted to float32 (the rank's store); stored bytes per second",
            "memory_efficiency": "one: memory_bytes_per_s is measured, already effective",
            "layer_overhead_s": "derived: op_overhead_s x (ATTN_OPS + MOE_OPS), the framework calls of one decoder "
                                "block in passes/cost/cost_model.py",
            "copy_latency_s": f"{measured}, safetensors read of 16 float16 values (the fixed cost of one tensor read)",
            "host_memory_bytes_per_s": f"{measured}, all cores: one row through a 2048 x 768 SwiGLU expert (float32, "
                                       "18 MiB of weights), bytes / time",
            "host_flops_per_s": f"{measured}, all cores: 256 rows through the same expert, FLOPs / time",
        },
    }


@click.command("calibrate")
@click.option("--out", default=None, type=click.Path(dir_okay=False),
              help="YAML profile to write; default: this machine's cached calibration (--hardware this-machine)")
@click.option("--refresh", is_flag=True, help="measure again even if this machine's calibration is cached")
@click.option("--model", "model_dir", default=None,
              help="model directory the engine run uses (default: a seeded Qwen3-MoE); needs --out")
@click.option("--reuse", is_flag=True,
              help="with --out: keep FILE when it already holds this machine's calibration of the same engine model "
                   "(as the default cache is kept); measure otherwise")
@click.option("--json", "as_json", is_flag=True, help="print the profile as one JSON object")
def calibrate_cmd(out, refresh, model_dir, reuse, as_json):
    """Measure this machine (matmul, copies, the runtime engine, gloo all-to-all) into a hardware profile."""
    from pathlib import Path

    import yaml

    from moeplan.core.atomic import write_text_atomic
    from moeplan.core.hardware import calibration_path, machine_key, profile_from_dict

    if model_dir is not None and out is None:
        raise UserError("--model calibrates for one model: give --out FILE too (this machine's cached calibration "
                        "uses the default engine model)")
    path = Path(out) if out is not None else calibration_path()
    if path.exists() and not path.is_file():
        raise UserError(f"--out '{path}' is not a file; give a YAML file path")
    if reuse and out is None:
        raise UserError("--reuse keeps an --out FILE; without --out this machine's calibration is cached anyway")
    if out is None and path.is_file() and not refresh:
        data = yaml.safe_load(path.read_text())
        profile_from_dict(data, str(path))  # a damaged cache entry stops here; --refresh replaces it
        _report(path, data, as_json, cached=True)
        return
    if reuse and not refresh and path.is_file():
        data = _this_machines(path, model_dir)
        if data is not None:
            _report(path, data, as_json, cached=True)
            return
    data = calibrate(model_dir)
    profile_from_dict(data, str(path))  # what we write must load
    header = (f"# cpu-gloo hardware profile written by `moeplan calibrate` on {data['calibration']['date']} "
              f"(machine {machine_key()}; re-run to refresh).\n")
    if out is None:
        path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, header + yaml.safe_dump(data, sort_keys=False), kind="hardware")
    _report(path, data, as_json, cached=False)


def _this_machines(path, model_dir) -> dict | None:
    """FILE's profile if it is a calibration of this machine (its key) on the same engine model, else None
    (another machine's, another model's, or not a profile: measured again and replaced)."""
    import yaml

    from moeplan.planner.commands.calibrate_engine import engine_label
    from moeplan.core.hardware import machine_key, profile_from_dict

    try:
        data = yaml.safe_load(path.read_text())
        profile_from_dict(data, str(path))
    except (UserError, yaml.YAMLError, UnicodeDecodeError, OSError):
        return None
    calibration = data.get("calibration") or {}
    same = calibration.get("machine_key") == machine_key() and calibration.get("engine_model") == engine_label(model_dir)
    return data if same else None


def _report(path, data: dict, as_json: bool, cached: bool) -> None:
    import json

    from moeplan.core.hardware import profile_from_dict

    if as_json:
        click.echo(json.dumps({"path": str(path), "cached": cached, "profile": data}, sort_keys=True))
        return
    what = f"using this machine's calibration of {data['calibration']['date']}" if cached else "wrote"
    profile = profile_from_dict(data, str(path))
    click.echo(f"{what} {path}: matmul {data['flops_per_s'] / 1e9:.1f} GFLOP/s (one thread), framework call {data['op_overhead_s'] * 1e6:.1f} us, "
               f"exchange call {', '.join(f'{profile.collective_latency(w) * 1e6:.0f} us at {w} ranks' for w in WORLDS)}, "
               f"{data['bandwidth_bytes_per_s']['same_node'] / 1e9:.2f} GB/s, {data['parallel_ranks']} cores")
