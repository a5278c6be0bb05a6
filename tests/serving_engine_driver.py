"""Run under torchrun by tests/test_serving_engine.py: every rank serves a bundle with the bundle's own
runtime (`runtime.serving.ranks.serve_bundle`); rank 0's front is this script instead of HTTP, so
the tests see the engine's events exactly as the HTTP front receives them.

usage: torchrun ... serving_engine_driver.py BUNDLE OUT SCENARIO [mode=M] [context=C] [max_sequences=N] [max_waiting=N]
scenarios: `engine` (idle CPU, 16 concurrent greedy requests, seeded sampling, cancel, stop ids,
overload, drain), `exact` (the 16 greedy requests only) and `fault` (rank 1 is killed
mid-generation). Rank 0 writes OUT/result.json.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

BUNDLE, OUT, SCENARIO = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
OPTIONS = dict(a.split("=", 1) for a in sys.argv[4:])
sys.path.insert(0, str(BUNDLE))

from runtime.serving.contract import GenerationRequest, Overloaded, SamplingParams, Unavailable  # noqa: E402
import runtime.serving.engine_start as engine_start  # noqa: E402
from runtime.serving.ranks import serve_bundle  # noqa: E402

RANK = int(os.environ["RANK"])
(OUT / f"pid-{RANK}").write_text(str(os.getpid()))


def exact_prompts(vocab: int) -> list:
    """16 prompts of different lengths (2..31 tokens), distinct contents, ids in 1..vocab-1."""
    return [[(7 * i + 3 * j + 1) % (vocab - 1) + 1 for j in range(2 + (i * 11) % 30)] for i in range(16)]


def greedy_batch(client, c, prompts) -> dict:
    """16 concurrent greedy requests, arriving while others run and leaving apart."""
    for i, p in enumerate(prompts):
        client.submit(request(f"g{i}", p, 6 + (i * 5) % 13), c.sink(f"g{i}"))
        if i >= 8:
            time.sleep(0.01)
    c.wait([f"g{i}" for i in range(16)])
    return {f"g{i}": {"prompt": prompts[i], "tokens": c.tokens(f"g{i}"), "finish": c.finish(f"g{i}"),
                      "max_tokens": 6 + (i * 5) % 13} for i in range(16)}


class Collector:
    """Sinks that record every event; wait() until the given requests ended."""

    def __init__(self):
        self.events, self.cond = {}, threading.Condition()

    def sink(self, request_id):
        self.events.setdefault(request_id, [])

        def put(event):
            with self.cond:
                self.events[request_id].append(event)
                self.cond.notify_all()
        return put

    def ended(self, request_id) -> bool:
        ev = self.events.get(request_id, [])
        return bool(ev) and ev[-1].finish_reason is not None

    def wait(self, ids, timeout=120.0) -> None:
        deadline = time.monotonic() + timeout
        with self.cond:
            while not all(self.ended(i) for i in ids):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"requests {[i for i in ids if not self.ended(i)]} did not end")
                self.cond.wait(left)

    def tokens(self, request_id) -> list:
        return [e.token_id for e in self.events[request_id] if e.token_id >= 0]

    def finish(self, request_id) -> str:
        return self.events[request_id][-1].finish_reason


def cpu_seconds(pid: int) -> float:
    """utime + stime of the process and of its child processes (rank 0's engine process)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    own = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    children = [int(c) for t in Path(f"/proc/{pid}/task").iterdir() for c in (t / "children").read_text().split()]
    return own + sum(cpu_seconds(c) for c in children)


def request(rid, prompt, max_tokens, temperature=0.0, seed=None, top_p=1.0, top_k=0, stop=(), ignore_eos=False):
    return GenerationRequest(rid, tuple(prompt), max_tokens, SamplingParams(temperature, top_p, top_k, seed),
                             tuple(stop), ignore_eos)


def engine_front(client, plan, codec) -> int:
    out, c = {}, Collector()
    world = int(os.environ["WORLD_SIZE"])
    # 1. idle: every rank's CPU time over 4 s of an idle service
    time.sleep(1.0)
    pids = [int((OUT / f"pid-{r}").read_text()) for r in range(world)]
    before = [cpu_seconds(p) for p in pids]
    time.sleep(4.0)
    out["idle_cpu_s"] = [cpu_seconds(p) - b for p, b in zip(pids, before)]
    out["idle_window_s"] = 4.0
    # 2. 16 concurrent greedy requests of different lengths
    prompts = exact_prompts(client.vocab_size)
    out["greedy"] = greedy_batch(client, c, prompts)
    # 3. a seeded request alone, then beside others (sampled and greedy), then with another seed
    seeded = dict(temperature=0.9, seed=1234, top_p=0.95, top_k=40)
    client.submit(request("s-alone", prompts[3], 12, **seeded), c.sink("s-alone"))
    c.wait(["s-alone"])
    for i in range(6):
        client.submit(request(f"n{i}", prompts[i + 5], 10 + i, temperature=1.0), c.sink(f"n{i}"))
    client.submit(request("s-crowd", prompts[3], 12, **seeded), c.sink("s-crowd"))
    client.submit(request("s-other", prompts[3], 12, **dict(seeded, seed=99)), c.sink("s-other"))
    c.wait(["s-crowd", "s-other"] + [f"n{i}" for i in range(6)])
    out["seeded"] = {k: c.tokens(k) for k in ("s-alone", "s-crowd", "s-other")}
    # 4. cancel mid-generation: the slot is free by the next step
    client.submit(request("cancel-me", prompts[0], 40), c.sink("cancel-me"))
    with c.cond:
        c.cond.wait_for(lambda: len(c.events["cancel-me"]) >= 3, timeout=60)
    client.cancel("cancel-me")
    c.wait(["cancel-me"])
    time.sleep(0.2)
    out["cancel"] = {"finish": c.finish("cancel-me"), "tokens": len(c.tokens("cancel-me")),
                     "running_after": client.metrics()["running"]}
    # 5. stop token ids end a request without emitting the stop token; ignore_eos runs on
    g0 = out["greedy"]["g0"]["tokens"]
    stop = g0[2]
    client.submit(request("stop", prompts[0], 10, stop=[stop]), c.sink("stop"))
    client.submit(request("ignore", prompts[0], 10, stop=[stop], ignore_eos=True), c.sink("ignore"))
    c.wait(["stop", "ignore"])
    out["stop"] = {"stop_id": stop, "tokens": c.tokens("stop"), "finish": c.finish("stop"),
                   "ignore_tokens": c.tokens("ignore"), "ignore_finish": c.finish("ignore")}
    # 6. overload: more than running + waiting at once
    limits = client.limits
    overloaded, accepted = 0, []
    for i in range(limits.max_sequences + limits.max_waiting + 8):
        try:
            client.submit(request(f"o{i}", prompts[i % 16], 20), c.sink(f"o{i}"))
            accepted.append(f"o{i}")
        except Overloaded as exc:
            overloaded += 1
            assert exc.retry_after_s >= 1
    c.wait(accepted)
    out["overload"] = {"overloaded": overloaded, "accepted": len(accepted),
                       "finishes": sorted({c.finish(r) for r in accepted})}
    # 7. drain: in-flight requests finish, new ones are refused
    for i in range(4):
        client.submit(request(f"d{i}", prompts[i], 15), c.sink(f"d{i}"))
    client.drain()
    try:
        client.submit(request("late", prompts[0], 4), c.sink("late"))
        out["late_refused"] = False
    except Unavailable:
        out["late_refused"] = True
    c.wait([f"d{i}" for i in range(4)])
    out["drain"] = {f"d{i}": [c.finish(f"d{i}"), len(c.tokens(f"d{i}"))] for i in range(4)}
    out["idle_after_drain"] = client.idle()
    out["metrics"] = {k: v for k, v in client.metrics().items() if k != "exchange_bytes"}
    time.sleep(1.2)  # one stats gather after the work
    m = client.metrics()
    out["exchange_bytes"] = [[layer, kind, b] for (layer, kind), b in m["exchange_bytes"].items()]
    out["gpu_local_fraction"] = m["gpu_local_fraction"]
    out["healthy"] = client.healthy()
    (OUT / "result.json").write_text(json.dumps(out))
    return 0


def exact_front(client, plan, codec) -> int:
    c = Collector()
    out = {"greedy": greedy_batch(client, c, exact_prompts(client.vocab_size))}
    time.sleep(1.2)  # one stats gather after the work
    out["expert_cache"] = client.metrics()["expert_cache"]
    (OUT / "result.json").write_text(json.dumps(out))
    return 0


def fault_front(client, plan, codec) -> int:
    """Kill rank 1 once every request has a token; record how the requests and health end."""
    c, out = Collector(), {}
    # torchrun's SIGTERM after the kill must not end this front before it writes its result. The handler
    # takes no lock: it runs between any two bytecodes of this thread, perhaps inside the scheduler's
    # lock (client.healthy()), and client.drain() there would wait for that lock forever.
    signal.signal(signal.SIGTERM, lambda *_: None)
    ids = [f"f{i}" for i in range(4)]
    for i, rid in enumerate(ids):
        client.submit(request(rid, [5 + i, 9, 11], 100), c.sink(rid))
    with c.cond:
        c.cond.wait_for(lambda: all(len(c.events[r]) >= 2 for r in ids), timeout=60)
    victim = int((OUT / "pid-1").read_text())
    killed = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    while client.healthy() and time.monotonic() - killed < 20:
        time.sleep(0.05)
    out["unhealthy_after_s"] = time.monotonic() - killed
    c.wait(ids, timeout=20)
    out["finishes"] = [c.finish(r) for r in ids]
    out["errors"] = [c.events[r][-1].error for r in ids]
    out["ended_after_s"] = max(c.events[r][-1].time_s for r in ids) - killed
    try:
        client.submit(request("after", [1, 2], 2), c.sink("after"))
        out["refused_after"] = False
    except Unavailable:
        out["refused_after"] = True
    (OUT / "result.json").write_text(json.dumps(out))
    return 1


class KeptWorker(engine_start.BatchWorker):
    """The service's own worker, kept so that its expert cache's counters and request log can be
    written after the service ends (`cache_log=1`: OUT/expert-cache-RANK.pt, `ExpertCache.record`)."""
    made = []

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        KeptWorker.made.append(self)


if __name__ == "__main__":
    front = {"engine": engine_front, "exact": exact_front, "fault": fault_front}[SCENARIO]
    number = lambda k: int(OPTIONS[k]) if k in OPTIONS else None
    engine_start.BatchWorker = KeptWorker
    code = serve_bundle(BUNDLE, front, mode=OPTIONS.get("mode"), context=OPTIONS.get("context", "auto"),
                        max_sequences=number("max_sequences"), max_waiting=number("max_waiting"),
                        engine_thread=OPTIONS.get("cache_log") == "1")  # rank 0's worker stays in this process
    if OPTIONS.get("cache_log") == "1":
        import torch
        torch.save(KeptWorker.made[0].engine.model.expert_cache.record(), OUT / f"expert-cache-{RANK}.pt")
    sys.exit(code)
