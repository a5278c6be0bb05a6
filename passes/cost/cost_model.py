"""Cost model: what a torchrun plan moves and how long it takes, before it runs.

Why: the placement objective (share of tokens that stay on their GPU) is a proxy. A plan that wins
on it can lose on time (coherent mode's context traffic, more collective calls). This pass
replays the runtime's exchanges (`runtime/ep/engine.py`, `exchange.py`, `expert_table.py`)
on a routing of the served tokens and prices them with a hardware profile, so every decision
(mode, policy, ILP balance) is taken by predicted seconds, and every prediction is one that
`moeplan run --verify` measures.

Traffic (exact, given the routing of the served tokens; summed over ranks like the runtime's
counters). W ranks, D hidden size, k top-k, one float32 = 4 bytes, rows of the runtime's packing:
* dispatch row = 4 (D + k + 2 (1 + ceil(2k / 4))) bytes (hidden, gate weights, key, packed ids
  and destinations), one per (token, distinct destination rank other than its current rank);
* combine row (standard) = 4 D, one per dispatch row (the partial output travels back);
* merge row (coherent) = 4 (D + 2), one per (token, distinct destination rank other than its
  primary rank): each non-primary rank sends its partial sum to the primary;
* context row (coherent) = 4 (C + 2) per token and other rank, at every block after the first
  MoE block, C per block as the runtime chooses (`runtime/ep/context_exchange.py`): the
  normed hidden state (C = D, each rank projects K/V itself) or, where smaller, what the library's
  KV cache stores (K + V = 2 x KV heads x head dim for GQA; latent + rotated key for MLA);
* prompt sync (coherent, once) = 24 bytes per prompt token and other rank; token sync (coherent,
  per step) = 16 bytes per sequence and other rank;
* control = 8 (W - 1) bytes and W - 1 messages per rank per exchange call (the row counts, a collective
  of their own, or in the rows' slot headers for CPU ranks of one host, `runtime/ep/host_channel.py`), but
  standard mode's combine, whose counts are the dispatch's (`Exchanger.exchange_sorted`);
* messages = per rank and call, the number of other ranks it sends at least one row to.
Replica choice is the runtime's own rule (`runtime/ep/expert_table.py`, run here as in the
bundle), so with the run's own routing the bytes equal the measured counters.

Time (per step, then per generated token = sum of steps / generated tokens):
* compute, per block and rank r: c_r = ops_r x op_overhead + max(flops_r / flops_per_s,
  weight bytes read_r / memory bandwidth) (decode on GPUs is weight-read bound), with
  flops_r = attention tokens x attention FLOPs + expert rows x expert FLOPs (+ attention at context:
  FLOPs per key x keys its tokens attend to, and the KV cache read, bytes per cached token x each
  sequence's cache up to its last position on the rank, `attention_context.py`), and ops_r counting
  the torch calls the engine makes (runtime_ops.py: the counts of the runtime's real decode step per model class,
  priced at the profile's measured `runtime_op_overhead_s`, where the profile gives one (GPUs, and CPU calibrations
  since method 5, which fit it); else the fitted ATTN_OPS + attention_ops_per_sequence x sequences, EXPERT_CALL_OPS
  per expert invoked, MOE_OPS per MoE layer, HEAD_OPS per step, at `op_overhead_s`); coherent mode adds its hooks'
  ops per block on every rank (counted: coherent mode's step less standard mode's, its exchanges' ops included;
  fitted: COHERENT_HOOK_OPS) + slots x python_slot_s (the replica choice, a Python loop);
  the block takes max(max_r c_r, sum_r c_r / parallel_ranks): the slowest rank sets the pace,
  and ranks sharing too few cores (CPU) queue;
* communication, per exchange call: 2 x collective latency(W) (counts, then rows; 1 x for the combine, and
  for CPU ranks of one host, whose counts ride with the rows) +
  per message and tier: latency + bytes / bandwidth of the tier (same node / other node), the
  slowest rank's sum, + the call's Python work (runtime_ops.py's `exchange_call`: EXCHANGE_OPS + PEER_OPS[kind] x W ops, none where counted in the MoE block; times
  W / parallel_ranks when ranks outnumber cores).
The constants come from a hardware profile (`core/hardware_data/*.yaml`, `moeplan calibrate`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from moeplan.passes.cost.attention_context import AttentionContext, context_per_rank
from moeplan.passes.cost.runtime_ops import (FITTED, captures_decode_graphs, graph_rows, runtime_ops, runtime_profile,
                                             step_profile)
from moeplan.runtime.ep.expert_table import ExpertTable

COHERENT, STANDARD = "coherent", "standard"
PHASES = ("dispatch", "combine", "merge", "context")
STEP_PHASES = ("prompt_sync", "token_sync")
TIMED_EXCHANGES = PHASES + ("token_sync",)  # prompt sync happens before the runtime's timer starts
EXCHANGE_PARTS = ("call", "same_node", "other_node")
FLOAT = 4
# Torch calls per block, expert call, MoE layer, step and exchange call: ATTN_OPS, EXPERT_CALL_OPS, MOE_OPS,
# HEAD_OPS, EXCHANGE_OPS, PEER_OPS (the fitted counts) or the runtime's counted ones, by profile (runtime_ops.py).
# The replica choice per slot is priced apart (`python_slot_s`, a Python loop step and a tensor store); a merge
# call adds MERGE_OPS_PER_ROW per row it moves.
MERGE_OPS_PER_ROW = 0.5


@dataclass(frozen=True)
class ModelShape:
    """What traffic and compute depend on: sizes of one token's rows and FLOPs per block."""

    hidden: int
    top_k: int
    num_blocks: int
    moe_blocks: tuple            # block index of each MoE layer, in order
    attention_flops: float       # per token per block (norm, projections, scores at a short context)
    expert_flops: float          # per token per routed expert
    dense_mlp_flops: float = 0.0  # per token per dense (non-MoE) block
    head_flops: float = 0.0      # per token (final norm + LM head)
    moe_dense_flops: float = 0.0  # per token per MoE block: router and shared experts (where the token is)
    expert_bytes: float = 0.0    # weights one expert call reads
    attention_bytes: float = 0.0  # weights one block's attention reads
    element_bytes: int = FLOAT   # hidden-state element on the wire (the runtime sends float32)
    wire_bytes: int = FLOAT      # an element of a gathered exchange's rows (runtime/ep/gathered_moe.py `wire_dtype`:
                                 # 2 where the runtime holds the hidden state at bf16 / fp16, `gathered_wire_bytes`)
    context_elements: int | tuple = 0  # coherent context row per token: one int for every block, or one per
                                 # block (the runtime's `context_exchange` plan); 0: the hidden state.
                                 # K and V (2 x kv heads x head dim) or an MLA latent are smaller
    attention_context: AttentionContext | None = None  # per block: FLOPs per (query, key) and KV bytes per cached
                                 # token (attention_context.py); None: attention priced at a short context only
    architecture: str = ""       # the IR's model class: whose counted runtime ops price it (runtime_ops.py)
    held_dtype: str = "bfloat16"  # the dtype the runtime holds its dense weights at: the counts' (runtime_ops.py;
                                  # `context.priced_shape` from the profile, a run's check from what its ranks held)
    decode_graphs: bool = False  # the runtime can capture its decode steps as CUDA graphs (runtime_ops.py:
                                 # `decode_graphs_possible`): a service's GPU ranks do

    @classmethod
    def from_ir(cls, ir) -> ModelShape:
        """From a ModelIR: blocks are the attention stages; MoE stages sit in the block they follow."""
        blocks, moe_blocks, attn, attn_bytes, mlp, head = -1, [], [], [], [], 0.0
        for s in ir.stages:
            if s.is_moe:
                moe_blocks.append(max(blocks, 0))
            elif "attn" in s.kind or "attention" in s.kind:
                blocks += 1
                attn.append(s.flops_per_token)
                attn_bytes.append(s.param_bytes)
            elif s.kind in ("mlp", "dense_mlp", "ffn"):
                mlp.append(s.flops_per_token)
            elif s.kind in ("head", "lm_head", "norm_head"):
                head += s.flops_per_token
        moe = ir.moe_stages[0]
        return cls(hidden=int(moe.hidden_size), top_k=int(moe.top_k), num_blocks=max(blocks + 1, len(moe_blocks)),
                   moe_blocks=tuple(moe_blocks), attention_flops=float(np.mean(attn)) if attn else 0.0,
                   expert_flops=float(moe.expert_flops_per_token),
                   moe_dense_flops=float(max(moe.flops_per_token - moe.top_k * moe.expert_flops_per_token, 0)),
                   dense_mlp_flops=float(np.mean(mlp)) if mlp else 0.0, head_flops=float(head),
                   expert_bytes=float(moe.expert_param_bytes), attention_bytes=float(np.mean(attn_bytes)) if attn_bytes else 0.0,
                   architecture=str(ir.architecture))

    @property
    def dispatch_row_bytes(self) -> int:
        return self.element_bytes * self.hidden + FLOAT * (self.top_k + 2 * (1 + math.ceil(2 * self.top_k / 4)))

    @property
    def combine_row_bytes(self) -> int:
        return self.element_bytes * self.hidden

    @property
    def gathered_row_bytes(self) -> int:
        """A gathered step's dispatch row (runtime/ep/gathered_moe.py): hidden state, gate weights and expert ids,
        `wire_bytes` each."""
        return self.wire_bytes * (self.hidden + 2 * self.top_k)

    @property
    def gathered_combine_row_bytes(self) -> int:
        """A gathered step's combine row: the hidden state's partial sum, `wire_bytes` an element."""
        return self.wire_bytes * self.hidden

    def context_elements_at(self, block: int) -> int:
        """Elements per token of block `block`'s context row (the hidden state unless set)."""
        c = self.context_elements
        n = (c[block] if block < len(c) else 0) if isinstance(c, tuple) else c
        return int(n or self.hidden)

    def context_row_bytes_at(self, block: int) -> int:
        """coherent context rows of one block: the hidden state (or its K/V) + one int64 key."""
        return self.element_bytes * self.context_elements_at(block) + FLOAT * 2

    @property
    def keyed_row_bytes(self) -> int:
        """merge and context rows: hidden + one int64 key (two float32s)."""
        return self.element_bytes * self.hidden + FLOAT * 2


