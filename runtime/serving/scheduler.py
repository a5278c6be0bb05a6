"""Rank 0's scheduler, the `EngineClient` (contract.py) the front talks to: the bounded queue,
admission, cancellation, the step plans and the token events.

Two threads meet here: the front's (submit, cancel, drain, metrics) and the engine loop's, or the
relay of rank 0's engine process (`engine_process.py`): `next_plan` before each step, `on_tokens`
after it. They share one lock; the loop sleeps on a condition while there is nothing to run (no
busy-waiting), and wakes at once on a submit, a cancel, a drain or a shutdown, or after
`heartbeat_s` to send a heartbeat plan (world > 1).
Sinks are called from the loop's thread, outside the lock, one event at a time in token order.

Admission: FIFO, while fewer than `max_sequences` run (the plan's capacity) and the step's prefill
stays within `max_prefill_tokens` padded prompt tokens (at least one sequence per step). In
standard mode a sequence is owned by the rank running the fewest (ties: the lowest rank).
"""
from __future__ import annotations

import random
import threading
import time
from collections import deque
from dataclasses import dataclass

from .contract import (FINISH_ABORT, FINISH_ERROR, GenerationRequest, InvalidRequest,
                       Overloaded, RequestTooLong, TokenEvent, Unavailable)
from .step_plan import HEARTBEAT, STEP, STOP, Admission, StepPlan
from .stop_rule import token_outcome
from .worker import stats_figures

STATS_INTERVAL_S = 1.0  # how often the loop gathers every rank's counters for metrics()
# Standard mode: a step's admissions stay on one rank while it runs fewer than this many sequences more than the
# least-loaded rank. A prefill forward costs about the same dispatch at one row as at four, and each rank without
# an admission only joins its exchanges (`Engine.join_exchanges`), so ranks that share cores prefill once a step
# rather than once per rank; loads stay within this many sequences of each other.
PREFILL_SLACK = 2


