"""`runtime.serve --serve`: every rank of a bundle runs the continuous-batching engine; rank 0 also
runs the front (the OpenAI-compatible HTTP server, `http_server.run_http`) in its main thread.

Lifecycle:
* start: each rank loads its shard, then joins the process group (timeout COLLECTIVE_TIMEOUT_S;
  an idle service stays inside it with heartbeats, `engine_loop.py`). With nccl the step plans,
  heartbeats and metrics travel in a gloo group beside it, so an idle rank sleeps instead of spinning.
* rank 0: the engine loop in a thread; the front in the main thread until it returns (after
  SIGTERM/SIGINT: drain, then idle; or when the engine failed). Then the other ranks are told to
  stop and the process exits with the front's code (non-zero when the engine failed). A watchdog
  exits non-zero WATCHDOG_GRACE_S after an engine failure if the front has not returned by then,
  so a supervisor restarts the service.
* other ranks: ignore SIGTERM and SIGINT (rank 0 decides when the service stops: in-flight requests
  finish first); exit 0 on rank 0's STOP, non-zero when a collective fails (rank 0 or a peer gone).
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from ..bundle_io import BundleError, bundle_root, load_bundle
from ..counters import Counters
from ..ep.engine import Engine
from ..ep.exchange import Exchanger
from .scheduler import Limits, Scheduler
from .engine_loop import run_follower, run_leader
from .row_cache import UnsupportedCache, check_cache_layers
from .worker import BatchWorker

COLLECTIVE_TIMEOUT_S = 60.0   # a collective waiting longer than this fails (a hung peer)
HEARTBEAT_S = 1.0             # an idle rank 0 broadcasts a heartbeat plan this often
WATCHDOG_GRACE_S = 5.0        # after an engine failure, the front has this long to return
DEFAULT_MAX_SEQUENCES = 64    # plans without a capacity decision (compiled before it existed)
EXPERT_LOG_STEPS = 4096       # MoE steps of the expert cache's request log a service keeps


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


def serve_main(args) -> int:
    """`runtime.serve --serve ...`: the HTTP front on rank 0 (the front helper's `run_http`)."""
    roots = args.bundle or []
    if len(roots) > 1:
        print("error: --serve serves one bundle; give at most one --bundle", file=sys.stderr)
        return 2
    root = Path(roots[0]).resolve() if roots else bundle_root()

    def front(client, plan, codec):
        from .http_server import run_http

        model_dir = (root / plan["model"]["config"]).parent
        api_key = args.api_key or os.environ.get("MOEPLAN_API_KEY") or None  # the env var keeps it out of `ps`
        return run_http(client, host=args.host, port=args.port, api_key=api_key, model_dir=model_dir,
                        model_name=client.model_name)

    return serve_bundle(root, front, mode=args.mode, context=args.context, threads=args.threads,
                        max_sequences=args.max_sequences, max_waiting=args.max_waiting)


def serve_bundle(root: Path, front, mode: str | None = None, context: str = "auto", threads: int = 1,
                 max_sequences: int | None = None, max_waiting: int | None = None,
                 collective_timeout_s: float = COLLECTIVE_TIMEOUT_S, heartbeat_s: float = HEARTBEAT_S) -> int:
    """Run the service on this rank; `front(client, plan, codec) -> exit code` runs on rank 0."""
    torch.set_num_threads(threads)
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    use_cuda = torch.cuda.is_available()
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}") if use_cuda else torch.device("cpu")
    try:
        if mode is not None and "," in mode:
            raise BundleError(f"--serve runs one communication mode, got --mode {mode}")
        plan, table, modes, model, codec = load_bundle(root, rank, world, device, mode)
        if modes[0] not in ("coherent", "standard"):
            raise BundleError(f"--mode takes coherent or standard, got {modes[0]}")
        check_cache_layers(model.model, model.kind)
        limits = limits_for(plan, model.max_positions, max_sequences, max_waiting)
    except (BundleError, UnsupportedCache, ValueError, OSError) as exc:
        print(f"error: rank {rank}: {exc}", file=sys.stderr)
        return 2
    if use_cuda:
        torch.cuda.set_device(device)
    timeout, control = timedelta(seconds=collective_timeout_s), None
    if world > 1:  # one rank exchanges nothing: no process group
        dist.init_process_group("nccl" if use_cuda else "gloo", timeout=timeout)
        control = dist.new_group(backend="gloo", timeout=timeout) if use_cuda else None
    counters = Counters(model.num_layers)
    engine = Engine(model, table, Exchanger(rank, world, counters, device), counters, rank, world, modes[0], device,
                    model.top_k, context, record=False)  # a service keeps no logits or routing
    worker = BatchWorker(engine, model.kind, control)
    if getattr(model, "expert_cache", None) is not None:  # a service runs for days: keep the request log bounded
        model.expert_cache.keep_steps = EXPERT_LOG_STEPS
    if rank != 0:
        return _follow(worker, rank)
    client = Scheduler(plan["model"].get("name", root.name), limits, codec.vocab_size, world,
                           modes[0] == "coherent", model.num_layers)
    loop = threading.Thread(target=run_leader, args=(worker, client, heartbeat_s), name="engine-loop", daemon=True)
    loop.start()
    threading.Thread(target=_watchdog, args=(client,), name="engine-watchdog", daemon=True).start()
    code = 1
    try:
        code = int(front(client, plan, codec) or 0)
    finally:
        client.shutdown()
        loop.join(timeout=collective_timeout_s)
        if loop.is_alive() or client.failure is not None:
            print(f"error: rank 0: the engine stopped: {client.failure or 'its loop did not finish'}", file=sys.stderr,
                  flush=True)
            sys.stdout.flush()
            os._exit(code or 1)  # a peer may be gone: no collective teardown
    worker.close()
    if world > 1:
        dist.destroy_process_group()
    return code


def _follow(worker, rank: int) -> int:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # rank 0 decides when to stop (drain first)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        run_follower(worker)
    except Exception as exc:
        print(f"error: rank {rank}: the service stopped: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}",
              file=sys.stderr, flush=True)
        os._exit(1)
    worker.close()
    dist.destroy_process_group()
    return 0


def _watchdog(client) -> None:
    """Exit non-zero shortly after an engine failure, whatever the front is doing."""
    client.failed_event.wait()
    time.sleep(WATCHDOG_GRACE_S)
    print(f"error: rank 0: the engine failed ({client.failure}); exiting", file=sys.stderr, flush=True)
    os._exit(1)
