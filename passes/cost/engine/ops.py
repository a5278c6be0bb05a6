"""The ops of one engine step, as one GPU runs them: what each kernel is keyed by, nothing about its price.

Every op carries `name` (what it is in the layer: qkv_gemm, attention, moe, ...), the token count the
kernel sees on the slowest rank (`tokens`), and `count`: how many times a step runs it (layers; a
fraction where a price is averaged over trace windows). Prices come from `pricing.py`: the measured
tables where they cover the op, the roofline otherwise.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

DECODE, PREFILL = "decode", "prefill"


@dataclass(frozen=True)
class Gemm:
    """[tokens, k] x [k, n] in `quant` (weights; activations follow the engine's kernel for it)."""

    name: str
    tokens: int
    n: int
    k: int
    quant: str
    count: float = 1.0


@dataclass(frozen=True)
class Attention:
    """Softmax attention of `batch` sequences with `q_heads`/`kv_heads` heads on this rank.
    Decode: one new token per sequence over `kv_len` cached tokens (the new one included).
    Prefill: `new_tokens` per sequence after `kv_len` cached ones (a chunk's prefix)."""

    name: str
    phase: str
    batch: int
    new_tokens: int
    kv_len: int
    q_heads: int
    kv_heads: int
    head_dim: int
    window: int
    kv_dtype: str
    qk_norm: bool
    count: float = 1.0

    @property
    def tokens(self) -> int:
        return self.batch * self.new_tokens


@dataclass(frozen=True)
class MlaAttention:
    """DeepSeek MLA's attention core on this rank's `heads`: decode attends the cached latent
    (weights absorbed, `kv_lora_rank` + `rope_dim` per token); prefill runs it as multi-head attention
    with qk head dim `nope_dim + rope_dim` and v head dim `v_dim`."""

    name: str
    phase: str
    batch: int
    new_tokens: int
    kv_len: int
    heads: int
    kv_lora_rank: int
    rope_dim: int
    nope_dim: int
    v_dim: int
    kv_dtype: str
    count: float = 1.0

    @property
    def tokens(self) -> int:
        return self.batch * self.new_tokens


@dataclass(frozen=True)
class MlaBmm:
    """The absorbed kv_b projection of MLA decode, batched over heads: before attention (q_nope into the
    latent, [tokens, nope] x [nope, kv_lora] per head) or after it (latent out to v, [tokens, kv_lora] x
    [kv_lora, v] per head)."""

    name: str
    tokens: int
    heads: int
    pre: bool
    nope_dim: int
    kv_lora_rank: int
    v_dim: int
    quant: str
    count: float = 1.0


@dataclass(frozen=True)
class MlaModule:
    """SGLang's whole MLA block under large-scale EP (q_b, the absorbed BMMs or kv_b, the attention core,
    o_proj) for one group of `batch` sequences, on 128 / `tp` heads, as its wide-EP path runs it;
    `parts` are the same block as separate ops, priced one by one where the module was not measured."""

    name: str
    phase: str
    batch: int
    new_tokens: int
    kv_len: int
    tp: int
    kv_dtype: str
    parts: tuple
    count: float = 1.0

    @property
    def tokens(self) -> int:
        return self.batch * self.new_tokens


@dataclass(frozen=True)
class LinearAttention:
    """Gated DeltaNet on this rank's value heads: a state update per token (decode) or a chunked scan."""

    name: str
    phase: str
    batch: int
    new_tokens: int
    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    count: float = 1.0

    @property
    def tokens(self) -> int:
        return self.batch * self.new_tokens


@dataclass(frozen=True)
class FusedMoe:
    """The fused MoE kernel of one rank (SGLang's fused_moe_triton): its local experts over the rows
    routed to them. `tokens` is the token count whose balanced routing gives this rank its rows:
    rows x moe_ep / top_k (so the measured tables, keyed by tokens under a named distribution, price it)."""

    name: str
    tokens: int
    hidden: int
    inter: int
    top_k: int
    experts: int
    moe_tp: int
    moe_ep: int
    quant: str
    distribution: str
    count: float = 1.0


@dataclass(frozen=True)
class ExpertCompute:
    """The experts of one rank behind DeepEP (grouped GEMMs over the tokens dispatched to it); `tokens`
    as for FusedMoe; `slots`: the expert slots the table is keyed by. Step composition keys it by the
    experts alone: the wide-EP tables hold other slot counts only from other collections (at 16 H200s
    one with 288 slots times faster than the 256-slot one at the same tokens), so replicas act through
    the busiest rank's rows, and their extra weight reads are not priced."""

    name: str
    phase: str
    tokens: int
    hidden: int
    inter: int
    top_k: int
    experts: int
    moe_ep: int
    slots: int
    quant: str
    distribution: str
    count: float = 1.0


@dataclass(frozen=True)
class MoeGather:
    """SGLang's exchange around the fused MoE within a node (`pre` before it, else after): with TP
    attention an all-reduce of each token's hidden state; with DP attention an all-gather of every
    replica's tokens before (reduce-scatter after). `tokens`: per attention replica."""

    name: str
    tokens: int
    hidden: int
    top_k: int
    experts: int
    moe_tp: int
    moe_ep: int
    attention_dp: int
    pre: bool
    quant: str
    count: float = 1.0


@dataclass(frozen=True)
class AllReduce:
    """All-reduce of `elements` per token over `ranks` GPUs (bf16)."""

    name: str
    tokens: int
    elements: int
    ranks: int
    count: float = 1.0


@dataclass(frozen=True)
class Collective:
    """An NCCL collective (`all_gather`, `reduce_scatter`, `all_reduce`, `alltoall`) of `elements` per
    token over `ranks` GPUs (bf16); `tokens`: each rank's share."""

    name: str
    op: str
    tokens: int
    elements: int
    ranks: int
    count: float = 1.0


@dataclass(frozen=True)
class DeepEp:
    """DeepEP's dispatch or combine of each rank's `tokens` to (from) their experts' ranks: low-latency
    kernels in decode, normal kernels in prefill."""

    name: str
    phase: str
    step: str          # DECODE (low latency) or PREFILL (normal)
    tokens: int
    hidden: int
    top_k: int
    experts: int
    moe_ep: int
    nodes: int
    count: float = 1.0


@dataclass(frozen=True)
class MemoryBound:
    """A kernel that streams `bytes_per_token` per token (norms, residual adds, activations, embedding
    lookups): memory bound by construction."""

    name: str
    tokens: int
    bytes_per_token: float
    count: float = 1.0


@dataclass(frozen=True)
class Overlap:
    """Two op lists on two streams (SGLang's shared experts beside the routed ones in decode): the
    longer list sets the time."""

    name: str
    first: tuple
    second: tuple
    count: float = 1.0


def scaled(op, count: float):
    """The op run `count` times as often."""
    return replace(op, count=op.count * count)
