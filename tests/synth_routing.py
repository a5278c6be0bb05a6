"""Synthetic routing traces whose routing depends on token id, position and attention id.

Why: popularity predictors must be tested where the answer is known - routing that a token id
alone cannot explain (so a Lina-style predictor is beatable) but token id + position can. The
generative model, per layer l and token (id v, position p, attention id a):
  logits = A_l[v] + B_l[p // position_bucket] * position_strength + C_l[a] * attention_strength
           + Gumbel noise * noise
and the top-k logits are the token's experts, heaviest first. Token ids follow a Zipf law (as
real text does); attention ids are an earlier token of the same sequence. Deterministic for a seed.
"""
from __future__ import annotations

import numpy as np

from moeplan.passes.analysis.trace.format import Trace, make_trace


def synthesize_routed_tokens(*, tokens: int, layers: int, experts: int, top_k: int, vocab: int = 256,
                             seq_len: int = 128, position_bucket: int = 32, position_strength: float = 2.0,
                             attention_strength: float = 0.5, noise: float = 0.5, zipf: float = 1.1,
                             seed: int = 0) -> Trace:
    rng = np.random.default_rng(seed)
    p_tok = 1.0 / np.arange(1, vocab + 1) ** zipf
    p_tok = p_tok[rng.permutation(vocab)]
    p_tok /= p_tok.sum()
    token_ids = rng.choice(vocab, size=tokens, p=p_tok)
    positions = np.arange(tokens) % seq_len
    sequence = np.arange(tokens) // seq_len
    buckets = -(-seq_len // position_bucket)
    attention = np.empty((tokens, layers), dtype=np.int64)
    experts_out = np.empty((tokens, layers, top_k), dtype=np.int32)
    for l in range(layers):
        back = np.minimum(positions, rng.integers(0, 8, size=tokens))
        attention[:, l] = token_ids[np.arange(tokens) - back]
        A = rng.normal(size=(vocab, experts))
        B = rng.normal(size=(buckets, experts))
        C = rng.normal(size=(vocab, experts))
        logits = (A[token_ids] + position_strength * B[positions // position_bucket]
                  + attention_strength * C[attention[:, l]] + noise * rng.gumbel(size=(tokens, experts)))
        experts_out[:, l, :] = np.argsort(-logits, axis=1, kind="stable")[:, :top_k]
    return make_trace(experts_out, num_experts=experts, token_ids=token_ids, positions=positions,
                      sequence=sequence, attention_ids=attention)
