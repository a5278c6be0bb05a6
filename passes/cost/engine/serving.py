"""A serving prediction for a workload: `--workload RxP+G` = R concurrent requests of P prompt tokens
that each generate G tokens, over the whole deployment.

* tpot_s: the mean decode step over contexts P+1 .. P+G, priced every 32 steps and weighted by the steps
  each point stands for (the quadrature of aiconfigurator-core 0.12.0's runtime.rs: steps i = 0, 32, 64,
  ... < G - 1, KV length P + i + 1, weight min(32, G - 1 - i)); all R requests decode together (or the
  engine's max running requests, where fewer).
* ttft_s: the rule SGLang 0.5.23 follows by default: the requests arrive together and are spread evenly
  over the attention replicas; each replica prefills its requests in arrival order in chunks of
  chunked_prefill_size tokens (a prompt longer than the room left is split, its later part attending to
  its earlier one), the replicas in step; a request's first token comes when the chunk holding its
  prompt's end is done; ttft_s is the mean over requests.
* output_tokens_per_s: R / tpot_s (every running request emits one token per step).
* memory_per_gpu_bytes and fits: `memory.py`, at context P + G.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from moeplan.passes.cost.engine import memory as M
from moeplan.passes.cost.engine.step import decode_ops, prefill_ops
from moeplan.passes.cost.options import workload_figures

STRIDE = 32  # decode steps one price stands for


@dataclass(frozen=True)
class Workload:
    requests: int
    prompt: int
    new_tokens: int

    def __str__(self) -> str:
        return f"{self.requests}x{self.prompt}+{self.new_tokens}"


def parse_workload(text: str) -> Workload:
    """`RxP+G` (e.g. 512x4096+512) -> Workload; a one-line UserError otherwise (the one grammar of
    `--workload`, `passes/cost/options.py: workload_figures`)."""
    return Workload(*workload_figures(text))


def decode_points(prompt: int, new_tokens: int) -> list:
    """[(context before the new token, weight)]: the quadrature over the G - 1 decode steps."""
    steps = new_tokens - 1
    return [(prompt + i, min(STRIDE, steps - i)) for i in range(0, steps, STRIDE)]


def tpot(model, dep, pricer, batch: int, prompt: int, new_tokens: int, load) -> tuple:
    """(seconds per output token, StepPrice of the middle point)."""
    points = decode_points(prompt, new_tokens)
    if not points:
        return 0.0, None
    total, middle = 0.0, None
    for i, (context, weight) in enumerate(points):
        price = pricer.step(decode_ops(model, dep, batch, context, list(load.tokens)))
        total += price.seconds * weight
        if i == len(points) // 2:
            middle = price
    return total / (new_tokens - 1), middle


def prefill_chunks(requests: int, prompt: int, chunk: int) -> list:
    """One replica's chunks: [(pieces ((sequences, new tokens, cached tokens), ...), requests finishing)]."""
    out, pieces, room, finishing = [], {}, chunk, 0
    for _ in range(requests):
        done = 0
        while done < prompt:
            take = min(prompt - done, room)
            pieces[(take, done)] = pieces.get((take, done), 0) + 1
            done += take
            room -= take
            if done == prompt:
                finishing += 1
            if room == 0:
                out.append((tuple((n, t, c) for (t, c), n in sorted(pieces.items())), finishing))
                pieces, room, finishing = {}, chunk, 0
    if pieces:
        out.append((tuple((n, t, c) for (t, c), n in sorted(pieces.items())), finishing))
    return out


def ttft(model, dep, pricer, workload: Workload, chunk: int, load_of) -> tuple:
    """(mean seconds to the first token over the requests, seconds of the whole prefill)."""
    per_replica = math.ceil(workload.requests / dep.attention_dp)
    clock, waited = 0.0, 0.0
    for pieces, finishing in prefill_chunks(per_replica, workload.prompt, chunk):
        tokens = sum(n * t for n, t, _ in pieces) * dep.attention_dp
        clock += pricer.step(prefill_ops(model, dep, pieces, finishing, list(load_of(tokens).tokens))).seconds
        waited += finishing * clock
    return waited / per_replica, clock


def predict(model, dep, pricer, profile, workload: Workload, load_of) -> dict:
    """The serving prediction's figures (module docstring; `prediction.py: predict_serving` is the API);
    `load_of(tokens)` gives the busiest rank's MoE load (`rank_rows.RankLoad`) for a step of that many
    tokens over all replicas."""
    device = profile.device_memory_bytes
    limits = M.engine_limits(dep, device)
    running = workload.requests if dep.max_running_requests is None else min(workload.requests, dep.max_running_requests)
    load = load_of(running)
    per_token, middle = tpot(model, dep, pricer, running, workload.prompt, workload.new_tokens, load)
    first, prefill = ttft(model, dep, pricer, workload, limits["chunked_prefill_size"], load_of)
    memory = M.memory_per_gpu(model, dep, device, running, workload.prompt + workload.new_tokens)
    return {
        "workload": str(workload), "tpot_s": per_token, "ttft_s": first, "prefill_s": prefill,
        "output_tokens_per_s": running / per_token if per_token > 0 else 0.0, "running_requests": running,
        "max_over_mean_load": load.max_over_mean, "memory_per_gpu_bytes": memory["memory_per_gpu_bytes"],
        "fits": memory["fits"], "memory": memory, "layout": dep.layout(), "engine_limits": limits,
        "op_prices": tuple(middle.table()) if middle is not None else (),
        "sources": middle.sources() if middle is not None else {},
    }
