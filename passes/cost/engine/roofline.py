"""The roofline price of an engine op: FLOPs over the peak at the op's precision, or bytes over HBM
bandwidth, whichever is longer, plus one kernel launch; collectives on the profile's link figures.

Used where the measured tables do not reach: aiconfigurator-core not installed, a GPU it has no
tables for, a shape or precision it never measured. Figures come from the hardware profile
(`core/hardware_data/*.yaml`: dense BF16 peak, dense FP8 peak where the GPU has FP8 tensor cores, HBM
bandwidth, launch overhead, NVLink / InfiniBand bandwidth and latencies). Bytes count weights, activations in
and out (bf16) and KV reads, so attention grows with context.
"""
from __future__ import annotations

from moeplan.passes.cost.engine import ops as O
from moeplan.passes.cost.engine.model_shape import KV_BYTES, WEIGHT_BYTES

FP8_KINDS = ("fp8", "fp8_block")
ACT = 2  # bytes of a bf16 activation element


def label(profile) -> str:
    """The source tag of a roofline price."""
    return f"roofline {profile.name}"


def _peak(profile, quant: str) -> float:
    if quant in FP8_KINDS:
        # the profile's FP8 peak; none (A100: no FP8 tensor cores; a profile that does not say): the BF16 peak
        return profile.fp8_flops_per_s or profile.flops_per_s
    return profile.flops_per_s


def _kernel(profile, flops: float, nbytes: float, quant: str = "bfloat16") -> float:
    return max(flops / _peak(profile, quant), nbytes / profile.memory_bytes_per_s) + profile.op_overhead_s


def _tier(profile, ranks: int, gpus_per_node: int) -> str:
    return "other_node" if ranks > gpus_per_node else "same_node"


def _collective(profile, nbytes: float, ranks: int, gpus_per_node: int, factor: float) -> float:
    """A ring collective: `factor` x (ranks - 1) / ranks of the bytes cross the slowest link."""
    if ranks <= 1:
        return 0.0
    tier = _tier(profile, ranks, gpus_per_node)
    bandwidth = profile.bandwidth_bytes_per_s[tier]
    latency = profile.collective_latency(ranks) if profile.collective_latency_base_s is not None else 0.0
    return latency + factor * (ranks - 1) / ranks * nbytes / bandwidth


def _moe(profile, tokens: int, hidden: int, inter: int, top_k: int, experts: int, ep: int, tp: int, quant: str) -> float:
    """One rank's experts over its rows (tokens x top_k / ep under balanced routing): every local expert
    that receives a row is read once."""
    rows = tokens * top_k / ep
    local = experts / ep
    touched = min(local, rows)
    width = inter / tp
    flops = 2 * rows * 3 * hidden * width
    nbytes = touched * 3 * hidden * width * WEIGHT_BYTES[quant] + rows * hidden * ACT * 2
    return _kernel(profile, flops, nbytes, quant)


