"""Rank 0's engine in a process of its own, beside the process of the front and the scheduler.

Why: in one process the front's thread and the engine's share one interpreter lock. Every socket
write of a token's SSE chunk releases it and then waits for the engine's thread, which takes it
back between any two of its ~400-1,500 library ops per step; and the engine waits for the front in
turn. Measured on the 2-core CPU (qwen3_moe_hd32, 1 rank, c=64, the engine's thread timed per
step): 12-25 ms of CPU per step took 18-49 ms of wall time, the engine's thread ran 0.55 of a core
while rank 0 served ~1,700 tokens/s, and the front's profile spent 1.35 of its 8 s in `socket.send`
(194 us per call, almost all of it waiting for the lock). Here each process has its own lock: the
engine's process runs steps, the front's process writes chunks.

The parent (torchrun's rank-0 process) keeps what it had: the front in its main thread (signals,
drain, health), the `Scheduler`, the watchdog; `EngineProcess.relay`, a thread, answers the
engine's messages with the scheduler's calls. The child (`python -m <package>.engine_process`,
started with the parent's sys.path and environment, so it joins the process group as rank 0)
loads the bundle and runs `engine_loop.run_leader` with a `SchedulerLink` for a client, over a
socket pair (multiprocessing's Connection); no step waits for the parent while sequences run:
  child -> parent: ("ready", ServiceInfo) | ("error", exit code) once; ("started",);
                   ("step", {seq: token} of the last step or None, heartbeat_s, number of the last plan
                   applied, idle) -> the parent answers with a StepPlan where `SchedulerLink` says;
                   ("stats", [vector per rank]); ("fail", message).
Messages are plain pickles (`Channel`): multiprocessing's own pickler would pass tensors as shared
file descriptors, which only its own child processes can receive.
The child ignores SIGTERM/SIGINT (the parent decides when to stop, after draining) and ends on the
STOP plan, or when the parent's end of the pipe closes (the parent is gone).
"""
from __future__ import annotations

import json
import os
import pickle
import signal
import socket
import subprocess
import sys
from dataclasses import asdict
from multiprocessing.connection import Connection

import torch

from ..process_exit import leave
from .engine_loop import run_leader
from .engine_start import EngineOptions, close_engine, start_engine
from .step_plan import STEP, STOP, StepPlan


class Channel:
    """One end of the socket pair: whole pickled messages."""

    def __init__(self, fd: int):
        self.conn = Connection(fd)

    def send(self, message) -> None:
        self.conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))

    def recv(self):
        return pickle.loads(self.conn.recv_bytes())

    def poll(self) -> bool:
        """A message is waiting."""
        return self.conn.poll()


class EngineProcess:
    """The parent's handle on the engine's process."""

    def __init__(self, options: EngineOptions):
        here, there = socket.socketpair()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        self.proc = subprocess.Popen([sys.executable, "-m", f"{__package__}.engine_process", json.dumps(asdict(options)),
                                      str(there.fileno())], pass_fds=(there.fileno(),), env=env)
        there.close()
        self.conn = Channel(here.detach())
        self.relay = Relay(self.conn, lambda: self.why(self.proc.poll())).run

    def wait_ready(self):
        """ServiceInfo once the engine has loaded the bundle, else its exit code (it printed why)."""
        try:
            message = self.conn.recv()
        except (EOFError, OSError):
            code = self.proc.wait()
            print(f"error: rank 0: the engine process exited ({self.why(code)}) before it was ready", file=sys.stderr,
                  flush=True)
            return code or 1
        if message[0] == "error":
            return self.proc.wait() or message[1]
        return message[1]

    def wait(self, timeout_s: float):
        """The engine process's exit code, or None if it is still running after `timeout_s`."""
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()

    @staticmethod
    def why(code) -> str:
        if code is None:
            return "it did not finish"
        return f"killed by signal {-code}" if code < 0 else f"exit code {code}"


