"""A test-only stand-in for the engine, for the protocol-level tests of the HTTP front
(tests/test_serving_http.py). It is never shipped and never stands in for the real engine: every
target of issue 29 is shown against the real engine under torchrun (tests/test_serve_e2e.py).

It follows the EngineClient contract (runtime/serving/contract.py) with a thread that
emits one token per request per `step_s`: token t of a request is (sum of its prompt ids + 7 t)
mod vocab, so a test knows every answer in advance. `max_running` requests run at once, `max_waiting`
more wait; beyond that submit raises Overloaded. `fail_after_s` makes it unhealthy, ending every
request with FINISH_ERROR, to test what the front does when a rank dies.

    python tests/serving_stub.py MODEL_DIR --port 0 [--api-key K] [--step-s S] [--max-running N] [--max-waiting N]
"""
from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path


def stub_token(prompt_ids, t: int, vocab: int) -> int:
    return (sum(prompt_ids) + 7 * t) % vocab


class StubEngine:
    def __init__(self, vocab: int, max_context: int = 256, step_s: float = 0.01, max_running: int = 4,
                 max_waiting: int = 4, fail_after_s: float | None = None, model_name: str = "stub"):
        from moeplan.runtime.serving import contract as c

        self.c = c
        self.model_name, self.max_context, self.vocab = model_name, max_context, vocab
        self.step_s, self.max_running, self.max_waiting = step_s, max_running, max_waiting
        self.lock = threading.Lock()
        self.waiting, self.running = [], {}
        self.cancelled: list = []  # request ids the front cancelled (tests read it through /metrics)
        self.submitted: list = []
        self.draining = False
        self.steps = 0
        self.failed = False
        self.fail_at = None if fail_after_s is None else time.monotonic() + fail_after_s
        threading.Thread(target=self._loop, daemon=True).start()

    def submit(self, request, sink):
        with self.lock:
            if self.draining or self.failed:
                raise self.c.Unavailable("draining")
            if len(request.prompt_ids) + request.max_tokens > self.max_context:
                raise self.c.RequestTooLong(f"prompt + max_tokens exceeds {self.max_context}")
            if len(self.waiting) + len(self.running) >= self.max_waiting + self.max_running:  # the engine's rule
                raise self.c.Overloaded("queue full", retry_after_s=2.0)
            self.waiting.append([request, sink, 0])
            self.submitted.append(request)

    def cancel(self, request_id):
        with self.lock:
            self.cancelled.append(request_id)
            for entry in list(self.waiting):
                if entry[0].request_id == request_id:
                    self.waiting.remove(entry)
                    entry[1](self.c.TokenEvent(request_id, -1, self.c.FINISH_ABORT, time_s=time.monotonic()))
            entry = self.running.pop(request_id, None)
            if entry is not None:
                entry[1](self.c.TokenEvent(request_id, -1, self.c.FINISH_ABORT, time_s=time.monotonic()))

    def healthy(self):
        return not self.failed

    def drain(self):
        self.draining = True

    def idle(self):
        with self.lock:
            return not self.waiting and not self.running

    def metrics(self):
        with self.lock:
            return {"running": len(self.running), "waiting": len(self.waiting),
                    "exchange_bytes": {(0, "dispatch"): 10 * self.steps, (1, "combine"): 20 * self.steps},
                    "expert_cache": {"hits": 3, "misses": 1}, "gpu_local_fraction": 0.5, "steps": self.steps,
                    "cancelled": len(self.cancelled)}

    def _loop(self):
        c = self.c
        while True:
            time.sleep(self.step_s)
            with self.lock:
                if self.fail_at is not None and time.monotonic() >= self.fail_at and not self.failed:
                    self.failed = True
                    for request, sink, _ in list(self.running.values()) + self.waiting:
                        sink(c.TokenEvent(request.request_id, -1, c.FINISH_ERROR, error="rank 1 is down",
                                          time_s=time.monotonic()))
                    self.running.clear()
                    self.waiting.clear()
                if self.failed:
                    continue
                while self.waiting and len(self.running) < self.max_running:
                    entry = self.waiting.pop(0)
                    self.running[entry[0].request_id] = entry
                if self.running:
                    self.steps += 1
                for rid, entry in list(self.running.items()):
                    request, sink, t = entry
                    token = stub_token(request.prompt_ids, t, self.vocab)
                    entry[2] = t + 1
                    now = time.monotonic()
                    if token in request.stop_token_ids and not request.ignore_eos:
                        sink(c.TokenEvent(rid, -1, c.FINISH_STOP, time_s=now))
                        del self.running[rid]
                    elif t + 1 >= request.max_tokens:
                        sink(c.TokenEvent(rid, token, c.FINISH_LENGTH, time_s=now))
                        del self.running[rid]
                    else:
                        sink(c.TokenEvent(rid, token, time_s=now))


def main(argv=None) -> int:
    from moeplan.runtime.serving.http_server import run_http
    from moeplan.runtime.serving.served_model import ServedModel

    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--step-s", type=float, default=0.01)
    ap.add_argument("--max-running", type=int, default=4)
    ap.add_argument("--max-waiting", type=int, default=4)
    ap.add_argument("--max-context", type=int, default=256)
    ap.add_argument("--fail-after-s", type=float, default=None)
    args = ap.parse_args(argv)
    served = ServedModel.from_model_dir(Path(args.model_dir), "stub")
    engine = StubEngine(served.vocab_size, args.max_context, args.step_s, args.max_running, args.max_waiting,
                        args.fail_after_s)
    return run_http(engine, "127.0.0.1", args.port, args.api_key, Path(args.model_dir), "stub")


if __name__ == "__main__":
    sys.exit(main())
