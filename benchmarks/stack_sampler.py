"""An in-process sampling profiler for rank 0, on when MOEPLAN_PROFILE names a file (development only).

Not part of the runtime, so no bundle ships it: benchmarks/serving.py points the serving front's
profiler hook at this file (MOEPLAN_PROFILER, runtime/serving/http_server.py), and rank 0 loads it
from there and calls `start_from_env()`.

Why in-process: attaching profilers (py-spy) need to read another process's memory, which this
project's sandboxed machines refuse. Every `interval_s` a daemon thread takes every other thread's
Python stack (`sys._current_frames()`), counts it as one collapsed line `frame;frame;...`
(root first, each frame `function (file:line)`, py-spy's raw format), and every second rewrites
the file with the cumulative counts (atomically: a reader never sees half a file). A reader
subtracts two snapshots to profile a window (benchmarks/serving_profile.py). Stacks whose innermost
frame waits (a selector, a lock or condition, a queue) are counted as `idle`.
The cost is one stack walk per thread per sample (about 1% of a core at 100 samples/s).
"""
from __future__ import annotations

import os
import sys
import threading
import time

ENV = "MOEPLAN_PROFILE"
IDLE = ("selectors.py", "threading.py", "queue.py")


def start_from_env() -> StackSampler | None:
    path = os.environ.get(ENV)
    if not path:
        return None
    sampler = StackSampler(path)
    sampler.start()
    return sampler


class StackSampler(threading.Thread):
    def __init__(self, path: str, interval_s: float = 0.01, flush_s: float = 1.0):
        super().__init__(name="moeplan-stack-sampler", daemon=True)
        self.path, self.interval_s, self.flush_s = path, interval_s, flush_s
        self.counts: dict = {}
        self.stopped = threading.Event()

    def run(self) -> None:
        last_flush = time.monotonic()
        while not self.stopped.wait(self.interval_s):
            for ident, frame in sys._current_frames().items():
                if ident != self.ident:
                    key = collapse(frame)
                    self.counts[key] = self.counts.get(key, 0) + 1
            if time.monotonic() - last_flush >= self.flush_s:
                self.flush()
                last_flush = time.monotonic()
        self.flush()

    def flush(self) -> None:
        tmp = f"{self.path}.tmp"
        with open(tmp, "w") as fh:
            fh.writelines(f"{stack} {n}\n" for stack, n in self.counts.items())
        os.replace(tmp, self.path)

    def stop(self) -> None:
        self.stopped.set()
        self.join(5)


def collapse(frame) -> str:
    frames = []
    while frame is not None:
        frames.append(f"{frame.f_code.co_name} ({frame.f_code.co_filename}:{frame.f_lineno})")
        frame = frame.f_back
    if frames and any(frames[0].rsplit("(", 1)[-1].split(":")[0].endswith(name) for name in IDLE):
        return "idle"
    return ";".join(reversed(frames))