@dataclass(frozen=True)
class Workload:
    """Requests served together: prompt lengths and generated tokens per request (greedy)."""

    prompt_lengths: tuple
    new_tokens: int

    def steps(self) -> list:
        """[(seq, pos) in key order] per step: the prompts, then one token per request per step."""
        first = [(s, p) for s, n in enumerate(self.prompt_lengths) for p in range(n)]
        later = [[(s, n + j) for s, n in enumerate(self.prompt_lengths)] for j in range(self.new_tokens - 1)]
        return [first] + later

    @property
    def generated_tokens(self) -> int:
        return len(self.prompt_lengths) * self.new_tokens

    @property
    def prompt_tokens(self) -> int:
        return int(sum(self.prompt_lengths))


@dataclass
class Prediction:
    """Counters in the runtime's layout (summed over ranks) plus time, for one plan and mode."""

    mode: str
    world: int
    generated_tokens: int
    layers: list                 # per block: {phase: {bytes, messages, control_bytes, control_messages}}
    step: dict                   # {prompt_sync_bytes, ...}
    tiers: dict = field(default_factory=lambda: {"same_node": 0, "other_node": 0})
    step_seconds: list = field(default_factory=list)
    compute_seconds: float = 0.0
    comm_seconds: float = 0.0
    tokens_per_rank: list = field(default_factory=list)  # per MoE layer: expert rows per rank (summed over steps)
    # comm_seconds split by exchange kind, then into the call's fixed part (collective latency and the
    # call's Python work) and the slowest rank's messages per link tier; sums to comm_seconds
    exchange_seconds: dict = field(default_factory=lambda: {k: dict.fromkeys(EXCHANGE_PARTS, 0.0) for k in TIMED_EXCHANGES})

    @property
    def all_to_all_bytes(self) -> int:
        return sum(l[p]["bytes"] for l in self.layers for p in ("dispatch", "combine", "merge"))

    @property
    def total_bytes(self) -> int:
        layer = sum(l[p][f] for l in self.layers for p in PHASES for f in ("bytes", "control_bytes"))
        return layer + sum(v for k, v in self.step.items() if k.endswith("bytes"))

    @property
    def all_to_all_messages(self) -> int:
        return sum(l[p]["messages"] for l in self.layers for p in ("dispatch", "combine", "merge"))

    @property
    def messages(self) -> int:
        """Every data message: all-to-all, context and syncs (control messages apart)."""
        return sum(l[p]["messages"] for l in self.layers for p in PHASES) + sum(
            v for k, v in self.step.items() if k.endswith("_messages") and "control" not in k)

    def bytes_by_kind(self) -> dict:
        out = {p: sum(l[p]["bytes"] for l in self.layers) for p in PHASES}
        out["sync"] = sum(v for k, v in self.step.items() if k.endswith("_bytes") and "control" not in k)
        out["control"] = sum(l[p]["control_bytes"] for l in self.layers for p in PHASES) + sum(
            v for k, v in self.step.items() if k.endswith("control_bytes"))
        return out

    def summary(self, prompt_tokens: int) -> dict:
        """JSON-ready: bytes and messages per generated token by kind, seconds by phase."""
        g = max(self.generated_tokens, 1)
        decode = self.step_seconds[1:]
        return {
            "mode": self.mode,
            "bytes_per_token": self.all_to_all_bytes / g,
            "total_bytes_per_token": self.total_bytes / g,
            "bytes_per_token_by_kind": {k: v / g for k, v in self.bytes_by_kind().items()},
            "bytes_per_token_by_tier": {k: v / g for k, v in self.tiers.items()},
            "messages_per_token": self.all_to_all_messages / g,
            "all_messages_per_token": self.messages / g,
            "seconds_per_token": sum(self.step_seconds) / g,
            "seconds_per_prefill_token": (self.step_seconds[0] / prompt_tokens) if prompt_tokens and self.step_seconds else 0.0,
            "seconds_per_decode_step": (sum(decode) / len(decode)) if decode else 0.0,
            "compute_share": self.compute_seconds / max(self.compute_seconds + self.comm_seconds, 1e-30),
            "compute_seconds_per_token": self.compute_seconds / g,
            "exchange_seconds_per_token": {k: {part: v / g for part, v in parts.items()}
                                           for k, parts in self.exchange_seconds.items()},
        }


