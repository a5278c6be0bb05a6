"""Start one rank's engine of the service: load its share of the bundle, join the process group,
build its BatchWorker. Rank 0 does it in its engine process (`engine_process.py`), the other ranks
in their own (`ranks.py`)."""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from ..bundle_io import BundleError, load_bundle
from ..counters import Counters
from ..ep.engine import Engine
from ..ep.exchange import Exchanger
from .decode_compile import enable_compiled_decode
from .row_cache import UnsupportedCache, check_cache_layers
from .scheduler import Limits
from .worker import BatchWorker

DEFAULT_MAX_SEQUENCES = 64    # plans without a capacity decision (compiled before it existed)
EXPERT_LOG_STEPS = 4096       # MoE steps of the expert cache's request log a service keeps


@dataclass
class EngineOptions:
    root: str
    mode: str | None
    context: str
    threads: int
    max_sequences: int | None
    max_waiting: int | None
    collective_timeout_s: float
    heartbeat_s: float


@dataclass
class ServiceInfo:
    """What the parent's scheduler and front need from the loaded bundle."""

    name: str
    plan: dict      # plan.json, as the engine loaded it
    limits: object  # scheduler.Limits
    codec: object   # text_codec.TextCodec
    world: int
    coherent: bool
    num_layers: int


def limits_for(plan: dict, max_positions: int, max_sequences: int | None, max_waiting: int | None) -> Limits:
    """The plan's capacity decision (plan.json communication.capacity: max_sequences, max_context,
    passes/cost/capacity.py), lowered by the options."""
    capacity = plan.get("communication", {}).get("capacity", {})
    if capacity and not capacity.get("fits", True):
        raise BundleError(f"the plan's capacity holds no sequence: {capacity['device_memory_bytes']} bytes of device "
                          f"memory ({capacity['device_memory_source']}) do not hold a rank's weights and a KV cache; "
                          "recompile with more device memory (--gpu-memory) or more ranks")
    planned = int(capacity.get("max_sequences", DEFAULT_MAX_SEQUENCES))
    context = min(int(capacity.get("max_context", max_positions)), int(max_positions))
    if max_sequences is not None and not 1 <= max_sequences:
        raise BundleError(f"--max-sequences must be at least 1, got {max_sequences}")
    if max_sequences is not None and max_sequences > planned:
        raise BundleError(f"--max-sequences {max_sequences} exceeds the plan's capacity of {planned} sequences; "
                          "recompile for more device memory or fewer ranks' weights")
    sequences = max_sequences or planned
    if max_waiting is not None and max_waiting < 0:
        raise BundleError(f"--max-waiting must be at least 0, got {max_waiting}")
    return Limits(max_context=context, max_sequences=sequences,
                  max_waiting=4 * sequences if max_waiting is None else max_waiting)


def start_engine(options: EngineOptions):
    """Load this rank's share of the bundle and join the process group: (BatchWorker, ServiceInfo),
    or an exit code after one error line."""
    root = Path(options.root)
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    use_cuda = torch.cuda.is_available()
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}") if use_cuda else torch.device("cpu")
    try:
        if options.mode is not None and "," in options.mode:
            raise BundleError(f"--serve runs one communication mode, got --mode {options.mode}")
        plan, table, modes, model, codec = load_bundle(root, rank, world, device, options.mode)
        if modes[0] not in ("coherent", "standard"):
            raise BundleError(f"--mode takes coherent or standard, got {modes[0]}")
        check_cache_layers(model.model, model.kind)
        limits = limits_for(plan, model.max_positions, options.max_sequences, options.max_waiting)
        model.cache_columns = limits.max_context  # the KV cache's spare columns stop at the planned context
    except (BundleError, UnsupportedCache, ValueError, OSError) as exc:
        print(f"error: rank {rank}: {exc}", file=sys.stderr, flush=True)
        return 2
    if use_cuda:
        torch.cuda.set_device(device)
    timeout, control = timedelta(seconds=options.collective_timeout_s), None
    if world > 1:  # one rank exchanges nothing: no process group
        dist.init_process_group("nccl" if use_cuda else "gloo", timeout=timeout)
        control = dist.new_group(backend="gloo", timeout=timeout) if use_cuda else None
    counters = Counters(model.num_layers)
    exchanger = Exchanger.for_process_group(rank, world, counters, device, options.collective_timeout_s)
    engine = Engine(model, table, exchanger, counters, rank, world, modes[0], device,
                    model.top_k, options.context, record=False)  # a service keeps no logits or routing
    worker = BatchWorker(engine, model.kind, control)
    eager = enable_compiled_decode(worker, limits.max_sequences)
    if eager is not None and not eager.endswith(" is off") and rank == 0:  # the ranks agree: one line says it
        print(f"note: decode steps run eager: {eager}", file=sys.stderr, flush=True)
    if getattr(model, "expert_cache", None) is not None:  # a service runs for days: keep the request log bounded
        model.expert_cache.keep_steps = EXPERT_LOG_STEPS
    info = ServiceInfo(plan["model"].get("name", root.name), plan, limits, codec, world, modes[0] == "coherent",
                       model.num_layers)
    return worker, info


def close_engine(worker) -> None:
    """After the last step: remove the engine's hooks and leave the process group (world > 1)."""
    worker.close()
    worker.engine.ex.close()
    if worker.world > 1:
        dist.destroy_process_group()
