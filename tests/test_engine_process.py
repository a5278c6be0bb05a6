"""Rank 0's engine process protocol (runtime/serving/engine_process.py), both ends in this process over
a real socket pair: the parent's `Relay` with the real `Scheduler`, the child's `run_leader` with a
`SchedulerLink` over a worker that stands in for the model (one token per running sequence per step).
The engine runs ahead of its plans but never past a request's max_tokens; events arrive in order."""
import socket
import threading

import torch

from moeplan.runtime.serving.contract import GenerationRequest, SamplingParams
from moeplan.runtime.serving.engine_loop import run_leader
from moeplan.runtime.serving.engine_process import Channel, Relay, SchedulerLink
from moeplan.runtime.serving.scheduler import Limits, Scheduler
from moeplan.runtime.serving.contract import FINISH_ABORT, FINISH_LENGTH, FINISH_STOP

STOP_TOKEN = 5


class CountingWorker:
    """BatchWorker's interface at world 1: each step gives every running sequence the token
    `token_of(seq, n)` (n: its steps so far) and counts the steps it ran each sequence for."""

    world = 1

    def __init__(self, token_of):
        self.running, self.steps, self.token_of = set(), {}, token_of

    def step(self, plan) -> dict:
        self.running -= set(plan.depart)
        self.running |= {a.seq for a in plan.admit}
        out = {}
        for seq in sorted(self.running):
            self.steps[seq] = self.steps.get(seq, 0) + 1
            out[seq] = self.token_of(seq, self.steps[seq])
        return out

    def gather_stats(self) -> list:
        return [torch.zeros(1 * 6 + 8, dtype=torch.float64)]


def _serve(token_of):
    a, b = socket.socketpair()
    parent, child = Channel(a.detach()), Channel(b.detach())
    client = Scheduler("m", Limits(4096, 8, 8), vocab_size=50, world=1, coherent=False, num_layers=1)
    worker = CountingWorker(token_of)
    threads = [threading.Thread(target=Relay(parent, lambda: "closed").run, args=(client,), daemon=True),
               threading.Thread(target=run_leader, args=(worker, SchedulerLink(child, worker), None), daemon=True)]
    for t in threads:
        t.start()
    return client, worker, threads


class Events:
    def __init__(self):
        self.by_id, self.cond = {}, threading.Condition()

    def sink(self, rid):
        self.by_id[rid] = []

        def put(event):
            with self.cond:
                self.by_id[rid].append(event)
                self.cond.notify_all()
        return put

    def wait_done(self, ids, timeout=30):
        with self.cond:
            assert self.cond.wait_for(lambda: all(self.by_id[i] and self.by_id[i][-1].finish_reason for i in ids),
                                      timeout), {i: self.by_id[i] for i in ids}


def _request(rid, max_tokens, stop=()):
    return GenerationRequest(rid, (1, 2, 3), max_tokens, SamplingParams(0.0, 1.0, 0, None), tuple(stop), False)


def test_requests_get_exactly_their_tokens_and_no_row_runs_past_its_max_tokens():
    client, worker, threads = _serve(lambda seq, n: 10 + n)
    events = Events()
    budgets = {f"r{i}": 3 + 4 * i for i in range(6)}
    for rid, budget in budgets.items():
        client.submit(_request(rid, budget), events.sink(rid))
    events.wait_done(list(budgets))
    for seq, (rid, budget) in enumerate(budgets.items()):
        tokens = [e.token_id for e in events.by_id[rid] if e.token_id >= 0]
        assert tokens == [10 + n for n in range(1, budget + 1)]
        assert events.by_id[rid][-1].finish_reason == FINISH_LENGTH
        assert worker.steps[seq] == budget  # a row at its budget waits for its departure: no step past it
    client.shutdown()
    for t in threads:
        t.join(10)
        assert not t.is_alive()


def test_a_stop_token_ends_the_request_though_its_row_may_run_ahead_within_its_budget():
    client, worker, threads = _serve(lambda seq, n: STOP_TOKEN if n == 3 else 20 + n)
    events = Events()
    client.submit(_request("s", 50, stop=(STOP_TOKEN,)), events.sink("s"))
    events.wait_done(["s"])
    assert [e.token_id for e in events.by_id["s"] if e.token_id >= 0] == [21, 22]
    assert events.by_id["s"][-1].finish_reason == FINISH_STOP
    with events.cond:  # the departure reaches the engine within a few steps, never past the budget
        events.cond.wait_for(lambda: not worker.running, 10)
    assert not worker.running and 3 <= worker.steps[0] <= 50
    client.shutdown()
    for t in threads:
        t.join(10)


def test_a_cancelled_request_ends_with_its_abort_after_every_token_event():
    client, worker, threads = _serve(lambda seq, n: 30 + n)
    events = Events()
    client.submit(_request("c", 4000), events.sink("c"))
    with events.cond:
        events.cond.wait_for(lambda: len(events.by_id["c"]) >= 3, 10)
    client.cancel("c")
    events.wait_done(["c"])
    kinds = [e.finish_reason for e in events.by_id["c"]]
    assert kinds[-1] == FINISH_ABORT and all(k is None for k in kinds[:-1])
    client.shutdown()
    for t in threads:
        t.join(10)
        assert not t.is_alive()