def collectives_per_call(phase: str, host_channel: bool = False) -> int:
    """Collectives one exchange call makes: the row counts, then the rows; standard mode's combine knows its
    counts (each rank gets back what its dispatch sent, `Exchanger.exchange_sorted`), so it sends the rows only.
    CPU ranks of one host (`host_channel`: `runtime/ep/host_channel.py`) carry the counts in the rows' slot
    headers: one round whatever the phase."""
    return 1 if phase == "combine" or host_channel else 2


def counts_travel(phase: str) -> bool:
    """Whether an exchange call sends its row counts (control bytes), in a collective or a slot header."""
    return phase != "combine"


class _Counter:
    """Accumulates one exchange call's rows per (source, destination) into counters and time."""

    def __init__(self, pred: Prediction, table: ExpertTable, profile, world: int, ops=FITTED):
        self.pred, self.table, self.profile, self.world = pred, table, profile, world
        self.ops = ops  # RuntimeOps: the ops of each exchange call (`exchange_call`)
        node = table.node_of
        self.same = node[:, None] == node[None, :]  # bool [W, W]: both ranks on one node
        # CPU ranks all on one host exchange through shared memory (runtime/ep/host_channel.py)
        self.host_channel = profile is not None and profile.device_is_host and bool(self.same.all())

    def exchange(self, rows: np.ndarray, row_bytes: int, layer, phase: str, known_counts: bool = False) -> float:
        """rows int [W, W]: rows rank s sends rank d; returns the call's predicted seconds. `known_counts`: every
        rank knows what it receives (a gathered step's fixed-shape exchange): one collective, no counts."""
        W = self.world
        if W == 1:
            return 0.0
        off = rows.copy()
        np.fill_diagonal(off, 0)
        nbytes = int(off.sum()) * row_bytes
        msgs = int((off > 0).sum())
        collectives = 1 if known_counts else collectives_per_call(phase, self.host_channel)
        ctrl_b, ctrl_m = (8 * (W - 1) * W, (W - 1) * W) if counts_travel(phase) and not known_counts else (0, 0)
        if layer is None:
            for f, v in (("bytes", nbytes), ("messages", msgs), ("control_bytes", ctrl_b), ("control_messages", ctrl_m)):
                self.pred.step[f"{phase}_{f}"] += v
        else:
            entry = self.pred.layers[layer][phase]
            entry["bytes"] += nbytes
            entry["messages"] += msgs
            entry["control_bytes"] += ctrl_b
            entry["control_messages"] += ctrl_m
        same = self.same
        self.pred.tiers["same_node"] += int(off[same].sum()) * row_bytes
        self.pred.tiers["other_node"] += int(off[~same].sum()) * row_bytes
        if self.profile is None:
            return 0.0
        p = self.profile
        slowest = slowest_messages(p, same, off, row_bytes)
        per_row = MERGE_OPS_PER_ROW * rows.sum() / W if phase == "merge" and not self.ops.counts_exchange(phase) else 0
        ops = self.ops.exchange_call(phase, W) + per_row
        parts = {"call": collectives * p.collective_latency(W) + ops * p.op_overhead_s * _oversubscribed(p, W), **slowest}
        if phase in self.pred.exchange_seconds:
            for part, v in parts.items():
                self.pred.exchange_seconds[phase][part] += v
        return parts["call"] + slowest["same_node"] + slowest["other_node"]


