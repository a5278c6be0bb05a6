"""A static batch (`moeplan run`, `runtime.serve --prompts`) through the batch worker: the one
generation loop the service runs (`worker.py`), with the step plans made here instead of by rank 0's
scheduler, since every rank knows the whole batch before the first step.

The batch arrives as its requests would at a deployment's ranks: request i at rank i % W, greedy,
exactly `new_tokens` tokens each (no stop ids). Coherent mode runs every sequence on every rank, so
the owners first share their prompts (`share_prompts`: an AllGather counted as `prompt_sync`, the
cost model's 24 bytes per prompt token and other rank, before the timer starts); standard mode runs
each sequence on its owner alone (the owners the service's scheduler gives a batch admitted at once:
fewest running, ties to the lowest rank). Then one plan admits every sequence (the prefill and the
first token) and new_tokens - 1 plans decode: the plans the scheduler makes for a batch that fits
one admission, so a static run generates the service's tokens for the same prompts. Before the timer, a warm-up
sequence per rank runs a prefill and a decode step and leaves (`warm_up`), so the timed steps are the steady state
the cost model prices, not a process's first calls. Standard mode's
tokens stay on their owners (`tokens_to_rank0=False`: each rank writes its own sequences' results,
`results.py`, and no token_sync is spent on rank 0's events).
"""
from __future__ import annotations

import time

import torch

from ..ep.exchange import pack, unpack
from .step_plan import STEP, Admission, StepPlan
from .worker import KEY_STRIDE


def check_fits(prompts: list, new_tokens: int, max_positions: int) -> None:
    """ValueError unless the longest prompt plus `new_tokens` fits the model's positions."""
    longest = max(len(p) for p in prompts) + new_tokens
    if longest > max_positions:
        raise ValueError(f"prompt + new tokens = {longest} exceeds the model's {max_positions} positions; "
                         "give shorter prompts or fewer --new-tokens")


def share_prompts(exchanger, own: dict, rank: int, world: int) -> dict:
    """AllGather of the prompts (`prompt_sync`): {seq: ids} of this rank's requests -> every request's,
    sorted by sequence. Rows: (seq, position, token) int64 triples."""
    meta = torch.tensor([[s, p, t] for s in sorted(own) for p, t in enumerate(own[s])], dtype=torch.int64).reshape(-1, 3)
    rows = pack(torch.zeros(meta.shape[0], 0), meta)
    entries: dict = {}
    for got in exchanger.exchange([rows[:0] if d == rank else rows for d in range(world)], rows.shape[1], None,
                                  "prompt_sync"):
        _, m = unpack(got.cpu(), 0)
        for s, p, t in m.tolist():
            entries.setdefault(s, []).append((p, t))
    contexts = {s: list(ids) for s, ids in own.items()}
    contexts.update({s: [t for _, t in sorted(e)] for s, e in entries.items() if s not in own})
    return dict(sorted(contexts.items()))


WARM_PROMPT = (1, 2, 3)  # token ids of the warm-up's sequences (any ids the vocabulary has)


def warm_up(worker, first_seq: int) -> None:
    """A throw-away sequence on every rank through a prefill and a decode step, then gone, and the counts, records
    and expert caches put back (`BatchWorker.forget_counts`): the timed steps then carry no process's first-call
    costs (the demo's 4 CPU ranks ran their first mode at 21 ms a token and the second at 4.2, the same plan)."""
    seqs = [first_seq + r for r in range(worker.world)]
    worker.step(StepPlan(STEP, [Admission(s, r, WARM_PROMPT, seed=0, temperature=0.0, top_p=1.0, top_k=0)
                                for r, s in enumerate(seqs)]))
    worker.step(StepPlan(STEP))
    worker.step(StepPlan(STEP, depart=seqs))
    worker.forget_counts()


def run_batch(worker, prompts: list, new_tokens: int) -> dict:
    """Generate `new_tokens` greedy tokens for every prompt (lists of ids; only this rank's own requests'
    are read). This rank's results: generated {seq: ids} of its own requests, elapsed_s (the steps),
    counters, context (coherent: per block [hidden | kv, elements per token]) and max_len, the stride
    of the recorded keys (key = sequence x max_len + position)."""
    engine = worker.engine
    rank, world, count = worker.rank, worker.world, len(prompts)
    own = {s: list(prompts[s]) for s in range(count) if s % world == rank}
    warm_up(worker, count)  # first: its counts are forgotten, the prompts' sharing below is the run's
    known = share_prompts(engine.ex, own, rank, world) if worker.coherent else own
    admit = [Admission(s, s % world, tuple(known.get(s, ())), seed=0, temperature=0.0, top_p=1.0, top_k=0)
             for s in range(count)]
    generated = {s: [] for s in own}
    plan = StepPlan(STEP, admit)
    start = time.perf_counter()
    for _ in range(new_tokens):
        for seq, token in worker.step(plan).items():
            if seq in generated:
                generated[seq].append(token)
        plan = StepPlan(STEP)
    elapsed = time.perf_counter() - start
    return {"generated": generated, "elapsed_s": elapsed, "counters": engine.counters.to_dict(),
            "context": [[k, int(n)] for k, n in engine.context_plan] if worker.coherent else [],
            "max_len": KEY_STRIDE}
