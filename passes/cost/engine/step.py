"""One engine step (a decode step, or one prefill chunk), composed op by op as the engine runs it.

Followed: SGLang 0.5.23's model code (python/sglang/srt/models/qwen3_moe.py `Qwen3MoeDecoderLayer`,
`Qwen3MoeSparseMoeBlock`; mixtral.py `MixtralDecoderLayer`; deepseek_v2.py `DeepseekV2DecoderLayer`,
`DeepseekV2AttentionMLA` (absorbed MLA in decode, MHA over kv_b_proj in prefill), `DeepseekV2MoE`
(`forward_normal_dual_stream`: shared experts on a second stream beside the routed ones while a decode
CUDA graph runs; shared experts replicated under DeepEP, else tensor parallel over all GPUs), the
dense MLP of DeepSeek's first layers tensor parallel over all GPUs (`moe_dense_tp_size` unset), and
layers/logits_processor.py (the vocab-parallel LM head's all-gather)); aiconfigurator-core 0.12.0's op
lists (sdk/models/moe.py, sdk/models/deepseek.py) as a cross-check. Where we differ from
AIConfigurator, on purpose: DeepSeek-V3's 3 dense layers are dense MLPs (it prices all 61 as MoE),
the large-EP graph does not count the q_a/kv_a GEMM twice, the router and logits GEMMs are kept.

Per decoder layer, on one GPU (the slowest replica's tokens; t = tokens per attention replica,
T = t x dp the tokens all replicas hold, tp/dp the attention layout, W the GPUs):
* add + RMSNorm (8 bytes per hidden element: residual and input read, both written);
* attention: GQA (qkv GEMM [t, h] x [h, (q/tp + 2 ceil(kv/tp)) d], attention over the KV cache at the
  actual context, window-limited on sliding layers; o_proj [t, q d / tp] x [.., h]); MLA (q_a + kv_a
  fused GEMM, q_b, then in decode the absorbed BMMs around the latent attention, in prefill kv_b and
  MHA; o_proj); Gated DeltaNet for linear layers (in/out projections and the state update);
* MoE layers, within a node: the exchange before (all-reduce after TP attention, all-gather of T
  tokens after DP attention), router GEMM, the fused MoE kernel of the slowest rank, the exchange after
  (all-reduce / reduce-scatter), shared experts; across nodes (DeepEP): router, DeepEP dispatch,
  the experts of the slowest rank, DeepEP combine, replicated shared experts;
* dense layers: the MLP over all GPUs (gate_up [T, h] x [h, 2 i / W], down), with an all-reduce
  (TP attention) or all-gather / reduce-scatter (DP attention) around it.
Then the final norm, the LM head ([rows, h] x [h, vocab / tp]) and its all-gather over tp.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import replace

from moeplan.passes.cost.engine import ops as O
from moeplan.passes.cost.engine.deployment import DEEPEP, Deployment
from moeplan.passes.cost.engine.model_shape import LINEAR, EngineModel

NORM_BYTES = 8  # per hidden element: residual and input read (bf16), residual and output written


def _attention(model: EngineModel, dep: Deployment, layer: int, phase: str, pieces: tuple, kv_dtype: str) -> list:
    """The attention block of decoder `layer` for one replica's `pieces` ((sequences, new tokens, cached
    tokens) each)."""
    tp, h = dep.attention_tp, model.hidden
    t = sum(b * n for b, n, _ in pieces)
    quant = model.attention_quant
    if model.attention_kinds[layer] == LINEAR:
        a = model.linear
        kh, vh = max(a.key_heads // tp, 1), max(a.value_heads // tp, 1)
        width = 2 * kh * a.key_dim + 2 * vh * a.value_dim + 2 * vh
        out = [O.Gemm("linear_attention_in_gemm", t, width, h, quant)]
        out += [O.LinearAttention("linear_attention", phase, b, n, kh, vh, a.key_dim, a.value_dim) for b, n, _ in pieces]
        return out + [O.Gemm("linear_attention_out_gemm", t, h, vh * a.value_dim, quant)]
    if model.mla is not None:
        m, heads = model.mla, max(model.q_heads // tp, 1)
        if not m.q_lora_rank:  # a plain q projection (DeepSeek-V2-Lite) in place of q_a / q_b
            return [O.Gemm("mla_kv_a_gemm", t, m.kv_lora_rank + m.qk_rope_head_dim, h, quant),
                    O.Gemm("mla_q_gemm", t, heads * m.qk_head_dim, h, quant),
                    *_mla_block(model, phase, pieces, heads, kv_dtype, quant)[1:]]
        down = O.Gemm("mla_q_a_kv_a_gemm", t, m.q_lora_rank + m.kv_lora_rank + m.qk_rope_head_dim, h, quant)
        if dep.moe_a2a == DEEPEP:  # the large-EP path: the block as one module per group of sequences
            return [down] + [O.MlaModule("mla_block", phase, b, n, c + (n if phase == O.DECODE else 0), tp, kv_dtype,
                                         tuple(_mla_block(model, phase, ((b, n, c),), heads, kv_dtype, quant)))
                             for b, n, c in pieces]
        return [down, *_mla_block(model, phase, pieces, heads, kv_dtype, quant)]
    q, kv, d = max(model.q_heads // tp, 1), math.ceil(model.kv_heads / tp), model.head_dim
    window = model.windows[layer]
    core = [O.Attention("attention", phase, b, n, c + (n if phase == O.DECODE else 0), q, kv, d, window, kv_dtype,
                        model.qk_norm) for b, n, c in pieces]
    return [O.Gemm("qkv_gemm", t, (q + 2 * kv) * d, h, quant), *core, O.Gemm("o_proj_gemm", t, h, q * d, quant)]


def _mla_block(model: EngineModel, phase: str, pieces: tuple, heads: int, kv_dtype: str, quant: str) -> list:
    """MLA after the down projections: q_b, then the absorbed BMMs around the latent attention (decode) or
    kv_b and multi-head attention (prefill), then o_proj."""
    m, h = model.mla, model.hidden
    t = sum(b * n for b, n, _ in pieces)
    core = [O.MlaAttention("attention", phase, b, n, c + (n if phase == O.DECODE else 0), heads, m.kv_lora_rank,
                           m.qk_rope_head_dim, m.qk_nope_head_dim, m.v_head_dim, kv_dtype) for b, n, c in pieces]
    out = [O.Gemm("mla_q_b_gemm", t, heads * m.qk_head_dim, m.q_lora_rank, quant)]
    if phase == O.DECODE:
        out += [O.MlaBmm("mla_bmm_pre", t, heads, True, m.qk_nope_head_dim, m.kv_lora_rank, m.v_head_dim, quant), *core,
                O.MlaBmm("mla_bmm_post", t, heads, False, m.qk_nope_head_dim, m.kv_lora_rank, m.v_head_dim, quant)]
    else:
        out += [O.Gemm("mla_kv_b_gemm", t, heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank, quant), *core]
    return out + [O.Gemm("o_proj_gemm", t, h, heads * m.v_head_dim, quant)]


def _mlp(name: str, tokens: int, hidden: int, inter: int, quant: str) -> list:
    """A gated MLP of width `inter` on this GPU: gate_up, SiLU x up (memory bound), down."""
    return [O.Gemm(f"{name}_gate_up_gemm", tokens, 2 * inter, hidden, quant),
            O.MemoryBound(f"{name}_act", tokens, 2 * 3 * inter),
            O.Gemm(f"{name}_down_gemm", tokens, hidden, inter, quant)]


def _moe(model: EngineModel, dep: Deployment, phase: str, t: int, moe_tokens: tuple, distribution: str,
         layers: int = 1) -> list:
    """`layers` MoE layers after attention: `moe_tokens` ((tokens, weight), ...) give the slowest rank's load,
    the weights summing to `layers` (the router and shared experts run once per layer)."""
    h, dp, world = model.hidden, dep.attention_dp, dep.gpus
    T = t * dp
    shared = []
    if dep.moe_a2a == DEEPEP:
        router = [O.Gemm("router_gemm", t, model.num_experts, h, model.compute_dtype, float(layers))]
        if model.shared_inter:
            shared = [O.scaled(op, layers) for op in _mlp("shared", t, h, model.shared_inter, model.dense_quant)]
        out = []
        for x, weight in moe_tokens:
            out += [O.DeepEp("moe_dispatch", "dispatch", phase, t, h, model.top_k, model.num_experts, dep.moe_ep, dep.nodes, weight),
                    O.ExpertCompute("moe", phase, x, h, model.moe_inter, model.top_k, model.num_experts, dep.moe_ep,
                                    model.num_experts, model.moe_quant, distribution, weight),
                    O.DeepEp("moe_combine", "combine", phase, t, h, model.top_k, model.num_experts, dep.moe_ep, dep.nodes, weight)]
        return router + out + shared
    gather = lambda pre: O.MoeGather("moe_pre_exchange" if pre else "moe_post_exchange", t, h, model.top_k,
                                     model.num_experts, dep.moe_tp, dep.moe_ep, dp, pre, model.moe_quant)
    router = O.Gemm("router_gemm", T, model.num_experts, h, model.compute_dtype)
    if model.shared_inter:
        shared = _mlp("shared", T, h, max(model.shared_inter // world, 1), model.dense_quant)
    out = []
    for x, weight in moe_tokens:
        routed = (router, gather(True), O.FusedMoe("moe", x, h, model.moe_inter, model.top_k, model.num_experts,
                                                    dep.moe_tp, dep.moe_ep, model.moe_quant, distribution), gather(False))
        if shared and phase == O.DECODE:  # the shared experts' stream beside the routed one
            out.append(O.Overlap("moe_and_shared", routed, tuple(shared), weight))
        else:
            out += [O.scaled(op, weight) for op in routed]
    return out + ([O.scaled(op, layers) for op in shared] if phase != O.DECODE else [])


def _dense(model: EngineModel, dep: Deployment, t: int) -> list:
    """A dense layer's MLP, tensor parallel over all GPUs, with the exchange around it."""
    h, dp, tp, world = model.hidden, dep.attention_dp, dep.attention_tp, dep.gpus
    T = t * dp
    mlp = _mlp("dense", T, h, max(model.dense_inter // world, 1), model.dense_quant)
    if dp > 1:
        return [O.Collective("dense_all_gather", "all_gather", T, h, world), *mlp,
                O.Collective("dense_reduce_scatter", "reduce_scatter", T, h, world)]
    if tp > 1:
        return [O.AllReduce("attention_all_reduce", t, h, tp), *mlp, O.AllReduce("dense_all_reduce", t, h, tp)]
    return mlp


def layer_ops(model: EngineModel, dep: Deployment, phase: str, pieces: tuple, moe_tokens: list,
              distribution: str = "balanced") -> list:
    """The decoder layers' ops for one replica's `pieces` ((sequences, new tokens, cached tokens) each);
    `moe_tokens[i]`: ((tokens, weight), ...) of MoE layer i (in order) for its slowest rank.

    Layers run one after another, so the step is the sum of their ops: each op is built once and counted
    (`count`) as often as layers run it: the attention block once per (kind, window), the MoE block's
    routed part once per distinct busiest-rank load, weighted by how many layers (and windows) see it."""
    kv_dtype = dep.kv_cache_dtype or model.kv_dtype
    t = sum(b * n for b, n, _ in pieces)
    out = [O.MemoryBound("add_norm", t, NORM_BYTES * model.hidden, 2.0 * model.num_layers)]
    kinds = Counter((model.attention_kinds[layer], model.windows[layer]) for layer in range(model.num_layers))
    first = {}
    for layer in range(model.num_layers):
        first.setdefault((model.attention_kinds[layer], model.windows[layer]), layer)
    for key, layer in first.items():
        out += [O.scaled(op, kinds[key]) for op in _attention(model, dep, layer, phase, pieces, kv_dtype)]
    moe_layers = model.num_moe_layers
    if moe_layers:
        if dep.moe_a2a == DEEPEP and dep.attention_tp > 1:
            out.append(O.AllReduce("attention_all_reduce", t, model.hidden, dep.attention_tp, float(moe_layers)))
        loads = Counter()
        for layer_tokens in moe_tokens[:moe_layers]:
            for x, weight in layer_tokens:
                loads[x] += weight
        out += _moe(model, dep, phase, t, tuple(sorted(loads.items())), distribution, moe_layers)
    dense_layers = model.num_layers - moe_layers
    if dense_layers:
        out += [O.scaled(op, dense_layers) for op in _dense(model, dep, t)]
    return out


def _ends(model: EngineModel, dep: Deployment, t: int, rows: int) -> list:
    """Embedding (and its all-reduce over a vocab-parallel table) and the LM head for `rows` tokens."""
    tp, h = dep.attention_tp, model.hidden
    out = [O.MemoryBound("embedding", t, 2 * h)]
    if tp > 1:
        out.append(O.AllReduce("embedding_all_reduce", t, h, tp))
    out += [O.MemoryBound("final_norm", t, NORM_BYTES * h),
            O.Gemm("logits_gemm", rows, max(model.vocab // tp, 1), h, model.compute_dtype)]
    if tp > 1:
        out.append(O.Collective("logits_all_gather", "all_gather", rows, model.vocab, tp))
    return out


def merged(ops: list) -> list:
    """The same ops with identical ones (all fields but `count`) combined into one with the summed count."""
    totals, first = {}, {}
    for op in ops:
        key = tuple(v for k, v in vars(op).items() if k != "count") + (op.__class__,)
        if key not in totals:
            totals[key], first[key] = 0.0, op
        totals[key] += op.count
    return [op if totals[key] == op.count else replace(op, count=totals[key]) for key, op in first.items()]


def decode_ops(model: EngineModel, dep: Deployment, batch: int, context: int, moe_tokens: list,
               distribution: str = "balanced") -> list:
    """One decode step of `batch` running sequences over the deployment, each with `context` tokens
    cached before this one (the KV the attention reads is context + 1)."""
    b = math.ceil(batch / dep.attention_dp)
    pieces = ((b, 1, context),)
    return merged(_ends(model, dep, b, b) + layer_ops(model, dep, O.DECODE, pieces, moe_tokens, distribution))


def prefill_ops(model: EngineModel, dep: Deployment, pieces: tuple, finishing: int, moe_tokens: list,
                distribution: str = "balanced") -> list:
    """One prefill chunk of each replica: `pieces` ((sequences, new tokens, cached tokens) each), of which
    `finishing` sequences complete their prompt here (the LM head runs for them)."""
    t = sum(b * n for b, n, _ in pieces)
    return merged(_ends(model, dep, t, max(finishing, 1)) + layer_ops(model, dep, O.PREFILL, pieces, moe_tokens, distribution))


def balanced_moe_tokens(model: EngineModel, tokens: int) -> list:
    """Every rank's rows equal (tokens x top_k / EP): the slowest rank's load is the tokens themselves."""
    return [((max(int(tokens), 1), 1.0),)] * model.num_moe_layers