def slowest_messages(profile, same: np.ndarray, off: np.ndarray, row_bytes: int) -> dict:
    """{tier: seconds} of the slowest sending rank's messages, off int [W, W] the rows rank s sends rank d (none to
    itself), same bool [W, W] both on one node: per rank and tier its messages' latency + bytes / bandwidth, summed
    over destinations in rank order (a running sum: the same figures as a loop over destinations)."""
    W = off.shape[0]
    per_rank = {}
    for tier, mask in (("same_node", same), ("other_node", ~same)):
        sent = mask & (off > 0)
        if not sent.any():  # a tier no message takes (its figures may be unknown: one node)
            per_rank[tier] = np.zeros(W)
            continue
        terms = np.where(sent, profile.message_latency_s[tier] + off * row_bytes / profile.bandwidth_bytes_per_s[tier], 0.0)
        per_rank[tier] = np.cumsum(terms, axis=1)[:, -1]
    s = int(np.argmax(per_rank["same_node"] + per_rank["other_node"]))  # the slowest rank (the first on a tie)
    return {tier: float(per_rank[tier][s]) for tier in ("same_node", "other_node")}


def predict(hosts: np.ndarray, gpus_per_node: int, shape: ModelShape, mode: str, workload: Workload,
            routing: dict, profile=None, service: bool = True) -> Prediction:
    """Replay one run: routing {(seq, pos): int [L, k] expert ids, heaviest first} for every token
    the workload processes; hosts bool [L, E, W]. Returns counters (and time with a profile).
    `service`: the steps are a service's, whose GPU ranks replay their decode steps as CUDA graphs where the
    runtime can (`runtime_ops.captures_decode_graphs`); False: a static run's (`moeplan run`), eager throughout.

    Vectorised over a step's tokens (numpy); per rank the figures are those of the runtime's own
    loop: each rank chooses the replicas of the tokens current on it, in key order
    (`ExpertTable.choose_per_rank`)."""
    if mode not in (COHERENT, STANDARD):
        raise ValueError(f"mode must be {COHERENT!r} or {STANDARD!r}, got {mode!r}")
    W = hosts.shape[2]
    table = ExpertTable(hosts, gpus_per_node)
    ops = runtime_ops(profile, shape.architecture, shape.held_dtype)
    graphs = service and captures_decode_graphs(profile, W, mode, shape, ops)
    ops = ops.captured() if graphs else ops  # a captured service's caches hold every layer with spare columns
    eager_profile = profile = runtime_profile(profile)
    pred = Prediction(mode=mode, world=W, generated_tokens=workload.generated_tokens,
                      layers=[{p: dict.fromkeys(("bytes", "messages", "control_bytes", "control_messages"), 0)
                               for p in PHASES} for _ in range(shape.num_blocks)],
                      step={f"{p}_{f}": 0 for p in STEP_PHASES for f in ("bytes", "messages", "control_bytes", "control_messages")},
                      tokens_per_rank=[[0] * W for _ in shape.moe_blocks])
    # standard mode's MoE blocks at W > 1: counted with their dispatch and combine calls; coherent mode's hooks with
    # its exchanges where counted (`RuntimeOps.coherent_hooks`), else the fitted counts; `step_pricing` per step
    counter = _Counter(pred, table, profile, W, ops.exchange_calls(mode))
    moe_of = {b: m for m, b in enumerate(shape.moe_blocks)}
    if mode == COHERENT:
        own = np.zeros((W, W), dtype=np.int64)
        for s, n in enumerate(workload.prompt_lengths):
            own[s % W, :] += n
        counter.exchange(own, 24, None, "prompt_sync")  # before the runtime's timer starts: bytes only
    for step_tokens in workload.steps():
        step_time = 0.0
        keys = sorted(step_tokens)
        n = len(keys)
        seq = np.array([t[0] for t in keys], dtype=np.int64)  # [n], sorted
        pos = np.array([t[1] for t in keys], dtype=np.int64)  # [n]
        slot_ids = _slot_ids(routing, keys, len(shape.moe_blocks), shape.top_k)  # [n, L, k]
        profile, gathered_rows, moe_ops = step_pricing(eager_profile, ops, graphs, W, mode, seq)
        gathered = gathered_rows is not None
        # int [n]: the rank each token is current on; None: every rank holds every token (coherent mode,
        # until the first MoE layer)
        current = seq % W if mode == STANDARD else None
        for block in range(shape.num_blocks):
            compute = np.zeros(W)
            # attention (and the dense parts) where the token is; coherent: K/V for every token on every rank
            held, seqs = _held(current, seq, W)
            if mode == COHERENT and current is not None:
                counts = np.repeat(held[:, None], W, axis=1)
                step_time += _add(pred, counter.exchange(counts, shape.context_row_bytes_at(block), block, "context"), comm=True)
            if mode == COHERENT:
                compute += _cost(profile, ops.coherent_hooks(W), 0.0)
            dense = shape.attention_flops + (shape.moe_dense_flops if block in moe_of else 0.0)
            ctx_flops, ctx_bytes = attention_at_context(shape, current, seq, pos, W)
            compute += np.where(held > 0, _costs(profile, ops.attention + profile_ops_per_sequence(profile) * seqs,
                                                 held * dense + ctx_flops, shape.attention_bytes + ctx_bytes), 0.0)
            if mode == COHERENT and current is not None:  # K/V projection of the other ranks' tokens
                compute += _costs(profile, ops.coherent_kv_ops(), (n - held) * shape.attention_flops / 3)
            moe = moe_of.get(block)
            if moe is None:
                compute += _costs(profile, ops.dense_mlp, held * shape.dense_mlp_flops)
                step_time += _add(pred, _pace(profile, compute, W))
                continue
            ids = slot_ids[:, moe, :]
            if current is None:  # coherent first MoE layer: replicated tokens, merge only
                # the primary: the heaviest expert's first copy (no expert: the token stays on its home rank)
                primary = np.where(ids[:, 0] >= 0, table.primary(moe, ids[:, 0], np.full(n, -1)), seq % W)
                dest = table.choose(moe, ids, primary)
                dest[:, 0] = primary
                compute += _cost(profile, moe_ops, 0.0) + _slots(profile, n * shape.top_k)
                step_time += _add(pred, _moe_compute(profile, shape, compute, ids, dest, pred, moe, W, ops.expert_call))
                step_time += _add(pred, counter.exchange(_merge_rows(ids, dest, W), shape.keyed_row_bytes, block, "merge"),
                                  comm=True)
                current = dest[:, 0].copy()
                continue
            dest = table.choose_per_rank(moe, ids, current)
            compute += _cost(profile, moe_ops, 0.0) + _slots(profile, 0 if gathered else held * shape.top_k)
            if gathered:
                rows = np.full((W, W), gathered_rows)
                step_time += _add(pred, counter.exchange(rows, shape.gathered_row_bytes, block, "dispatch", True), comm=True)
                step_time += _add(pred, _moe_compute(profile, shape, compute, ids, dest, pred, moe, W, ops.expert_call))
                step_time += _add(pred, counter.exchange(rows, shape.gathered_combine_row_bytes, block, "combine", True),
                                  comm=True)
                continue
            ranks, first = _distinct_ranks(ids, dest)
            dispatch = np.bincount((current[:, None] * W + ranks)[first], minlength=W * W).reshape(W, W)
            step_time += _add(pred, counter.exchange(dispatch, shape.dispatch_row_bytes, block, "dispatch"), comm=True)
            step_time += _add(pred, _moe_compute(profile, shape, compute, ids, dest, pred, moe, W, ops.expert_call))
            if mode == STANDARD:
                step_time += _add(pred, counter.exchange(dispatch.T.copy(), shape.combine_row_bytes, block, "combine"), comm=True)
            else:
                step_time += _add(pred, counter.exchange(_merge_rows(ids, dest, W), shape.keyed_row_bytes, block, "merge"),
                                  comm=True)
                current = dest[:, 0].copy()
        # logits where the token ends; coherent: the AllGather of new tokens
        ends = np.bincount(seq % W if current is None else current, minlength=W).astype(float)
        head = ops.head + (ops.coherent_step(W) if mode == COHERENT else 0.0)
        step_time += _add(pred, _pace(profile, _costs(profile, head, ends * shape.head_flops), W))
        if mode == COHERENT:
            last = np.r_[seq[1:] != seq[:-1], True]  # each request's last token in the step
            new = np.repeat(np.bincount(current[last], minlength=W)[:, None], W, axis=1)
            step_time += _add(pred, counter.exchange(new, 16, None, "token_sync"), comm=True)
        pred.step_seconds.append(step_time)
    return pred


