"""The generation loop's bookkeeping in a Lambda bundle: which rows a step runs, and the next tokens.

Why: one Step Functions execution generates all of a request's tokens. Its state (`state.py`,
JSON) carries the request, not the tensors. Step 0 runs every prompt token (the prefill); step t > 0 runs each sequence's last token at
position len + t - 1. Prompts are left-padded, so the key mask of step t is the prompt's padding
mask followed by t columns of True. The function that computes the logits picks every sequence's
next token (greedy at temperature 0; otherwise seeded per token), stops a sequence on a stop token
(not emitted) or at max_tokens, and ends the loop when all have stopped.

What it shares with the service's loop (`serving/`): the sampler (`sampler.py`: greedy and the
per-token seeds), the stop rule (`stop_rule.py`) and the prefill's left-pad key mask
(`row_cache.left_pad_mask`). What it cannot: the batch worker and its row cache, because an
execution's step is not one forward in one process. Its dense parts run in separate functions,
each holding only its own blocks' K/V between steps (`kv.py`: container memory or deltas in
storage), its experts in other functions invoked per layer. An execution's sequences never join
or leave, so it has no rows to move, and no process group, so no token sync (the state document
carries the tokens).
"""
from __future__ import annotations

import torch

from ..serving.row_cache import left_pad_mask
from ..serving.sampler import Sampler
from ..serving.stop_rule import token_outcome
from .state import initial_state  # noqa: F401  (re-exported)


def step_rows(doc: dict) -> dict:
    """The flat rows of the execution's current step: ids, positions, seq [N], key_mask [B, past + W]."""
    lens, step = [int(n) for n in doc["lens"]], int(doc["step"])
    if step == 0:
        prompts = doc["prompt"]
        ids = torch.tensor([int(t) for p in prompts for t in p], dtype=torch.int64)
        positions = torch.cat([torch.arange(n) for n in lens])
        seq = torch.cat([torch.full((n,), b) for b, n in enumerate(lens)])
        return {"ids": ids, "positions": positions, "seq": seq, "key_mask": left_pad_mask(lens)}
    last = [int(t[-1]) if t else 0 for t in doc["tokens"]]  # a sequence that already stopped feeds 0
    return {"ids": torch.tensor(last, dtype=torch.int64),
            "positions": torch.tensor([n + step - 1 for n in lens], dtype=torch.int64),
            "seq": torch.arange(len(lens)),
            "key_mask": torch.cat([left_pad_mask(lens), torch.ones(len(lens), step, dtype=torch.bool)], dim=1)}


def has_next_step(doc: dict) -> bool:
    """Can a step follow this one? (Else nothing reads the K/V this step leaves.)"""
    return int(doc["step"]) + 1 < int(doc["gen"]["max_tokens"])


def rows_per_sequence(state: dict) -> int:
    """W: the columns this step appends to every sequence's cache."""
    return int(torch.bincount(state["seq"]).max()) if state["seq"].numel() else 0


def last_rows(state: dict) -> torch.Tensor:
    """[B] index of each sequence's last row (its highest position) among the step's rows."""
    seq, positions = state["seq"], state["positions"]
    B = int(seq.max()) + 1
    key = seq * (int(positions.max()) + 1) + positions
    best = torch.full((B,), -1, dtype=torch.int64).scatter_reduce(0, seq, key, reduce="amax")
    return torch.nonzero(key[None, :] == best[:, None])[:, 1]


def pick(logits: torch.Tensor, gen: dict, index: int) -> list:
    """Next token of each row of logits [B, V] (sequence b seeded with the request's seed + b);
    `index` is the generated token's index (its seed)."""
    params = [(float(gen.get("temperature", 0.0)), float(gen.get("top_p", 1.0)), int(gen.get("top_k", 0)),
               int(gen.get("seed", 0)) + b) for b in range(logits.shape[0])]
    return Sampler().sample(logits, params, [index] * logits.shape[0])


def advance(doc: dict, state: dict) -> dict:
    """The execution's state after this step's logits: tokens appended, sequences stopped, step + 1."""
    gen = doc["gen"]
    rows = state["logits"][last_rows(state)]
    picked = pick(rows, gen, int(doc["step"]))
    stops = {int(t) for t in gen.get("stop_token_ids", [])}
    tokens = [list(t) for t in doc["tokens"]]
    finished = list(doc["finished"])
    for b, t in enumerate(picked):
        if finished[b] is not None:
            continue
        emit, finished[b] = token_outcome(t, stops, len(tokens[b]), int(gen["max_tokens"]))
        if emit:
            tokens[b].append(t)
    return dict(doc, step=int(doc["step"]) + 1, tokens=tokens, finished=finished,
                done=all(f is not None for f in finished), active={})
