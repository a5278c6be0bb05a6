"""`moeplan calibrate [--out FILE]`: measure this machine into a cpu-gloo hardware profile.

Why: the cost model's CPU predictions are only as good as its constants, and a CPU's matmul rate,
framework overhead and gloo latency depend on the machine and its load. About three minutes:
one-thread matmul throughput, a large copy, the host's rates for computing an expert on all cores
(host compute on a miss, docs/offload.md), the runtime's own replica choice (`ExpertTable.choose`),
expert reads as the runtime's stores do them, gloo `all_to_all_single` over loopback at 2 and 4
ranks (message latency and bandwidth), and the runtime engine itself: on one rank, to fit the cost
of one of its framework calls (`op_overhead_s`), then at 2 and 4 ranks (processes over gloo,
standard mode), to fit the latency of one exchange call as the engine meets it. That latency is
not the micro-benchmark's: between calls the ranks compute, drift out of step and share the cores
(4 ranks on 2 here), so each call waits for the slowest; fitted on the micro-benchmark alone, the
demo's multi-rank runs were predicted 25-70 % fast. The YAML it writes has every key of
`planner/hardware_data/*.yaml`, each with its source, and a `calibration` block (date, machine,
machine key, load average) that plans record.

Without `--out` the profile is this machine's cached calibration
(`$XDG_CACHE_HOME/moeplan/hardware/cpu-gloo-<machine key>.yaml`, the key naming the CPU model,
cores, memory, torch version and calibration method), measured once and reused (`--refresh`
measures again); `--hardware this-machine` prices plans with it. With `--out FILE` it writes FILE
(pass it as `--hardware FILE`).

The engine run uses a seeded random-weight Qwen3-MoE built by transformers at the example model's
size (`--model MODEL` runs a model directory instead, e.g. the one you plan: the cost model counts
one set of framework calls per block for every model, and models differ around it).
"""
from __future__ import annotations

import os
import socket
from datetime import datetime, timezone

import click

from moeplan.planner.errors import UserError

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

    from moeplan.backends.runtime.expert_table import ExpertTable

    torch.set_num_threads(1)
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    mm = _median_per_call(lambda: a @ b, 30)
    big = torch.randn(1 << 22)
    copy = _median_per_call(lambda: big.clone(), 10)
    # the runtime's replica choice (backends/runtime/expert_table.py) on 256 tokens x top-2 over 2 ranks
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

    from moeplan.planner.hardware import physical_memory_bytes

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


# The engine run that fits op_overhead_s: a model at the example model's size, 8 requests of 32
# prompt tokens and 8 new tokens on one rank (no communication), standard mode.
ENGINE_QWEN3 = {"vocab_size": 256, "hidden_size": 128, "num_hidden_layers": 6, "num_attention_heads": 4,
                "num_key_value_heads": 2, "head_dim": 32, "num_experts": 16, "num_experts_per_tok": 2,
                "moe_intermediate_size": 64, "intermediate_size": 128, "max_position_embeddings": 256,
                "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True, "tie_word_embeddings": False}
ENGINE_WORKLOAD = (8, 32, 8)


def _engine_model(scratch, model_dir):
    """(library module with its weights, a maker of fresh modules of its class, runtime kind, model
    path): MODEL's own, or the seeded Qwen3-MoE written to `scratch`."""
    import json
    from pathlib import Path

    import torch

    from moeplan.backends.runtime.library_model import build_tiny_moe, build_transformers

    if model_dir is None:
        try:
            import transformers
        except ImportError:
            raise UserError("calibrate runs the runtime on a small Qwen3-MoE built by transformers; "
                            "pip install 'moeplan[hf]' (or give --model with a moeplan model directory)") from None
        torch.manual_seed(0)
        model_dir = Path(scratch) / "qwen3_moe"
        transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**ENGINE_QWEN3)).save_pretrained(model_dir)
    directory = Path(model_dir)
    config = json.loads((directory / "config.json").read_text()) if (directory / "config.json").is_file() else None
    if config is None:
        raise UserError(f"--model '{model_dir}' is not a model directory with a config.json")
    if "moeplan_loader" in config:
        from moeplan.planner.importers import load_model

        loaded = load_model(str(directory))
        return (loaded.module, lambda: build_tiny_moe(directory / "config.json", directory / "model.py"), "tiny_moe",
                directory)
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    return model, lambda: build_transformers(directory, device="cpu"), "transformers", directory