def step_pricing(eager_profile, ops, graphs: bool, world: int, mode: str, seq: np.ndarray) -> tuple:
    """(profile, gathered rows, MoE block ops) a step whose tokens belong to sequences seq int [n] (sorted; standard
    mode: sequence s on rank s % W) is priced with, for a service whose GPU ranks capture their decode steps
    (`graphs`): a decode step (one token per sequence) replays a CUDA graph, its ops at their device time
    (`step_profile`); with several ranks the runtime gathers (runtime/ep/gathered_moe.py: every rank sends every other
    the same rows, `gathered rows`, None where it exchanges by dynamic gating) its decode steps, at the bucket of the
    fullest rank's rows, and its prefills, eager, where the runtime's rule lets them (`gathered_prefill_rows`: the
    ranks x the fullest rank's left-padded rows, its prompts x their longest, at most 512); its MoE blocks' ops are
    then counted that way."""
    from moeplan.runtime.ep.gathered_moe import gathered_prefill_rows

    tokens = np.bincount(seq)
    tokens = tokens[tokens > 0]  # [requests]: tokens of each sequence in the step
    owner = np.unique(seq) % world
    captured = graphs and len(tokens) == len(seq)
    rows = None
    if graphs and world > 1:  # `graphs` at several ranks: the MoE blocks gather (`captures_decode_graphs`)
        held = np.bincount(owner, minlength=world)
        if captured:
            rows = graph_rows(int(held.max()))
        else:
            longest = np.zeros(world, dtype=np.int64)
            np.maximum.at(longest, owner, tokens)
            rows = gathered_prefill_rows(longest, held)
    moe_ops = ops.moe_gathered if rows is not None else (ops.moe_block(world) if mode == STANDARD else ops.moe)
    rank_rows = len(seq) if mode == COHERENT else -(-len(seq) // world)  # coherent: every rank runs every row
    return step_profile(eager_profile, rank_rows, captured), rows, moe_ops


def _held(current, seq: np.ndarray, world: int) -> tuple:
    """(tokens, requests) int [W] each rank holds: all of them on every rank where `current` is None."""
    if current is None:
        return np.full(world, len(seq), dtype=np.int64), np.full(world, len(np.unique(seq)), dtype=np.int64)
    span = int(seq.max(initial=0)) + 1
    return np.bincount(current, minlength=world), np.bincount(np.unique(current * span + seq) // span, minlength=world)


def attention_at_context(shape: ModelShape, current, seq: np.ndarray, pos: np.ndarray, world: int) -> tuple:
    """(FLOPs, bytes) float [W] each rank's attention adds at context for a step's tokens (seq, pos int
    [n]) current on it (`current` None: every rank runs every token's attention); (0.0, 0.0) where the
    shape has no attention context."""
    ctx = shape.attention_context
    if ctx is None:
        return 0.0, 0.0
    if current is None:
        flops, nbytes = context_per_rank(ctx, np.zeros_like(seq), seq, pos, 1)
        return np.full(world, flops[0]), np.full(world, nbytes[0])
    return context_per_rank(ctx, current, seq, pos, world)


def _distinct_ranks(ids: np.ndarray, dest: np.ndarray) -> tuple:
    """(ranks int [n, k], each row sorted; bool [n, k], the first of each rank in its row): the
    distinct ranks each token's slots go to (slots with no expert, id -1, go nowhere)."""
    world = int(dest.max(initial=0)) + 1
    ranks = np.sort(np.where(ids >= 0, dest, world), axis=1)
    first = ranks < world
    first[:, 1:] &= ranks[:, 1:] != ranks[:, :-1]
    return ranks, first


def _merge_rows(ids: np.ndarray, dest: np.ndarray, world: int) -> np.ndarray:
    """int [W, W]: coherent merge rows, one per token and distinct rank of its slots other than its
    primary (dest[:, 0]), sent from that rank to the primary."""
    ranks, first = _distinct_ranks(ids, dest)
    primary = np.broadcast_to(dest[:, :1], ranks.shape)
    keep = first & (ranks != primary)
    return np.bincount((ranks * world + primary)[keep], minlength=world * world).reshape(world, world)


def _slot_ids(routing: dict, tokens: list, moe_layers: int, top_k: int) -> np.ndarray:
    """int64 [n, L, k]: the expert ids of `tokens` at every MoE layer, heaviest first."""
    if not tokens:
        return np.zeros((0, moe_layers, top_k), dtype=np.int64)
    return np.array([routing[t] for t in tokens], dtype=np.int64)


def _add(pred: Prediction, seconds: float, comm: bool = False) -> float:
    if comm:
        pred.comm_seconds += seconds
    else:
        pred.compute_seconds += seconds
    return seconds


def _cost(profile, ops: float, flops: float, weight_bytes: float = 0.0) -> float:
    """ops x op overhead + the larger of FLOPs / rate and weight bytes read / memory bandwidth."""
    if profile is None:
        return 0.0
    return ops * profile.op_overhead_s + max(flops / profile.flops_per_s, weight_bytes / profile.memory_bytes_per_s)


def _costs(profile, ops, flops, weight_bytes=0.0):
    """`_cost` of every rank at once: float [W] from ops, FLOPs and weight bytes (float [W] or one
    for all); 0.0 without a profile."""
    if profile is None:
        return 0.0
    return ops * profile.op_overhead_s + np.maximum(flops / profile.flops_per_s, weight_bytes / profile.memory_bytes_per_s)


def profile_ops_per_sequence(profile) -> float:
    return 0.0 if profile is None else profile.attention_ops_per_sequence


def _slots(profile, slots: int) -> float:
    return 0.0 if profile is None else slots * profile.python_slot_s


def _oversubscribed(profile, world: int) -> float:
    """Ranks per core when there are more ranks than cores (their Python work queues)."""
    return max(1.0, world / profile.parallel_ranks)


def _pace(profile, compute: np.ndarray, world: int) -> float:
    """Slowest rank, or the ranks' total over the ranks that can compute at once (shared cores)."""
    if profile is None:
        return 0.0
    return float(max(compute.max(), compute.sum() / max(1, min(world, profile.parallel_ranks))))


def _moe_compute(profile, shape, compute, ids, dest, pred, moe, world, call_ops: float) -> float:
    """Each rank's expert work, added to compute float [W]: the slots sent to it (dest int [n, k]) and
    the distinct experts it calls for them (ids int [n, k]), `call_ops` ops each; returns the layer's pace."""
    valid = ids >= 0  # -1: no expert, no row
    rows = np.bincount(dest[valid], minlength=world)
    span = int(ids.max(initial=0)) + 1
    called = np.bincount(np.unique(dest[valid] * span + ids[valid]) // span, minlength=world)
    for r in range(world):
        pred.tokens_per_rank[moe][r] += int(rows[r])
    compute += _costs(profile, call_ops * called, rows * shape.expert_flops, called * shape.expert_bytes)
    return _pace(profile, compute, world)


def routing_from_keys(keys: np.ndarray, experts: np.ndarray, max_len: int) -> dict:
    """The runtime's routing.pt (keys [T] = seq x max_len + pos, experts [T, L, k]) -> {(seq, pos): [L, k]}."""
    return {(int(k) // max_len, int(k) % max_len): experts[i] for i, k in enumerate(keys)}


def routing_from_trace(experts: np.ndarray, workload: Workload, offset: int = 0) -> dict:
    """Assign a trace's tokens (experts [T, L, k]) to the workload's tokens in order, cycling."""
    out = {}
    T = experts.shape[0]
    i = offset
    for step in workload.steps():
        for t in step:
            out[t] = experts[i % T]
            i += 1
    return out


def expected(hosts: np.ndarray, gpus_per_node: int, shape: ModelShape, mode: str, workload: Workload,
             trace_experts: np.ndarray, profile=None, samples: int = 4) -> dict:
    """A priori prediction: the mean summary over `samples` disjoint stretches of a routing trace
    assigned to the workload's tokens (the served tokens' routing is not known before the run)."""
    runs = [predict(hosts, gpus_per_node, shape, mode, workload, routing, profile).summary(workload.prompt_tokens)
            for routing in routing_samples(workload, trace_experts, samples)]
    return _mean(runs)


def routing_samples(workload: Workload, trace_experts: np.ndarray, samples: int = 4) -> list:
    """Up to `samples` routings of the workload's tokens from disjoint stretches of a trace (experts
    [T, L, k]), at least one: what `expected` averages over."""
    per = sum(len(s) for s in workload.steps())
    T = trace_experts.shape[0]
    samples = max(1, min(samples, T // max(per, 1)))
    return [routing_from_trace(trace_experts, workload, offset=i * per) for i in range(samples)]


def _mean(dicts: list):
    first = dicts[0]
    if isinstance(first, dict):
        return {k: _mean([d[k] for d in dicts]) for k in first}
    if isinstance(first, (int, float)) and not isinstance(first, bool):
        return float(sum(dicts) / len(dicts))
    return first
