"""The expert request stream a single-GPU offloaded deployment sees (issue 13, the simulator's input).

Default: batch 1, every token a decode step. Sequences in order of first appearance, tokens by
position, per token the MoE layers in order, each requesting its k experts in the trace's order
(-1 = none, skipped; a repeated id within one step is requested once). Key = layer * E + expert.
With `prompt_tokens` P > 0 the first P tokens of each sequence form one prefill step per layer,
requesting the distinct experts those tokens use, in order of first request.

One step = one (token or prefill chunk, MoE layer): its requests are consecutive in the stream.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moeplan.passes.analysis.activation import sequence_ids, stream_order
from moeplan.passes.analysis.trace.format import Trace


@dataclass(frozen=True)
class Stream:
    """Requests in serving order.

    keys        int64 [R]  layer * E + expert of every request
    step        int64 [R]  step index of every request
    step_layer  int64 [S]  MoE layer of each step
    step_token  int64 [S]  index of the step's token (or prefill chunk) in serving order
    step_seq    int64 [S]  sequence number (serving order) of each step
    step_start  int64 [S+1] first request of each step (and R at the end)
    """

    keys: np.ndarray
    step: np.ndarray
    step_layer: np.ndarray
    step_token: np.ndarray
    step_seq: np.ndarray
    step_start: np.ndarray
    num_layers: int
    num_experts: int
    num_tokens: int  # decode tokens + prefill chunks (forward passes)
    generated_tokens: int  # tokens in the trace (each yields one token of output or prompt)

    @property
    def num_keys(self) -> int:
        return self.num_layers * self.num_experts

    @property
    def num_requests(self) -> int:
        return len(self.keys)

    def request_layer(self) -> np.ndarray:
        return self.keys // self.num_experts


def build_stream(trace: Trace, prompt_tokens: int = 0) -> Stream:
    """The request stream of `trace` (see module docstring)."""
    order = stream_order(trace)
    seq = sequence_ids(trace)[order]
    ex = trace.experts[order]
    T, L, K = ex.shape
    E = trace.num_experts
    new_seq = np.r_[True, seq[1:] != seq[:-1]] if T else np.zeros(0, bool)
    seq_no = np.cumsum(new_seq) - 1
    pos_in_seq = np.arange(T) - np.maximum.accumulate(np.where(new_seq, np.arange(T), 0)) if T else np.zeros(0, int)
    # a "forward" is a decode token or a prefill chunk; prefill tokens share their chunk's forward
    in_prefill = pos_in_seq < prompt_tokens
    starts_forward = ~in_prefill | (pos_in_seq == 0)
    forward_of = np.cumsum(starts_forward) - 1
    F = int(forward_of[-1]) + 1 if T else 0
    row_in_forward = np.arange(T) - np.flatnonzero(starts_forward)[forward_of] if T else np.zeros(0, int)
    # one entry per (row, layer, choice), ordered by (forward, layer, row, choice); -1s dropped
    f_e = np.repeat(forward_of, L * K)
    l_e = np.tile(np.repeat(np.arange(L), K), T)
    o_e = np.repeat(row_in_forward, L * K) * K + np.tile(np.arange(K), T * L)
    e_e = ex.reshape(-1).astype(np.int64)
    order_e = np.lexsort((o_e, l_e, f_e))
    f_e, l_e, e_e = f_e[order_e], l_e[order_e], e_e[order_e]
    valid = e_e >= 0
    f_e, l_e, e_e = f_e[valid], l_e[valid], e_e[valid]
    step_e = f_e * L + l_e
    # a step requests each expert once: keep the first occurrence (only prefill or repeated ids)
    _, first = np.unique(step_e * E + e_e, return_index=True)
    keep = np.sort(first)
    step_e, keys = step_e[keep], l_e[keep] * E + e_e[keep]
    S = F * L
    step_layer = np.tile(np.arange(L, dtype=np.int64), F)
    step_token = np.repeat(np.arange(F, dtype=np.int64), L)
    fw_seq = seq_no[np.flatnonzero(starts_forward)] if T else np.zeros(0, np.int64)
    step_seq = np.repeat(fw_seq.astype(np.int64), L)
    step_start = np.searchsorted(step_e, np.arange(S + 1), side="left").astype(np.int64)
    return Stream(keys=keys.astype(np.int64), step=step_e.astype(np.int64), step_layer=step_layer,
                  step_token=step_token, step_seq=step_seq, step_start=step_start, num_layers=L,
                  num_experts=E, num_tokens=F, generated_tokens=T)


def truncate(stream: Stream, max_requests: int) -> Stream:
    """The stream's first whole forwards (tokens or prefill chunks) holding at most `max_requests`
    requests (at least one forward)."""
    L = stream.num_layers
    ends = stream.step_start[L::L]  # request count after each forward
    forwards = max(1, int(np.searchsorted(ends, max_requests, side="right")))
    S, R = forwards * L, int(stream.step_start[forwards * L])
    return Stream(keys=stream.keys[:R], step=stream.step[:R], step_layer=stream.step_layer[:S],
                  step_token=stream.step_token[:S], step_seq=stream.step_seq[:S], step_start=stream.step_start[:S + 1],
                  num_layers=L, num_experts=stream.num_experts, num_tokens=forwards,
                  generated_tokens=min(stream.generated_tokens, forwards))
