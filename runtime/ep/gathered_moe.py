"""Standard EP's MoE block with fixed shapes, for a service's decode steps and short prefills: every rank sends
every other its rows, each runs its own experts on the slots that are its, and the partial sums go back: no host
sync, no data-dependent size.

Why: the dynamic-gating path (`Engine._standard`) reads the routing on the host to choose replicas, pack rows per
destination and count them, so a step that runs it cannot be one compiled graph (nor, on a GPU, one CUDA graph).
A decode step moves one row per sequence; sending each to every rank instead of to its experts' ranks costs
(W - 1) x n rows where dynamic gating sends (distinct ranks among a row's slots - local) rows, which at decode
sizes is a few kB per block, and buys a step whose every op has a static shape.

Per MoE block, on every rank, with n the largest decode batch of any rank this step (every rank knows every
rank's sequences from the step plans; the worker sets it) and R = D + 2k:
1. rows [n, R] = hidden state, gate weights, expert ids + 1 of this rank's B rows, padded to n with zeros (0: no
   expert; a dummy row's ids are 0 too), at `wire_dtype`: a bf16 / fp16 hidden state's own dtype, ids as int16
   bit patterns (float32 otherwise, ids exact below 2^24; float32 for every dtype until the twelfth session: a
   bf16 block sent twice the bytes and cast five times);
2. `exchange_equal` (one op, `equal_exchange.py`): the block to every rank, [W * n, R] back, rank order;
3. the slots whose expert is held here run through the library's grouped experts; every other slot takes the
   library's expert-parallel sentinel (expert id = the local count, `_is_expert_parallel`: sorted to the tail,
   skipped by grouped_mm, zeroed): [W * n, D] partial sums;
4. `exchange_equal` again: block s of the partials (at `wire_dtype`) goes back to rank s; the W blocks that come
   back sum, in float32, to the routed output of this rank's rows.
The slots served here are counted on the device (`Engine.local_tally`) and read after the forward. A prefill
gathers where the rows every rank receives, W x n, are at most GATHERED_PREFILL_ROWS: a receiver's experts see
W x n x k slot rows and every rank sends every other n, padding included, so a long prompt, or a prefill over
many ranks, exchanges by dynamic gating (eager: its compute dwarfs its dispatch). (Until 2026-11-29 the cap was on
n alone: at 64 ranks a prefill of one 32-token prompt a rank sent 64 x 63 x 32 rows a block; DeepSeek-V3 on 8 x 8
H100s, 8 prompts of 32 tokens and 8 new each, was priced 8.2 GB a token that way against 1.57 with the cap.)

Where experts have several copies, the replica rule chooses which copy serves each slot, on the device
(`device_replicas.py`: the rule of `expert_table.py`, each source rank's rows taking their turns as that rank
would on the host). Applies (`gather_refusal`) to standard mode over several ranks, transformers' grouped experts
modules (the library's sentinel handling), no expert cache or FP8 experts, and engines that record no routing.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from . import equal_exchange  # registers the exchange_equal op
from .device_replicas import DeviceReplicaRule


GATHERED_PREFILL_ROWS = 512  # ranks x the fullest rank's rows a prefill gathers at most


def gathered_prefill_rows(widths, counts) -> int | None:
    """The rows every rank sends in a gathered prefill where rank r prefills counts[r] prompts left-padded to
    widths[r] tokens: the fullest rank's (at least one), or None where the ranks x those rows exceed
    GATHERED_PREFILL_ROWS (dynamic gating). The worker's rule, and the cost model's (`cost_model.step_pricing`)."""
    rows = max(1, max(int(w) * int(c) for w, c in zip(widths, counts)))
    return rows if len(widths) * rows <= GATHERED_PREFILL_ROWS else None


def gather_refusal(engine) -> str | None:
    """Why `engine`'s decode steps cannot gather (one line), or None where they can."""
    if engine.world == 1 or engine.mode != "standard":
        return "gathered decode steps are for standard mode over several ranks"
    if engine.records:
        return "a recording engine reads the routing on the host"
    for a in engine.model.adapters:
        if a.expert_cache is not None or a.fp8_block is not None:
            return "expert caches and FP8 experts run the dynamic-gating exchange"
        if a.container.kind != "experts" or not hasattr(a.library_experts, "has_gate"):
            return f"{a.container.kind} experts modules have no expert-parallel sentinel in the library"
    return None


