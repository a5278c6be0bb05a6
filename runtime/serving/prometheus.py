"""`GET /metrics`: the service's figures in Prometheus' text exposition format (version 0.0.4).

The front measures what it sees (request arrival, every token event's engine time): time to first
token, inter-token latency, end-to-end latency, prompt and generated tokens, finished requests by
reason and refused ones by status. The engine reports the rest through `EngineClient.metrics()`:
running and waiting requests, exchange bytes per layer and kind, expert-cache hits and misses, the
measured GPU-local fraction, engine steps. Written by hand (a few dozen lines) so the bundle needs no
metrics library; the tests read it back with prometheus_client's own parser.

All observations happen on the front's event loop thread (token events reach it through
`call_soon_threadsafe`), and so does rendering: no lock is needed.
"""
from __future__ import annotations

import bisect
import math

PREFIX = "moeplan"
TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0)
ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
               1.0, 2.5, 5.0, 10.0)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)


class Histogram:
    """Cumulative buckets (upper bounds `le`), sum and count, as Prometheus histograms are."""

    def __init__(self, buckets: tuple):
        self.bounds = tuple(float(b) for b in buckets)
        self.counts = [0] * (len(self.bounds) + 1)  # the last one is +Inf
        self.sum, self.count = 0.0, 0

    def observe(self, value: float) -> None:
        value = max(0.0, float(value))
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1


class ServingMetrics:
    """The front's counters and histograms; render(engine figures) -> exposition text."""

    def __init__(self, model_name: str):
        self.labels = {"model_name": model_name}
        self.ttft, self.itl, self.e2e = Histogram(TTFT_BUCKETS), Histogram(ITL_BUCKETS), Histogram(E2E_BUCKETS)
        self.prompt_tokens = self.generation_tokens = 0
        self.finished: dict = {}  # finish reason -> requests
        self.refused: dict = {}  # HTTP status -> requests answered with it

    def request_finished(self, reason: str) -> None:
        self.finished[reason] = self.finished.get(reason, 0) + 1

    def request_refused(self, status: int) -> None:
        self.refused[int(status)] = self.refused.get(int(status), 0) + 1

    def render(self, engine: dict) -> str:
        out: list = []
        gauge = lambda name, help_, value, labels=None: _family(out, name, "gauge", help_, [(labels or {}, value)], self.labels)
        counter = lambda name, help_, samples: _family(out, name, "counter", help_, samples, self.labels)
        gauge("requests_running", "Requests in the running batch.", engine.get("running", 0))
        gauge("requests_waiting", "Requests queued for the batch.", engine.get("waiting", 0))
        _histogram(out, "time_to_first_token_seconds", "Request arrival to its first token.", self.ttft, self.labels)
        _histogram(out, "inter_token_latency_seconds", "Time between a request's successive tokens.", self.itl, self.labels)
        _histogram(out, "e2e_request_latency_seconds", "Request arrival to its last token.", self.e2e, self.labels)
        counter("prompt_tokens_total", "Prompt tokens of admitted requests.", [({}, self.prompt_tokens)])
        counter("generation_tokens_total", "Tokens generated.", [({}, self.generation_tokens)])
        counter("request_success_total", "Requests finished, by finish reason.",
                [({"finished_reason": r}, n) for r, n in sorted(self.finished.items())])
        counter("request_refused_total", "Requests answered with an error status, by status.",
                [({"code": str(c)}, n) for c, n in sorted(self.refused.items())])
        exchange = engine.get("exchange_bytes") or {}
        counter("exchange_bytes_total", "Bytes the ranks' exchanges sent, by layer (block index; 'all' for "
                "exchanges not tied to a block) and kind.",
                [({"layer": "all" if l is None else str(l), "kind": str(k)}, b)
                 for (l, k), b in sorted(exchange.items(), key=lambda i: (-1 if i[0][0] is None else i[0][0], str(i[0][1])))])
        cache = engine.get("expert_cache") or {}
        counter("expert_cache_hits_total", "Expert-cache lookups served from the cache.", [({}, cache.get("hits", 0))])
        counter("expert_cache_misses_total", "Expert-cache lookups that missed (loaded the expert, or computed it on "
                "the host).", [({}, cache.get("misses", 0))])
        counter("expert_cache_prefetches_total", "Experts the prefetcher copied ahead of their layer.",
                [({}, cache.get("prefetches", 0))])
        counter("expert_cache_prefetch_hits_total", "Prefetched experts that a later lookup hit.",
                [({}, cache.get("prefetch_hits", 0))])
        counter("expert_cache_host_computed_total", "Missed experts computed on the host CPU instead of copied.",
                [({}, cache.get("host_computed", 0))])
        local = engine.get("gpu_local_fraction")
        if local is not None:
            gauge("gpu_local_fraction", "Measured share of expert slots served on the token's current rank.", local)
        counter("engine_steps_total", "Batch steps the engine ran.", [({}, engine.get("steps", 0))])
        return "\n".join(out) + "\n"


def _family(out: list, name: str, kind: str, help_: str, samples: list, base: dict) -> None:
    full = f"{PREFIX}_{name}"
    out += [f"# HELP {full} {help_}", f"# TYPE {full} {kind}"]
    out += [f"{full}{_labels(dict(base, **labels))} {_number(value)}" for labels, value in samples]


def _histogram(out: list, name: str, help_: str, h: Histogram, base: dict) -> None:
    full = f"{PREFIX}_{name}"
    out += [f"# HELP {full} {help_}", f"# TYPE {full} histogram"]
    running = 0
    for bound, count in zip(h.bounds + (math.inf,), h.counts):
        running += count
        le = "+Inf" if bound == math.inf else repr(bound)
        out.append(f"{full}_bucket{_labels(dict(base, le=le))} {running}")
    out += [f"{full}_sum{_labels(base)} {_number(h.sum)}", f"{full}_count{_labels(base)} {h.count}"]


def _labels(labels: dict) -> str:
    if not labels:
        return ""
    escape = lambda v: str(v).replace("\\", "\\\\").replace("\"", "\\\"").replace("\n", "\\n")
    return "{" + ",".join(f'{k}="{escape(v)}"' for k, v in labels.items()) + "}"


def _number(value) -> str:
    value = float(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(int(value)) if value.is_integer() and abs(value) < 2 ** 53 else repr(value)