def _rank_engine(model, fresh, kind: str, mode: str, rank: int = 0, world: int = 1):
    """Rank `rank` of `world`'s Engine (contiguous placement: expert e on rank e * world // E), over
    `fresh` loaded with `model`'s weights, as a bundle's rank builds it; (engine, hosts bool [L, E, W])."""
    import numpy as np

    import torch

    from moeplan.backends.runtime.counters import Counters
    from moeplan.backends.runtime.engine import Engine
    from moeplan.backends.runtime.exchange import Exchanger
    from moeplan.backends.runtime.expert_table import ExpertTable
    from moeplan.backends.runtime.library_model import RankModel, decoder_layers, transformers_top_k
    from moeplan.backends.runtime.moe_adapter import find_containers, split_expert_state

    prefix, layers = decoder_layers(model)
    containers = find_containers(layers, prefix)
    weights = split_expert_state({k: v.detach() for k, v in model.state_dict().items()}, containers)
    E = containers[0].num_experts
    devices = [[e for e in range(E) if e * world // E == d] for d in range(world)]
    table = ExpertTable.from_placement({"topology": {"nodes": 1, "gpus_per_node": world},
                                        "layers": [{"layer": c.moe, "devices": devices} for c in containers]})
    hosts = np.zeros((len(containers), E, world), dtype=bool)
    for d, experts in enumerate(devices):
        hosts[:, experts, d] = True
    config = model.config
    top_k = int(config.top_k) if kind == "tiny_moe" else transformers_top_k(config)
    max_positions = int(getattr(config, "max_positions", None) or config.max_position_embeddings)
    rank_model = RankModel(fresh, kind, None, {c.moe: devices[rank] for c in containers}, weights, max_positions)
    rank_model.top_k = top_k
    counters = Counters(rank_model.num_layers)
    engine = Engine(rank_model, table, Exchanger(rank, world, counters, torch.device("cpu")), counters, rank, world, mode,
                    torch.device("cpu"), top_k)
    return engine, hosts


def _routing(traces: list, max_len: int, layers: int) -> dict:
    """{(seq, pos): int [L, k]} from the engine traces of every rank ((layer, keys, ids, weights) rows)."""
    import numpy as np

    experts = {}
    for trace in traces:
        for layer, keys, ids, _ in trace:
            for k, row in zip(keys.tolist(), ids.tolist()):
                experts.setdefault((k // max_len, k % max_len), [None] * layers)[layer] = row
    return {t: np.array(v) for t, v in experts.items()}


def _prompts(vocab: int) -> list:
    requests, length, _ = ENGINE_WORKLOAD
    return [[(7 * i + 3 * j) % vocab for j in range(length)] for i in range(requests)]


def measure_engine(partial: dict, scratch, model_dir=None, runs: int = 3) -> float:
    """Fit op_overhead_s: the value for which the cost model predicts the measured time of the
    runtime engine (standard mode) on one rank. The cost model is linear in op_overhead_s there."""
    import torch

    from moeplan.passes.analysis.cost_model import ModelShape, Workload, predict
    from moeplan.planner.hardware import profile_from_dict
    from moeplan.planner.importers import load_model

    torch.set_num_threads(1)
    model, fresh, kind, directory = _engine_model(scratch, model_dir)  # a rank changes its module: one per run
    requests, length, new = ENGINE_WORKLOAD
    prompts = _prompts(int(model.config.vocab_size))
    times, engine = [], None
    for _ in range(runs):
        engine, hosts = _rank_engine(model, fresh(), kind, "standard")
        times.append(engine.generate(prompts, new)["elapsed_s"])
    measured = sorted(times)[len(times) // 2]
    shape = ModelShape.from_ir(load_model(str(directory)).ir)
    routing = _routing([engine.trace], engine.max_len, len(shape.moe_blocks))
    workload = Workload((length,) * requests, new)

    def predicted(op: float) -> float:
        profile = profile_from_dict(dict(partial, op_overhead_s=max(op, 1e-12)), "calibration")
        return sum(predict(hosts, 1, shape, "standard", workload, routing, profile).step_seconds)

    at0, at1 = predicted(1e-12), predicted(1.0)
    return max((measured - at0) / (at1 - at0), 1e-9)


def _engine_worker(rank: int, world: int, port: int, directory: str, runs: int, queue) -> None:
    """One rank of the engine run at `world` ranks (standard mode, gloo): its times and routing."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        model, fresh, kind, _ = _engine_model(None, directory)
        prompts = _prompts(int(model.config.vocab_size))
        times, engine = [], None
        for _ in range(runs):
            engine, _ = _rank_engine(model, fresh(), kind, "standard", rank, world)
            dist.barrier()
            times.append(engine.generate(prompts, ENGINE_WORKLOAD[2])["elapsed_s"])
        trace = [(int(layer), keys.tolist(), ids.tolist()) for layer, keys, ids, _ in engine.trace]
        gathered = [None] * world
        dist.all_gather_object(gathered, {"times": times, "trace": trace})
        if rank == 0:
            queue.put({"times": [max(g["times"][i] for g in gathered) for i in range(runs)],  # the slowest rank's
                       "traces": [g["trace"] for g in gathered], "max_len": engine.max_len})
    finally:
        dist.destroy_process_group()


def measure_engine_ranks(directory, world: int, runs: int = 3) -> dict:
    """The runtime engine at `world` ranks (processes over gloo, one thread each), standard mode:
    {"seconds": median of `runs`, "routing", "hosts"}."""
    import numpy as np
    import torch

    result = _spawn_ranks(_engine_worker, world, (str(directory), runs), f"the engine run at {world} ranks", 600)
    traces = [[(layer, torch.tensor(keys), torch.tensor(ids), None) for layer, keys, ids in t] for t in result["traces"]]
    layers = 1 + max(layer for t in traces for layer, _, _, _ in t)
    routing = _routing(traces, result["max_len"], layers)
    E = 1 + max(int(np.max(v)) for v in routing.values())
    hosts = np.zeros((layers, E, world), dtype=bool)
    for e in range(E):
        hosts[:, e, e * world // E] = True
    return {"seconds": sorted(result["times"])[runs // 2], "routing": routing, "hosts": hosts}


def fit_collective_latency(partial: dict, directory, runs: dict) -> float:
    """One all_to_all call's latency at W ranks as the engine meets it (between compute, ranks out of
    step, cores shared): the value for which the cost model predicts the measured engine run at W
    ranks, with every other figure fixed; `runs` one world's `measure_engine_ranks`. The model is
    linear in it (two calls per exchange)."""
    from moeplan.passes.analysis.cost_model import ModelShape, Workload, predict
    from moeplan.planner.hardware import profile_from_dict
    from moeplan.planner.importers import load_model

    requests, length, new = ENGINE_WORKLOAD
    shape = ModelShape.from_ir(load_model(str(directory)).ir)
    workload = Workload((length,) * requests, new)
    hosts = runs["hosts"]
    W = hosts.shape[2]

    def predicted(latency: float) -> float:
        profile = profile_from_dict(dict(partial, collective_latency_base_s=max(latency, 1e-12),
                                         collective_latency_per_peer_s=1e-12), "calibration")
        return sum(predict(hosts, W, shape, "standard", workload, runs["routing"], profile).step_seconds)

    at0, at1 = predicted(1e-12), predicted(1.0)
    return max((runs["seconds"] - at0) / (at1 - at0), 1e-7)


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

    from moeplan.passes.analysis.cost_model import ATTN_OPS, MOE_OPS
    from moeplan.planner.hardware import machine_facts, machine_key

    from moeplan.passes.analysis.profile.host_rates import measure_host_experts

    facts = machine_facts()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    compute = measure_compute()
    host = measure_host_experts()
    with tempfile.TemporaryDirectory(prefix="moeplan-calibrate-") as scratch:
        memory = measure_memory(scratch)
        gloo = {w: measure_gloo(w) for w in WORLDS}
        cores = facts["cores"]
        partial = {"name": "cpu-gloo", "flops_per_s": compute["flops_per_s"], "memory_bytes_per_s": compute["memory_bytes_per_s"],
                   "python_slot_s": compute["python_slot_s"], "parallel_ranks": cores,
                   "attention_ops_per_sequence": 0, "op_overhead_s": 1e-6,
                   "collective_latency_base_s": 1.0, "collective_latency_per_peer_s": 1.0,
                   "bandwidth_bytes_per_s": {"same_node": 1.0, "other_node": 1.0},
                   "message_latency_s": {"same_node": 1.0, "other_node": 1.0},
                   **dict.fromkeys(("device_memory_bytes", "host_memory_bytes", "host_to_device_bytes_per_s", "disk_read_bytes_per_s", "memory_efficiency", "layer_overhead_s", "copy_latency_s"))}
        compute["op_overhead_s"] = measure_engine(partial, scratch, model_dir)
        lo, hi = WORLDS
        message = max((gloo[lo]["kilo"] - gloo[lo]["small"]) / (lo - 1), 1e-7)
        bandwidth = LARGE_BYTES * (lo - 1) / max(gloo[lo]["large"] - gloo[lo]["small"], 1e-9)
        directory = model_dir or os.path.join(scratch, "qwen3_moe")  # _engine_model saved the seeded one there
        fitted = dict(partial, op_overhead_s=compute["op_overhead_s"],
                      bandwidth_bytes_per_s={"same_node": bandwidth, "other_node": bandwidth},
                      message_latency_s={"same_node": message, "other_node": message})
        latency = {w: fit_collective_latency(fitted, directory, measure_engine_ranks(directory, w)) for w in WORLDS}
    per_peer = max((latency[hi] - latency[lo]) / (hi - lo), 1e-7)
    base = max(latency[lo] - per_peer * (lo - 1), 1e-7)
    micro = {w: gloo[w]["small"] for w in WORLDS}
    op = _g4(compute["op_overhead_s"])
    measured = f"moeplan calibrate on this machine ({cores} cores): median of timed calls"
    engine_model = "a seeded Qwen3-MoE (hidden 128, 6 layers, 16 experts, top-2)" if model_dir is None else str(model_dir)
    when = (now or datetime.now(timezone.utc)).replace(microsecond=0)
    return {
        "name": "cpu-gloo",
        "flops_per_s": _g4(compute["flops_per_s"]),
        "memory_bytes_per_s": _g4(compute["memory_bytes_per_s"]),
        "op_overhead_s": op,
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
            "op_overhead_s": f"{measured}: fitted so that the cost model predicts a one-rank run of the runtime engine "
                             f"({engine_model}; 8 x 32 prompt tokens + 8 new, standard mode; median of 3)",
            "attention_ops_per_sequence": "zero: the runtime runs one batched library forward per step "
                                          "(backends/runtime/engine.py), no loop over sequences",
            "python_slot_s": f"{measured}, the runtime's replica choice (ExpertTable.choose) on 256 tokens x top-2, per slot",
            "parallel_ranks": "os.sched_getaffinity (cores this process may use)",
            "collective_latency_base_s": f"moeplan calibrate on this machine ({cores} cores): fitted so that the cost "
                                         f"model predicts the runtime engine at {lo} and {hi} ranks (standard mode, "
                                         f"{engine_model}, median of 3): an exchange call as the engine meets it, "
                                         f"ranks out of step and cores shared (gloo all_to_all_single alone, 8 B per "
                                         f"peer back to back: {micro[lo] * 1e6:.0f} us at {lo} ranks, "
                                         f"{micro[hi] * 1e6:.0f} us at {hi})",
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
                                "block in passes/analysis/cost_model.py",
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
@click.option("--json", "as_json", is_flag=True, help="print the profile as one JSON object")
def calibrate_cmd(out, refresh, model_dir, as_json):
    """Measure this machine (matmul, copies, the runtime engine, gloo all-to-all) into a hardware profile."""
    from pathlib import Path

    import yaml

    from moeplan.planner.atomic import write_text_atomic
    from moeplan.planner.hardware import calibration_path, machine_key, profile_from_dict

    if model_dir is not None and out is None:
        raise UserError("--model calibrates for one model: give --out FILE too (this machine's cached calibration "
                        "uses the default engine model)")
    path = Path(out) if out is not None else calibration_path()
    if path.exists() and not path.is_file():
        raise UserError(f"--out '{path}' is not a file; give a YAML file path")
    if out is None and path.is_file() and not refresh:
        data = yaml.safe_load(path.read_text())
        profile_from_dict(data, str(path))  # a damaged cache entry stops here; --refresh replaces it
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


def _report(path, data: dict, as_json: bool, cached: bool) -> None:
    import json

    if as_json:
        click.echo(json.dumps({"path": str(path), "cached": cached, "profile": data}, sort_keys=True))
        return
    what = f"using this machine's calibration of {data['calibration']['date']}" if cached else "wrote"
    click.echo(f"{what} {path}: matmul {data['flops_per_s'] / 1e9:.1f} GFLOP/s, op {data['op_overhead_s'] * 1e6:.1f} us, "
               f"all_to_all {data['collective_latency_base_s'] * 1e6:.0f} us + {data['collective_latency_per_peer_s'] * 1e6:.0f} us/peer, "
               f"{data['bandwidth_bytes_per_s']['same_node'] / 1e9:.2f} GB/s, {data['parallel_ranks']} cores")
