"""The least time any placement can be predicted to take: what lets `--policy auto` stop early.

Why: `--policy auto` builds and prices placement candidates, cheapest first; the ILP's take
minutes at DeepSeek-V3 scale and on the planning trace they often land within 1-2 % of
contiguous or EPLB, below what the cost model can tell apart. A candidate can only win by more
than the model's error if the floor below is lower than the best price so far by more than that
error; once it is not, no candidate left is worth its solve (`by_predicted_time.choose_placement`).

The floor replays the cost model (`cost_model.predict`) on the same routing samples, keeping each
term that no placement changes and bounding the others from below:
* exchanges: the call's fixed part (2 x collective latency + its Python work) is the same for every
  placement; the messages (latency + bytes per tier) are >= 0;
* compute, per block: c_r = known_r + x_r, known_r the part every placement gives rank r (standard
  mode: attention (at context too), dense MLPs and logits on the token's home rank; every mode: the MoE layer's
  fixed ops), x_r >= 0 the rest, of which only the sum over ranks is bounded: the expert calls
  (every expert a step routes to is called on some rank, every slot computed on one:
  sum_r x_r >= U x (one expert call's ops x op cost, runtime_ops.py) + max(N x expert FLOPs / FLOP/s, U x expert bytes / memory
  bandwidth), U distinct experts, N slots) and, in coherent mode after the first MoE layer (tokens
  sit on their primary ranks, which the placement sets), attention, K/V projection, replica choice
  and logits, each as its total over the step's tokens (attention at context: every key attended to,
  and each sequence's cache read once, on one rank);
* the block's pace max(max_r c_r, sum_r c_r / p) (p ranks compute at once) is then at least
  max(max_r known_r, (sum_r known_r + sum_r x_r) / p).
A service's decode steps that replay CUDA graphs (`runtime_ops.captures_decode_graphs`) are floored at the prices
`predict` gives them: their ops at the device's op cost, gathered MoE blocks' counts at several ranks, one
collective per exchange call and no replica choice on the host. A gathered exchange's messages are the same for
every placement too (every rank sends every other the same rows, `step_pricing`'s, `gathered_moe.py`): given the
topology's GPUs per node they are floored at their full price (at DeepSeek-V3's 64 ranks they are ~40 % of a
captured step, and a floor without them let `--policy auto` solve for minutes candidates all within 1 %).
Each of these is at most the term `predict` charges, so the floor is at most every placement's
prediction (tests/test_cost_floor.py checks it on random placements). It is placement-free: one
figure per mode for a topology, whatever the policy or redundant slots.
"""
from __future__ import annotations

import numpy as np

from moeplan.passes.cost.cost_model import (COHERENT, STANDARD, ModelShape, Workload, _cost, _costs,
                                            _held, _oversubscribed, _slot_ids, _slots, attention_at_context,
                                            collectives_per_call, profile_ops_per_sequence, routing_samples,
                                            slowest_messages, step_pricing)
from moeplan.passes.cost.runtime_ops import captures_decode_graphs, runtime_ops, runtime_profile


def expected_floor(world: int, shape: ModelShape, mode: str, workload: Workload, trace_experts: np.ndarray, profile,
                   samples: int = 4, gpus_per_node: int | None = None) -> float:
    """Seconds per generated token no placement over `world` ranks is predicted below under `mode`:
    the mean floor over the routing samples `cost_model.expected` prices."""
    floors = [floor_seconds_per_token(world, shape, mode, workload, routing, profile, gpus_per_node)
              for routing in routing_samples(workload, trace_experts, samples)]
    return float(sum(floors) / len(floors))