class Relay:
    """The parent's end: answers the engine's messages with the scheduler's calls (`run`, a thread)."""

    def __init__(self, conn: Channel, ended):
        """`ended()`: why the engine's end closed (its exit status)."""
        self.conn, self.ended = conn, ended

    def run(self, client) -> None:
        """Answer the engine's messages with `client`'s calls (a thread) until STOP is sent or the engine is gone."""
        try:
            while True:
                message = self.conn.recv()
                if message[0] == "step":
                    if self._step(client, *message[1:]):
                        return
                elif message[0] == "stats":
                    client.set_stats(message[1])
                elif message[0] == "started":
                    client.started()
                elif message[0] == "fail":
                    client.fail(message[1])
                    return
        except (EOFError, OSError):
            client.fail(f"the engine process ended ({self.ended()})")
        except Exception as exc:  # the parent's watchdog then ends the process, and with it the pipe
            client.fail(f"{type(exc).__name__}: {exc}".splitlines()[0][:500])

    def _step(self, client, tokens, heartbeat_s, applied: int, idle: bool) -> bool:
        """A step's tokens in; a plan out where the engine needs one (it waits for one only when idle);
        the step's events after the plan. True once STOP is sent."""
        events = client.record_tokens(tokens, applied) if tokens is not None else []
        plan = client.next_plan(heartbeat_s, wait=False, pending=events)  # its aborts follow the step's tokens
        if plan is None and idle:  # nothing to run: the events first, then sleep until there is
            client.deliver(events)
            events, plan = [], client.next_plan(heartbeat_s)
        sent = plan is not None and (idle or plan.kind != STEP or plan.admit or plan.depart or plan.gather_stats)
        if sent:
            self.conn.send(plan)
        client.deliver(events)
        return sent and plan.kind == STOP


class SchedulerLink:
    """The engine loop's client in the child: each call is a message to the parent's scheduler.

    The engine runs ahead of its plans: after a step it sends the tokens and, unless the parent's
    next plan is already here, runs the batch as it is (a STEP changing nothing), so a step never
    waits for the other process. The parent sends only plans that change something (admissions,
    departures, statistics, STOP), and any plan while the engine is idle, where it waits for one.
    A sequence that finished (stop token) may run a few steps more until its departure arrives (those
    tokens are not the request's); the engine runs ahead only while every sequence has tokens left of
    its `max_tokens` (counted here from the plans), so no row passes its request's context."""

    def __init__(self, conn: Channel, worker):
        self.conn, self.worker, self.tokens, self.failed, self.applied = conn, worker, None, False, 0
        self.left: dict = {}  # seq -> tokens its request may still produce, after the last step
        self.last = None      # the plan the last step ran

    def started(self) -> None:
        self.conn.send(("started",))

    def next_plan(self, heartbeat_s):
        self._count(self.last)
        idle = not self.worker.running
        self.conn.send(("step", self.tokens, heartbeat_s, self.applied, idle))
        self.tokens = None
        if not idle and not self.conn.poll() and all(self.left.get(s, 0) > 0 for s in self.worker.running):
            self.last = StepPlan(STEP)
        else:
            self.last = self.conn.recv()
            self.applied = max(self.applied, self.last.number)
        return self.last

    def _count(self, plan) -> None:
        """The step `plan` ran gave every running sequence one token."""
        if plan is None or plan.kind != STEP:
            return
        for seq in plan.depart:
            self.left.pop(seq, None)
        self.left.update((a.seq, a.max_tokens) for a in plan.admit)
        for seq in self.worker.running:
            self.left[seq] = self.left.get(seq, 0) - 1

    def on_tokens(self, tokens: dict) -> None:  # sent with the next plan's request, in order
        self.tokens = tokens

    def set_stats(self, stats: list) -> None:
        self.conn.send(("stats", stats))

    def fail(self, error: str) -> None:
        self.failed = True
        try:
            self.conn.send(("fail", error))
        except OSError:  # the parent is gone
            pass


def _profiler():
    """The development profiler of `http_server.start_profiler`, when set, writing beside the front's
    file (`<MOEPLAN_PROFILE>.engine`)."""
    from .http_server import PROFILE_ENV, start_profiler  # the front's modules load only when profiling

    if not os.environ.get(PROFILE_ENV):
        return None
    os.environ[PROFILE_ENV] += ".engine"
    return start_profiler()


def main() -> int:
    options = EngineOptions(**json.loads(sys.argv[1]))
    conn = Channel(int(sys.argv[2]))
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the parent drains first, then sends STOP
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(options.threads)
    started = start_engine(options)
    if isinstance(started, int):
        conn.send(("error", started))
        return started
    worker, info = started
    conn.send(("ready", info))
    sampler = _profiler()
    link = SchedulerLink(conn, worker)
    run_leader(worker, link, options.heartbeat_s)
    if sampler is not None:
        sampler.stop()
    if link.failed:
        sys.stdout.flush()
        os._exit(1)  # a peer may be gone: no collective teardown
    close_engine(worker)
    return 0


if __name__ == "__main__":
    leave(main())
