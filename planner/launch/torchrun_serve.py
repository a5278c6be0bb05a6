"""Start a bundle's inference service on this machine: `torchrun --standalone` over the bundle's own
`runtime.serve --serve`, as `torchrun_launch.py` starts a static run.

Signals: torchrun exits non-zero whenever *it* receives a signal (it re-raises the signal after
stopping its workers), even when every worker exits cleanly. A service that drains on SIGTERM and
exits 0 must therefore receive the signal in its workers, not in torchrun: `stop_workers` sends
it to torchrun's children (read from /proc), and torchrun, seeing clean exits, exits 0. torchrun
runs in its own session, so a terminal's Ctrl-C reaches only the caller, which forwards it.
The API key travels in the environment (MOEPLAN_API_KEY), never on a command line `ps` shows.
"""
from __future__ import annotations

import ctypes
import os
import signal
import subprocess
from pathlib import Path

from moeplan.planner.launch.torchrun_launch import torchrun_command

API_KEY_ENV = "MOEPLAN_API_KEY"


def serve_command(nproc: int, host: str, port: int, mode: str | None = None, max_sequences: int | None = None,
                  max_waiting: int | None = None, threads: int | None = None) -> list:
    """torchrun over `runtime.serve --serve`; options left None take the runtime's defaults (the plan's)."""
    cmd = torchrun_command(nproc, "runtime.serve", "--serve", "--host", host, "--port", str(port))
    for flag, value in (("--mode", mode), ("--max-sequences", max_sequences), ("--max-waiting", max_waiting),
                        ("--threads", threads)):
        if value is not None:
            cmd += [flag, str(value)]
    return cmd


def start_service(root: Path, cmd: list, api_key: str | None) -> subprocess.Popen:
    """The torchrun process, its stdout and stderr piped (text, line-buffered), in its own session."""
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), PYTHONDONTWRITEBYTECODE="1",
               PYTHONUNBUFFERED="1")
    env.pop("PYTHONPATH", None)  # the bundle must run from its own runtime/
    env.pop(API_KEY_ENV, None)
    if api_key:
        env[API_KEY_ENV] = api_key
    return subprocess.Popen(cmd, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            bufsize=1, start_new_session=True, preexec_fn=_die_with_parent)


def worker_pids(pid: int) -> list:
    """The direct children of `pid` (torchrun's workers), from /proc; [] where /proc cannot say."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as fh:
            return [int(p) for p in fh.read().split()]
    except (OSError, ValueError):
        return []


def stop_workers(proc: subprocess.Popen, sig: int = signal.SIGTERM) -> None:
    """Send `sig` to the service's ranks (torchrun's children), or to torchrun itself when it has
    none yet (still starting: it then stops, non-zero, which is right for an interrupted start)."""
    if proc.poll() is not None:
        return
    workers = worker_pids(proc.pid)
    for pid in workers or [proc.pid]:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _die_with_parent() -> None:
    """Linux: torchrun gets SIGTERM when the process that started it dies (no orphaned service)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
