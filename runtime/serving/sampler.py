"""Next tokens from logits, per request: greedy (temperature 0), or temperature / top-k / top-p
sampling that is reproducible whatever shares the batch and whichever rank samples.

Why a seed per token: in coherent mode the rank holding a token's logits changes from step to step
(the rank of its last block's heaviest expert), so no rank can keep a request's generator running.
Each sampled token draws from a generator seeded with (request seed, token index) instead, which
any rank can rebuild; rank 0 gives every request without a seed one of its own at admission.
"""
from __future__ import annotations

import torch

MASK64 = (1 << 63) - 1


def token_seed(seed: int, index: int) -> int:
    """The generator seed of a request's `index`-th generated token (a fixed mix, < 2**63)."""
    return (int(seed) * 0x9E3779B97F4A7C15 + int(index) * 0xBF58476D1CE4E5B9 + 1) & MASK64


def filtered_probs(logits: torch.Tensor, temperature: float, top_p: float, top_k: int) -> torch.Tensor:
    """Probabilities [V] after temperature, top-k (0 or -1: off) and top-p (1: off) on logits [V]:
    top-k keeps the k largest (ties at the k-th kept), top-p the smallest prefix of the sorted
    distribution whose mass reaches top_p (the most likely token always kept)."""
    x = logits.float() / float(temperature)
    if 0 < top_k < x.numel():
        kth = torch.topk(x, top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True, stable=True)
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # mass ahead of each token
        drop = order[before >= top_p]
        probs = probs.clone()
        probs[drop] = 0.0
        probs = probs / probs.sum()
    return probs


class Sampler:
    """Samples one token per row; one generator, reseeded per token (see module docstring)."""

    def __init__(self):
        self.generator = torch.Generator(device="cpu")

    def sample(self, logits: torch.Tensor, params: list, indices: list) -> list:
        """logits [m, V]; params[i] = (temperature, top_p, top_k, seed) of row i's request; indices[i]
        the index of the token being generated. Returns m token ids."""
        out = [0] * len(params)
        greedy = [i for i, p in enumerate(params) if p[0] <= 0.0]
        if greedy:
            picks = torch.argmax(logits[greedy], dim=-1).tolist()
            for i, t in zip(greedy, picks):
                out[i] = int(t)
        for i, (temperature, top_p, top_k, seed) in enumerate(params):
            if temperature <= 0.0:
                continue
            probs = filtered_probs(logits[i].cpu(), temperature, top_p, top_k)
            self.generator.manual_seed(token_seed(seed, indices[i]))
            out[i] = int(torch.multinomial(probs, 1, generator=self.generator))
        return out
