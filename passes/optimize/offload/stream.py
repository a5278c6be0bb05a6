"""The expert request stream a single-GPU offloaded deployment sees (issue 13, the simulator's input).

Default: batch 1, every token a decode step. Sequences in order of first appearance, tokens by
position, per token the MoE layers in order, each requesting its k experts in the trace's order
(-1 = none, skipped; a repeated id within one step is requested once). Key = layer * E + expert.
With `prompt_tokens` P > 0 the first P tokens of each sequence form one prefill step per layer,
requesting the distinct experts those tokens use, in order of first request.

One step = one (token or prefill chunk, MoE layer): its requests are consecutive in the stream.

Rows: each request also carries the number of token rows of its step routed to its expert (1 in
decode; a prefill chunk's or a batched forward's count), what computing it on the host costs.
Speculation (a trace recorded with `--speculate D`): per step and distance d = 1..D, the distinct
keys of MoE layer l + d that layer l + d's router picks from the step's rows' hidden state at
layer l (trace `speculation`), in row order then choice order: what the speculative prefetcher copies.
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
    rows: np.ndarray | None = None  # int64 [R] token rows of each request (None: 1 each)
    spec_keys: np.ndarray | None = None  # int64 [Q] speculated keys
    spec_start: np.ndarray | None = None  # int64 [S * D + 1] first speculated key of (step, distance)
    spec_depth: int = 0  # D

    @property
    def num_keys(self) -> int:
        return self.num_layers * self.num_experts

    def request_rows(self, r: int) -> int:
        return 1 if self.rows is None else int(self.rows[r])

    def speculated(self, s: int, d: int) -> np.ndarray:
        """Keys speculated at step s for the MoE layer d ahead (empty beyond the recorded depth)."""
        if d > self.spec_depth:
            return self.keys[:0]
        i = s * self.spec_depth + d - 1
        return self.spec_keys[self.spec_start[i]:self.spec_start[i + 1]]

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
    step_e, keys, rows = _requests(f_e, l_e, o_e, ex.reshape(-1).astype(np.int64), L, E)
    S = F * L
    spec = {} if trace.speculation is None else speculation_arrays(trace.speculation[order], forward_of, row_in_forward, S, E)
    step_layer = np.tile(np.arange(L, dtype=np.int64), F)
    step_token = np.repeat(np.arange(F, dtype=np.int64), L)
    fw_seq = seq_no[np.flatnonzero(starts_forward)] if T else np.zeros(0, np.int64)
    step_seq = np.repeat(fw_seq.astype(np.int64), L)
    step_start = np.searchsorted(step_e, np.arange(S + 1), side="left").astype(np.int64)
    return Stream(keys=keys.astype(np.int64), step=step_e.astype(np.int64), step_layer=step_layer,
                  step_token=step_token, step_seq=step_seq, step_start=step_start, num_layers=L,
                  num_experts=E, num_tokens=F, generated_tokens=T, rows=rows, **spec)


def _requests(f_e, l_e, o_e, e_e, L: int, E: int) -> tuple:
    """(step = forward * L + layer, key, rows) of every request, in stream order, from one entry
    per (row, layer, choice): ordered by (forward, layer, row order o_e); -1s dropped; a step
    requests each expert once (the first occurrence is kept: prefill, or a repeated id); rows =
    the entries of that (step, expert)."""
    order = np.lexsort((o_e, l_e, f_e))
    f_e, l_e, e_e = f_e[order], l_e[order], e_e[order]
    valid = e_e >= 0
    f_e, l_e, e_e = f_e[valid], l_e[valid], e_e[valid]
    step_e = f_e * L + l_e
    _, first, count = np.unique(step_e * E + e_e, return_index=True, return_counts=True)
    by_first = np.argsort(first, kind="stable")
    keep = first[by_first]
    return step_e[keep], l_e[keep] * E + e_e[keep], count[by_first].astype(np.int64)


def speculation_arrays(spec: np.ndarray, forward_of: np.ndarray, row_in_forward: np.ndarray, num_steps: int,
                       num_experts: int) -> dict:
    """The Stream's speculation fields from spec int [T, L, D, K] (rows in serving order; -1 =
    none): per (step, distance) the distinct keys in row order, then choice order."""
    T, L, D, K = spec.shape
    group = ((np.repeat(forward_of, L * D * K) * L + np.tile(np.repeat(np.arange(L), D * K), T)) * D
             + np.tile(np.repeat(np.arange(D), K), T * L))  # (step, distance) of every entry
    order_in = np.repeat(row_in_forward, L * D * K) * K + np.tile(np.arange(K), T * L * D)
    target = np.tile(np.repeat(np.arange(L), D * K), T) + np.tile(np.repeat(np.arange(1, D + 1), K), T * L)
    e = spec.reshape(-1).astype(np.int64)
    valid = (e >= 0) & (target < L)
    group, order_in, key = group[valid], order_in[valid], target[valid] * num_experts + e[valid]
    order = np.lexsort((order_in, group))
    group, key = group[order], key[order]
    _, first = np.unique(group * (L * num_experts) + key, return_index=True)
    keep = np.sort(first)
    group, key = group[keep], key[keep]
    start = np.searchsorted(group, np.arange(num_steps * D + 1), side="left").astype(np.int64)
    return {"spec_keys": key.astype(np.int64), "spec_start": start, "spec_depth": D}


def truncate(stream: Stream, max_requests: int) -> Stream:
    """The stream's first whole forwards (tokens or prefill chunks) holding at most `max_requests`
    requests (at least one forward)."""
    L = stream.num_layers
    ends = stream.step_start[L::L]  # request count after each forward
    forwards = max(1, int(np.searchsorted(ends, max_requests, side="right")))
    S, R = forwards * L, int(stream.step_start[forwards * L])
    D = stream.spec_depth
    spec = {} if not D else {"spec_start": stream.spec_start[:S * D + 1], "spec_depth": D,
                             "spec_keys": stream.spec_keys[:int(stream.spec_start[S * D])]}
    return Stream(keys=stream.keys[:R], step=stream.step[:R], step_layer=stream.step_layer[:S],
                  step_token=stream.step_token[:S], step_seq=stream.step_seq[:S], step_start=stream.step_start[:S + 1],
                  num_layers=L, num_experts=stream.num_experts, num_tokens=forwards,
                  generated_tokens=min(stream.generated_tokens, forwards),
                  rows=None if stream.rows is None else stream.rows[:R], **spec)


def restrict(stream: Stream, key_mask: np.ndarray) -> Stream:
    """The requests of keys in `key_mask` (bool [N]) only, steps kept: what one rank of an
    expert-parallel deployment serves from its own experts. The speculation is kept whole (a
    prefetcher copies only the rank's own keys)."""
    keep = key_mask[stream.keys]
    kept_before = np.r_[0, np.cumsum(keep)]
    return Stream(keys=stream.keys[keep], step=stream.step[keep], step_layer=stream.step_layer,
                  step_token=stream.step_token, step_seq=stream.step_seq,
                  step_start=kept_before[stream.step_start].astype(np.int64), num_layers=stream.num_layers,
                  num_experts=stream.num_experts, num_tokens=stream.num_tokens, generated_tokens=stream.generated_tokens,
                  rows=None if stream.rows is None else stream.rows[keep], spec_keys=stream.spec_keys,
                  spec_start=stream.spec_start, spec_depth=stream.spec_depth)


def stream_from_log(log: dict) -> Stream:
    """The stream a runtime expert cache recorded (runtime/expert_cache.OnlineStream.to_record):
    its steps as served, so the simulator replays exactly the requests the run made."""
    arr = lambda name: np.asarray(log[name], dtype=np.int64).reshape(-1)
    keys, start = arr("keys"), arr("step_start")
    step = np.repeat(np.arange(len(start) - 1, dtype=np.int64), np.diff(start))
    tokens = arr("step_token")
    forwards = int(tokens.max()) + 1 if len(tokens) else 0
    spec = {} if "spec_keys" not in log else {"spec_keys": arr("spec_keys"), "spec_start": arr("spec_start"),
                                              "spec_depth": int(log["spec_depth"])}
    return Stream(keys=keys, step=step, step_layer=arr("step_layer"), step_token=tokens, step_seq=arr("step_seq"),
                  step_start=start, num_layers=int(log["num_layers"]), num_experts=int(log["num_experts"]),
                  num_tokens=forwards, generated_tokens=forwards, rows=arr("rows") if "rows" in log else None, **spec)


def batched_stream(experts: np.ndarray, forward: np.ndarray, num_experts: int) -> Stream:
    """The stream of a batched engine (one rank holding every expert): experts [T, L, K] of rows
    already in the engine's row order, forward [T] the forward pass of each row (non-decreasing).
    Per forward and MoE layer one step requesting its rows' distinct experts in row-major order;
    steps without requests are dropped (the runtime logs none). All steps are sequence 0."""
    T, L, K = experts.shape
    F = int(forward[-1]) + 1 if T else 0
    f_e = np.repeat(forward.astype(np.int64), L * K)
    l_e = np.tile(np.repeat(np.arange(L), K), T)
    o_e = np.arange(T * L * K) % K + np.repeat(np.arange(T), L * K) * K
    step_full, keys, rows = _requests(f_e, l_e, o_e, experts.reshape(-1).astype(np.int64), L, num_experts)
    used, step = np.unique(step_full, return_inverse=True)
    start = np.searchsorted(step, np.arange(len(used) + 1), side="left").astype(np.int64)
    return Stream(keys=keys.astype(np.int64), step=step.astype(np.int64), step_layer=(used % L).astype(np.int64),
                  step_token=(used // L).astype(np.int64), step_seq=np.zeros(len(used), np.int64), step_start=start,
                  num_layers=L, num_experts=num_experts, num_tokens=F, generated_tokens=T, rows=rows)
