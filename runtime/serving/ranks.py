"""`runtime.serve --serve`: every rank of a bundle runs the continuous-batching engine; rank 0 also
runs the front (the OpenAI-compatible HTTP server, `http_server.run_http`) in its main thread.

Lifecycle:
* start: each rank loads its shard, then joins the process group (timeout COLLECTIVE_TIMEOUT_S;
  an idle service stays inside it with heartbeats, `engine_loop.py`). With nccl the step plans,
  heartbeats and metrics travel in a gloo group beside it, so an idle rank sleeps instead of spinning.
* rank 0: the engine loop in a process of its own (`engine_process.py`: it loads the shard and
  joins the process group as rank 0), relayed to the scheduler by a thread; the front in the main
  thread until it returns (after SIGTERM/SIGINT: drain, then idle; or when the engine failed).
  Then the other ranks are told to stop and the process exits with the front's code (non-zero when the engine failed). A watchdog
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
from pathlib import Path

import torch

from ..bundle_io import bundle_root
from .scheduler import Scheduler
from .engine_loop import run_follower, run_leader
from .engine_process import EngineProcess
from .engine_start import EngineOptions, close_engine, start_engine

COLLECTIVE_TIMEOUT_S = 60.0   # a collective waiting longer than this fails (a hung peer)
HEARTBEAT_S = 1.0             # an idle rank 0 broadcasts a heartbeat plan this often
WATCHDOG_GRACE_S = 5.0        # after an engine failure, the front has this long to return


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
                 collective_timeout_s: float = COLLECTIVE_TIMEOUT_S, heartbeat_s: float = HEARTBEAT_S,
                 engine_thread: bool = False) -> int:
    """Run the service on this rank; `front(client, plan, codec) -> exit code` runs on rank 0, whose
    engine runs in its own process (`engine_process.py`), or with `engine_thread` in a thread beside
    the front (tests that read the engine's objects after the service ends)."""
    options = EngineOptions(str(root), mode, context, threads, max_sequences, max_waiting, collective_timeout_s,
                            heartbeat_s)
    rank = int(os.environ.get("RANK", 0))
    if rank == 0 and not engine_thread:
        return _lead(front, options)
    torch.set_num_threads(threads)
    started = start_engine(options)
    if isinstance(started, int):
        return started
    if rank != 0:
        return _follow(started[0], rank)
    worker, info = started
    client = _scheduler(info)
    loop = threading.Thread(target=run_leader, args=(worker, client, heartbeat_s), name="engine-loop", daemon=True)
    loop.start()
    code = _front(front, client, info, options, loop)
    close_engine(worker)
    return code


def _lead(front, options: EngineOptions) -> int:
    """Rank 0: the engine process, the scheduler relaying its steps, and the front in this main thread."""
    torch.set_num_threads(1)  # this process computes nothing
    engine = EngineProcess(options)
    info = engine.wait_ready()
    if isinstance(info, int):
        return info
    client = _scheduler(info)
    relay = threading.Thread(target=engine.relay, args=(client,), name="engine-relay", daemon=True)
    relay.start()
    return _front(front, client, info, options, relay, engine)


def _scheduler(info) -> Scheduler:
    return Scheduler(info.name, info.limits, info.codec.vocab_size, info.world, info.coherent, info.num_layers)


def _front(front, client, info, options: EngineOptions, loop, engine=None) -> int:
    """Run the front until it returns, then stop the engine (`loop`: the thread driving it); exit the
    process at once when the engine failed or did not stop."""
    threading.Thread(target=_watchdog, args=(client,), name="engine-watchdog", daemon=True).start()
    code = 1
    try:
        code = int(front(client, info.plan, info.codec) or 0)
    finally:
        client.shutdown()
        loop.join(timeout=options.collective_timeout_s)
        ended = engine.wait(options.collective_timeout_s) if engine is not None else 0
        if loop.is_alive() or client.failure is not None or ended != 0:
            why = client.failure or (engine.why(ended) if ended != 0 else "its loop did not finish")
            print(f"error: rank 0: the engine stopped: {why}", file=sys.stderr, flush=True)
            sys.stdout.flush()
            if engine is not None:
                engine.kill()
            os._exit(code or 1)  # a peer may be gone: no collective teardown
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
    close_engine(worker)
    return 0


def _watchdog(client) -> None:
    """Exit non-zero shortly after an engine failure, whatever the front is doing."""
    client.failed_event.wait()
    time.sleep(WATCHDOG_GRACE_S)
    print(f"error: rank 0: the engine failed ({client.failure}); exiting", file=sys.stderr, flush=True)
    os._exit(1)