def enable_gathering(engine) -> None:
    """Mark the library's experts modules expert-parallel (their sentinel slots cost nothing) and give the engine
    its exchanger's handle and the per-block tally of slots served here."""
    for a in engine.model.adapters:
        a.library_experts._is_expert_parallel = True
    engine.exchange_handle = equal_exchange.register(engine.ex)
    replicated = bool((np.asarray(engine.table.hosts).sum(axis=2) > 1).any())
    engine.replica_rule = DeviceReplicaRule(engine.table, engine.device) if replicated else None
    engine.local_tally = torch.zeros(engine.num_layers, dtype=torch.int64, device=engine.device)


def wire_dtype(dtype: torch.dtype, hidden: int, num_experts: int) -> torch.dtype:
    """What a gathered exchange's rows travel as for a hidden state of `dtype`: the hidden state's own 2-byte dtype
    (half float32's bytes and no casts; gate weights in it, expert ids as int16 bit patterns) where a row pairs into
    float32 words (`hidden` even) and the ids fit int16, else float32. The runtime's rule and the cost model's."""
    two_bytes = dtype.is_floating_point and dtype.itemsize == 2
    return dtype if two_bytes and hidden % 2 == 0 and num_experts < 2 ** 15 else torch.float32


def gathered_route(engine, adapter, h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The routed-expert sum [B, D] of this rank's rows h [B, D] routed to ids / weights [B, k] (module docstring);
    `engine.gather_anchor` [n] carries n as a size a compiled graph keeps symbolic. Rows travel at `wire_dtype`,
    viewed as float32 words (the exchange moves words; the bits arrive as sent); an expert id travels as id + 1, so
    that a padding row, all zeros, routes nowhere."""
    world, rank = engine.world, engine.rank
    n, (B, D), k = engine.gather_anchor.shape[0], h.shape, ids.shape[1]
    wire = wire_dtype(h.dtype, D, adapter.container.num_experts)
    tags = ids + 1                                                                      # [B, k]; 0: no expert
    if not engine.all_real:
        tags = torch.where(engine.dev_real[:, None], tags, 0)
    tags = tags.to(torch.int16).view(wire) if wire.itemsize == 2 else tags.to(wire)
    rows = F.pad(torch.cat([h.to(wire), weights.to(wire), tags], 1), (0, 0, 0, n - B))  # [n, D + 2k]
    got = torch.ops.moeplan.exchange_equal(rows.repeat(world, 1).view(torch.float32), engine.exchange_handle,
                                           adapter.layer, "dispatch").view(wire)        # [W n, D + 2k]
    tags = got[:, D + k:]
    tags = (tags.view(torch.int16) if wire.itemsize == 2 else tags).to(torch.int64)   # [W n, k]: exact
    local = adapter.served_slots(tags)                        # held here: local index; else (or none) the sentinel
    sentinel = adapter.num_slots
    if engine.replica_rule is not None:  # the copy the rule gives each slot, every row's source rank its current one
        source = torch.arange(world * n, device=h.device) // n
        local = torch.where(engine.replica_rule.choose(adapter.moe, tags - 1, source) == rank, local, sentinel)
    own = local[rank * n: rank * n + B]
    engine.local_tally[adapter.layer] += (own < sentinel).sum()
    hidden = got[:, :D].to(h.dtype, memory_format=torch.contiguous_format)           # one copy whatever the wire
    partial = adapter.local_expert_output(hidden, local, got[:, D:D + k].contiguous())   # [W n, D]
    back = torch.ops.moeplan.exchange_equal(partial.to(wire).contiguous().view(torch.float32), engine.exchange_handle,
                                            adapter.layer, "combine").view(wire)
    return back.view(world, n, D).sum(dim=0, dtype=torch.float32)[:B].to(h.dtype)