def floor_seconds_per_token(world: int, shape: ModelShape, mode: str, workload: Workload, routing: dict,
                            profile, gpus_per_node: int | None = None) -> float:
    """The floor (module docstring) for one routing {(seq, pos): int [L, k]} of the workload's tokens; without
    `gpus_per_node` a gathered exchange's messages are floored at 0."""
    if mode not in (COHERENT, STANDARD):
        raise ValueError(f"mode must be {COHERENT!r} or {STANDARD!r}, got {mode!r}")
    W = world
    ops = runtime_ops(profile, shape.architecture, shape.held_dtype)  # the prediction's own counts and op cost (cost_model.predict)
    calls = ops.exchange_calls(mode)  # whose exchange calls' ops (cost_model.predict's counter)
    graphs = captures_decode_graphs(profile, W, mode, shape, ops)
    ops = ops.captured() if graphs else ops  # as `predict`
    eager_profile = runtime_profile(profile)
    moe_of = {b: m for m, b in enumerate(shape.moe_blocks)}
    total = 0.0
    for step_tokens in workload.steps():
        keys = sorted(step_tokens)
        n = len(keys)
        seq = np.array([t[0] for t in keys], dtype=np.int64)
        pos = np.array([t[1] for t in keys], dtype=np.int64)
        one_rank = attention_at_context(shape, np.zeros_like(seq), seq, pos, 1)  # every key, each cache read once
        slot_ids = _slot_ids(routing, keys, len(shape.moe_blocks), shape.top_k)
        requests = len(np.unique(seq))
        profile, gathered_rows, moe_ops = step_pricing(eager_profile, ops, graphs, W, mode, seq)  # as `predict`
        gathered = gathered_rows is not None
        # a gathered MoE block's messages: the same for every block of the step (none where the topology is not given)
        messages = _gathered_messages(profile, shape, W, gpus_per_node, gathered_rows) if gathered and gpus_per_node else 0.0
        placed = False  # coherent mode: tokens sit where the placement put them (after the first MoE layer)
        for block in range(shape.num_blocks):
            dense = shape.attention_flops + (shape.moe_dense_flops if block in moe_of else 0.0)
            known, spread = np.zeros(W), 0.0
            if mode == COHERENT and placed:
                total += _call(profile, W, "context", calls)
            if mode == COHERENT:
                known += _cost(profile, ops.coherent_hooks(W), 0.0)
            if mode == COHERENT and placed:
                spread += _cost(profile, ops.attention + profile_ops_per_sequence(profile) * requests,
                                n * dense + float(np.sum(one_rank[0])), shape.attention_bytes + float(np.sum(one_rank[1])))
                known += _cost(profile, ops.coherent_kv_ops(), 0.0)
                spread += _cost(profile, 0, (W - 1) * n * shape.attention_flops / 3)
            else:
                where = seq % W if mode == STANDARD else None
                held, seqs = _held(where, seq, W)
                ctx_flops, ctx_bytes = attention_at_context(shape, where, seq, pos, W)
                known += np.where(held > 0, _costs(profile, ops.attention + profile_ops_per_sequence(profile) * seqs,
                                                   held * dense + ctx_flops, shape.attention_bytes + ctx_bytes), 0.0)
            moe = moe_of.get(block)
            if moe is None:
                if mode == COHERENT and placed:
                    known += _cost(profile, ops.dense_mlp, 0.0)
                    spread += _cost(profile, 0, n * shape.dense_mlp_flops)
                else:
                    known += _costs(profile, ops.dense_mlp, held * shape.dense_mlp_flops)
                total += _pace_floor(profile, known, spread, W)
                continue
            ids = slot_ids[:, moe, :]
            known += _cost(profile, moe_ops, 0.0)
            if mode == STANDARD:
                known += _slots(profile, 0 if gathered else held * shape.top_k)
            elif not placed:
                known += _slots(profile, n * shape.top_k)
            else:
                spread += _slots(profile, n * shape.top_k)
            spread += _experts_floor(profile, shape, ids, ops.expert_call)
            total += _pace_floor(profile, known, spread, W)
            if mode == STANDARD:
                total += _call(profile, W, "dispatch", calls, gathered) + _call(profile, W, "combine", calls, gathered)
                total += messages
            else:
                total += (_call(profile, W, "dispatch", calls) if placed else 0.0) + _call(profile, W, "merge", calls)
                placed = True
        if mode == COHERENT and placed:
            known = np.full(W, _cost(profile, ops.head + ops.coherent_step(W), 0.0))
            total += _pace_floor(profile, known, _cost(profile, 0, n * shape.head_flops), W)
            total += _call(profile, W, "token_sync", calls)
        else:
            ends = np.bincount(seq % W, minlength=W).astype(float)
            total += _pace_floor(profile, _costs(profile, ops.head, ends * shape.head_flops), 0.0, W)
    return total / max(workload.generated_tokens, 1)


def _gathered_messages(profile, shape: ModelShape, world: int, gpus_per_node: int, gathered_rows: int) -> float:
    """A gathered MoE block's dispatch and combine messages (`predict`'s): every rank sends every other
    `gathered_rows` rows (`step_pricing`'s), whatever the placement."""
    node = np.arange(world) // gpus_per_node
    rows = np.full((world, world), gathered_rows)
    np.fill_diagonal(rows, 0)
    same = node[:, None] == node[None, :]
    return sum(sum(slowest_messages(profile, same, rows, row_bytes).values())
               for row_bytes in (shape.gathered_row_bytes, shape.gathered_combine_row_bytes))


def _experts_floor(profile, shape: ModelShape, ids: np.ndarray, call_ops: float) -> float:
    """Least expert work summed over ranks for slots ids int [n, k] (-1: none): every distinct expert
    called once (`call_ops` ops), every slot computed once."""
    valid = ids[ids >= 0]
    called = len(np.unique(valid))
    return (call_ops * called * profile.op_overhead_s
            + max(len(valid) * shape.expert_flops / profile.flops_per_s, called * shape.expert_bytes / profile.memory_bytes_per_s))


def _pace_floor(profile, known: np.ndarray, spread: float, world: int) -> float:
    """Least pace of a block whose ranks compute known float [W] plus, between them, at least `spread`."""
    ranks = max(1, min(world, profile.parallel_ranks))
    return float(max(known.max(), (known.sum() + spread) / ranks))


def _call(profile, world: int, phase: str, calls, known_counts: bool = False) -> float:
    """The fixed part of one exchange call (`cost_model._Counter.exchange`'s `call`, less merge's per-row work),
    its ops `calls.exchange_call` (RuntimeOps); `known_counts`: a gathered step's call, one collective."""
    if world == 1:
        return 0.0
    ops = calls.exchange_call(phase, world)
    # one round where CPU ranks may share a host (the optimistic case: a floor)
    collectives = 1 if known_counts else collectives_per_call(phase, profile.device_is_host)
    return collectives * profile.collective_latency(world) + ops * profile.op_overhead_s * _oversubscribed(profile, world)