def price(op, profile, gpus_per_node: int = 8) -> float:
    """Seconds of one run of `op` (count not applied) on one GPU of `profile`."""
    if isinstance(op, O.Gemm):
        m, n, k = op.tokens, op.n, op.k
        return _kernel(profile, 2 * m * n * k, n * k * WEIGHT_BYTES[op.quant] + (m * k + m * n) * ACT, op.quant)
    if isinstance(op, O.Attention):
        kv = min(op.kv_len, op.window) if op.window else op.kv_len
        if op.phase == O.DECODE:
            flops = 4 * op.batch * op.q_heads * op.head_dim * kv
            nbytes = op.batch * kv * 2 * op.kv_heads * op.head_dim * KV_BYTES[op.kv_dtype] + 2 * op.batch * op.q_heads * op.head_dim * ACT
        else:
            span = op.kv_len + op.new_tokens / 2  # causal: each new token sees the prefix and half the chunk
            span = min(span, op.window) if op.window else span
            flops = 4 * op.batch * op.new_tokens * op.q_heads * op.head_dim * span
            nbytes = op.batch * (op.kv_len + op.new_tokens) * 2 * op.kv_heads * op.head_dim * KV_BYTES[op.kv_dtype] \
                + 2 * op.tokens * op.q_heads * op.head_dim * ACT
        return _kernel(profile, flops, nbytes)
    if isinstance(op, O.MlaAttention):
        if op.phase == O.DECODE:
            latent = op.kv_lora_rank + op.rope_dim
            flops = 2 * op.batch * op.heads * (latent + op.kv_lora_rank) * op.kv_len
            nbytes = op.batch * op.kv_len * latent * KV_BYTES[op.kv_dtype]
        else:
            span = op.kv_len + op.new_tokens / 2
            flops = 2 * op.tokens * op.heads * span * (op.nope_dim + op.rope_dim + op.v_dim)
            nbytes = op.batch * (op.kv_len + op.new_tokens) * op.heads * (op.nope_dim + op.rope_dim + op.v_dim) * ACT
        return _kernel(profile, flops, nbytes)
    if isinstance(op, O.MlaModule):
        return sum(price(part, profile, gpus_per_node) * part.count for part in op.parts)
    if isinstance(op, O.MlaBmm):
        inner, outer = (op.nope_dim, op.kv_lora_rank) if op.pre else (op.kv_lora_rank, op.v_dim)
        flops = 2 * op.tokens * op.heads * inner * outer
        nbytes = op.heads * inner * outer * WEIGHT_BYTES.get(op.quant, 2) + op.tokens * op.heads * (inner + outer) * ACT
        return _kernel(profile, flops, nbytes, op.quant)
    if isinstance(op, O.LinearAttention):
        state = op.value_heads * op.key_dim * op.value_dim
        flops = 6 * op.tokens * state
        nbytes = 2 * op.batch * state * 4 + op.tokens * (2 * op.key_heads * op.key_dim + 2 * op.value_heads * op.value_dim) * ACT
        return _kernel(profile, flops, nbytes)
    if isinstance(op, O.FusedMoe):
        return _moe(profile, op.tokens, op.hidden, op.inter, op.top_k, op.experts, op.moe_ep, op.moe_tp, op.quant)
    if isinstance(op, O.ExpertCompute):
        return _moe(profile, op.tokens, op.hidden, op.inter, op.top_k, op.slots, op.moe_ep, 1, op.quant)
    if isinstance(op, O.MoeGather):
        ranks = op.moe_tp * op.moe_ep
        if ranks <= 1:
            return 0.0
        if op.attention_dp > 1:  # all-gather (pre) / reduce-scatter (post) of every replica's tokens
            return _collective(profile, op.tokens * op.attention_dp * op.hidden * ACT, ranks, gpus_per_node, 1.0)
        return _collective(profile, op.tokens * op.hidden * ACT, ranks, gpus_per_node, 2.0)
    if isinstance(op, O.AllReduce):
        return _collective(profile, op.tokens * op.elements * ACT, op.ranks, gpus_per_node, 2.0)
    if isinstance(op, O.Collective):
        factor = 2.0 if op.op == "all_reduce" else 1.0
        return _collective(profile, op.tokens * op.elements * ACT, op.ranks, gpus_per_node, factor)
    if isinstance(op, O.DeepEp):
        element = 1 if op.phase == "dispatch" else ACT  # dispatch sends FP8 rows, combine bf16
        nbytes = op.tokens * op.top_k * op.hidden * element
        remote = (op.nodes - 1) / op.nodes if op.nodes > 1 else 0.0
        local = (1 - remote) * (op.moe_ep / op.nodes - 1) / max(op.moe_ep / op.nodes, 1)
        latency = profile.message_latency_s["other_node" if op.nodes > 1 else "same_node"]
        return (latency + nbytes * remote / profile.bandwidth_bytes_per_s["other_node" if op.nodes > 1 else "same_node"]
                + nbytes * local / profile.bandwidth_bytes_per_s["same_node"] + profile.op_overhead_s)
    if isinstance(op, O.MemoryBound):
        return op.tokens * op.bytes_per_token / profile.memory_bytes_per_s + profile.op_overhead_s
    raise TypeError(f"no roofline for {type(op).__name__}")