def rank_rows(max_sequences: int, world: int) -> int:
    """The most sequences one rank of `world` runs at once when the service runs `max_sequences` in standard mode:
    `_admit` gives each new sequence to the least-loaded rank, whose load is under this share while the service is
    under `max_sequences`, and lets a step's admissions stay on one rank only below it."""
    return -(-int(max_sequences) // int(world))


@dataclass
class Limits:
    """What the service holds: the plan's capacity decision and the queue bound."""

    max_context: int         # prompt + max_tokens
    max_sequences: int       # sequences running at once
    max_waiting: int         # queued beyond those (running + waiting <= both together); more -> Overloaded
    max_prefill_tokens: int = 2048


class _Live:
    __slots__ = ("request", "sink", "seq", "owner", "generated", "stops", "plan")

    def __init__(self, request: GenerationRequest, sink):
        self.request, self.sink = request, sink
        self.seq, self.owner, self.generated = -1, -1, 0
        self.plan = 0  # the number of the plan that admits it
        self.stops = frozenset() if request.ignore_eos else frozenset(int(t) for t in request.stop_token_ids)


class Scheduler:
    """The scheduler: EngineClient for the front; plan source and event sink for rank 0's engine loop."""

    def __init__(self, model_name: str, limits: Limits, vocab_size: int, world: int, coherent: bool,
                 num_layers: int, seed_source=None):
        self.model_name, self.limits, self.vocab_size = model_name, limits, int(vocab_size)
        self.max_context = limits.max_context
        self.world, self.coherent, self.num_layers = world, coherent, num_layers
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._waiting: deque = deque()
        self._running: dict = {}      # seq -> _Live
        self._by_id: dict = {}        # request_id -> _Live (waiting or running)
        self._cancelled: set = set()
        self._finished: list = []     # seqs that ended at the last step: the next plan's departures
        self._load = [0] * world      # running sequences per owner rank
        self._next_seq = 0
        self._plans = self._steps = 0
        self._draining = self._stopping = False
        self._failed: str | None = None
        self.failed_event = threading.Event()  # set by fail(): the process must end soon
        self._alive = False
        self._seeds = seed_source or random.SystemRandom()
        self._done_times: deque = deque(maxlen=256)
        self._stats: list = []
        self._stats_at = 0.0

    # --- the front's side (contract.EngineClient) ---------------------------------------------------
    def submit(self, request: GenerationRequest, sink) -> None:
        self._validate(request)
        with self._lock:
            if self._failed is not None:
                raise Unavailable(f"the engine is down: {self._failed}")
            if self._draining or self._stopping:
                raise Unavailable("the service is shutting down")
            if request.request_id in self._by_id:
                raise InvalidRequest(f"request id {request.request_id!r} is already in flight")
            if len(self._running) + len(self._waiting) >= self.limits.max_sequences + self.limits.max_waiting:
                raise Overloaded(f"{len(self._running)} requests running and {len(self._waiting)} waiting, the most "
                                 "this service queues; retry later", retry_after_s=self._retry_after())
            live = _Live(request, sink)
            self._waiting.append(live)
            self._by_id[request.request_id] = live
            self._wake.notify()

    def _validate(self, request: GenerationRequest) -> None:
        prompt = request.prompt_ids
        if len(prompt) == 0:
            raise InvalidRequest("the prompt is empty; give at least one token")
        bad = [t for t in prompt if not (isinstance(t, int) and 0 <= t < self.vocab_size)]
        if bad:
            raise InvalidRequest(f"prompt token ids {bad[:5]} are outside the model's vocabulary of {self.vocab_size}")
        if not isinstance(request.max_tokens, int) or request.max_tokens < 1:
            raise InvalidRequest(f"max_tokens must be an integer of at least 1, got {request.max_tokens!r}")
        total = len(prompt) + request.max_tokens
        if total > self.limits.max_context:
            raise RequestTooLong(f"the prompt ({len(prompt)} tokens) plus max_tokens ({request.max_tokens}) is {total} "
                                 f"tokens, beyond this deployment's context of {self.limits.max_context}")
        s = request.sampling
        if not s.temperature >= 0:
            raise InvalidRequest(f"temperature must be >= 0, got {s.temperature}")
        if not 0 < s.top_p <= 1:
            raise InvalidRequest(f"top_p must be in (0, 1], got {s.top_p}")
        if not isinstance(s.top_k, int) or s.top_k < -1:
            raise InvalidRequest(f"top_k must be an integer >= -1 (0 or -1: off), got {s.top_k!r}")
        if s.seed is not None and not isinstance(s.seed, int):
            raise InvalidRequest(f"seed must be an integer, got {s.seed!r}")

    def _retry_after(self) -> float:
        """Seconds until the queue has likely moved: the waiting count over the recent completion rate."""
        done = list(self._done_times)
        if len(done) < 2 or done[-1] <= done[0]:
            return 1.0
        rate = (len(done) - 1) / (done[-1] - done[0])
        return float(min(60.0, max(1.0, round(len(self._waiting) / rate))))

    def cancel(self, request_id: str) -> None:
        with self._lock:
            if request_id in self._by_id:
                self._cancelled.add(request_id)
                self._wake.notify()

    def healthy(self) -> bool:
        with self._lock:
            return self._alive and self._failed is None

    def drain(self) -> None:
        with self._lock:
            self._draining = True
            self._wake.notify()

    def idle(self) -> bool:
        with self._lock:
            return not self._waiting and not self._running

    def metrics(self) -> dict:
        with self._lock:
            running, waiting, stats, steps = len(self._running), len(self._waiting), list(self._stats), self._steps
        out = {"running": running, "waiting": waiting, "exchange_bytes": {}, "expert_cache": {"hits": 0, "misses": 0, "prefetches": 0, "prefetch_hits": 0, "host_computed": 0},
               "gpu_local_fraction": None, "steps": steps}
        if stats:
            out.update(stats_figures(stats, self.num_layers))
        return out

    # --- the engine loop's side -------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop the loop at the next step boundary; whatever still runs or waits ends with FINISH_ABORT."""
        with self._lock:
            self._stopping = True
            self._wake.notify()

    def started(self) -> None:
        with self._lock:
            self._alive = True

    def next_plan(self, heartbeat_s: float | None, wait: bool = True, pending: list | None = None) -> StepPlan | None:
        """The next step's plan; sleeps while there is nothing to run (a HEARTBEAT after heartbeat_s).
        `wait=False`: None at once when there is nothing to run; its events (aborts) are then appended
        to `pending`, after the events the caller has yet to deliver, when given."""
        while True:
            events, plan = [], None
            with self._lock:
                plan = self._plan_locked(events)
                if plan is None and not events and wait and not self._wake.wait(timeout=heartbeat_s) \
                        and heartbeat_s is not None:
                    plan = StepPlan(HEARTBEAT)
                if plan is not None:
                    self._plans += 1
                    self._steps += plan.kind == STEP
                    plan.number = self._plans
                    now = time.monotonic()
                    if now - self._stats_at >= STATS_INTERVAL_S:
                        plan.gather_stats, self._stats_at = True, now
            if pending is not None and not wait:
                pending.extend(events)
            else:
                self.deliver(events)  # aborts, outside the lock
            if plan is not None or not wait:
                return plan

    def _plan_locked(self, events: list) -> StepPlan | None:
        now = time.monotonic()
        depart, self._finished = self._finished, []
        for request_id in self._cancelled:
            live = self._by_id.pop(request_id, None)
            if live is None:
                continue
            if live.seq >= 0:
                self._end_running(live)
                depart.append(live.seq)
            else:
                self._waiting.remove(live)
            events.append((live.sink, TokenEvent(request_id, -1, FINISH_ABORT, time_s=now)))
        self._cancelled.clear()
        if self._stopping:
            for live in list(self._running.values()) + list(self._waiting):
                events.append((live.sink, TokenEvent(live.request.request_id, -1, FINISH_ABORT, time_s=now)))
            self._running.clear(), self._waiting.clear(), self._by_id.clear()
            return StepPlan(STOP)
        admit, budget = [], self.limits.max_prefill_tokens
        while self._waiting and len(self._running) < self.limits.max_sequences:
            live = self._waiting[0]
            width = max([len(live.request.prompt_ids)] + [len(a.prompt) for a in admit])
            if admit and width * (len(admit) + 1) > budget:
                break
            self._waiting.popleft()
            admit.append(self._admit(live, admit[-1].owner if admit else None))
        if admit or depart:
            return StepPlan(STEP, admit, depart)
        if self._running:
            return StepPlan(STEP)
        return None

    def _admit(self, live: _Live, step_owner: int | None) -> Admission:
        """Admit `live` on the least-loaded rank, or on `step_owner` (the rank of this step's admissions so far)
        while it runs fewer than PREFILL_SLACK sequences more than that rank and fewer than its share (`rank_rows`:
        a GPU rank's KV pools hold that many rows; the least-loaded rank is always under it)."""
        live.seq, self._next_seq = self._next_seq, self._next_seq + 1
        live.plan = self._plans + 1  # the number next_plan gives the plan being made
        least = min(range(self.world), key=lambda r: (self._load[r], r))
        if self.coherent:
            live.owner = 0
        elif (step_owner is not None and self._load[step_owner] < self._load[least] + PREFILL_SLACK
              and self._load[step_owner] < rank_rows(self.limits.max_sequences, self.world)):
            live.owner = step_owner
        else:
            live.owner = least
        self._load[live.owner] += 1
        self._running[live.seq] = live
        s = live.request.sampling
        seed = s.seed if s.seed is not None else self._seeds.getrandbits(62)
        top_k = int(s.top_k) if s.top_k and s.top_k > 0 else 0
        return Admission(live.seq, live.owner, tuple(int(t) for t in live.request.prompt_ids), int(seed),
                         float(s.temperature), float(s.top_p), top_k, int(live.request.max_tokens))

    def _end_running(self, live: _Live) -> None:
        self._running.pop(live.seq, None)
        self._load[live.owner] -= 1

    def on_tokens(self, tokens: dict) -> None:
        """After a step: one new token per running sequence -> events; finished ones leave next step."""
        self.deliver(self.record_tokens(tokens))

    def record_tokens(self, tokens: dict, applied: int | None = None) -> list:
        """on_tokens without calling the sinks: the (sink, event) pairs, for `deliver`. `applied`: the
        number of the last plan the step had applied (the engine process runs ahead of its plans,
        `engine_process.py`): sequences admitted by later plans had no row in it yet, and tokens of
        sequences that already left are not theirs any more."""
        now = time.monotonic()
        events = []
        with self._lock:
            ran = [(s, l) for s, l in self._running.items() if applied is None or l.plan <= applied]
            missing = [s for s, _ in ran if s not in tokens]
            if missing:
                raise RuntimeError(f"the step produced no token for sequences {missing[:5]}")
            for seq, live in ran:
                token, request = tokens[seq], live.request
                emit, finish = token_outcome(token, live.stops, live.generated, request.max_tokens)
                live.generated += emit
                events.append((live.sink, TokenEvent(request.request_id, token if emit else -1, finish, time_s=now)))
                if finish is not None:
                    self._end_running(live)
                    self._by_id.pop(request.request_id, None)
                    self._finished.append(seq)
                    self._done_times.append(now)
        return events

    def set_stats(self, stats: list) -> None:
        vectors = [v.tolist() for v in stats]
        with self._lock:
            self._stats = vectors

    def fail(self, error: str) -> None:
        """The loop died (a rank is gone, a collective failed): every request ends with FINISH_ERROR."""
        now = time.monotonic()
        with self._lock:
            self._failed = error
            self.failed_event.set()
            lives = list(self._running.values()) + list(self._waiting)
            self._running.clear(), self._waiting.clear(), self._by_id.clear()
            self._wake.notify_all()
        self.deliver([(l.sink, TokenEvent(l.request.request_id, -1, FINISH_ERROR, error=error, time_s=now))
                       for l in lives])

    @property
    def failure(self) -> str | None:
        with self._lock:
            return self._failed

    @staticmethod
    def deliver(events: list) -> None:
        for sink, event in events:
            try:
                sink(event)
            except Exception:  # a broken sink must not stop the other requests
                pass
