"""Memory one GPU of an engine deployment needs: weights at the checkpoint's precision, the KV cache of
its requests at their context, and the engine's reserve for activations and CUDA graphs.

Weights on one GPU: its expert slots ((experts + redundant) / EP of every MoE layer, each 1/moe_tp of
an expert), attention split by attention TP (replicated across DP replicas; MLA's latent projections
replicated on every rank), dense and shared MLPs split over all GPUs (shared experts replicated under
DeepEP, as SGLang runs them), the routers replicated, the embedding and LM head split by attention TP.
Bytes per element follow the precision (`model_shape.WEIGHT_BYTES`: FP8 1 byte plus its block scales).

KV: the requests this GPU's attention replica serves (all of them under TP attention, 1/dp under DP
attention) x their context x per layer the cached elements of its KV heads (`EngineModel.
kv_elements_per_token`; sliding layers keep their window; Gated DeltaNet keeps a float32 state).

Reserve (SGLang 0.5.23, python/sglang/srt/arg_groups/memory_hook.py `_handle_gpu_memory_settings`,
written from its rule): mem_fraction_static = (GPU memory - reserved) / GPU memory with reserved (MiB) =
512 + 1.5 x max(chunked_prefill_size, 2048) + tp_size / 8 x 1024 + decode CUDA graphs (2 x max_bs,
and with DP attention 3 x max_bs x dp, +1.5 x max_bs x dp above 300), at least 10 GiB on GPUs over
60 GiB, + 2 GiB of DeepEP buffers; chunked_prefill_size 8192 and max_bs 256 (tp < 4) or 512 on
60-160 GiB GPUs (H100, H200), 16384 / 512 above. Assumed: prefill CUDA graphs off (their default),
no speculative decoding, pipeline parallel 1. The reserve is what the engine keeps outside its static
pool; the plan's memory figure is weights + KV + reserve, and it fits when that is at most the GPU's memory.
"""
from __future__ import annotations

import math

from moeplan.passes.cost.engine.deployment import DEEPEP, Deployment
from moeplan.passes.cost.engine.model_shape import KV_BYTES, LINEAR, SLIDING, WEIGHT_BYTES, EngineModel

MIB = 1 << 20
GIB = 1 << 30


def engine_limits(dep: Deployment, device_bytes: int) -> dict:
    """SGLang's defaults for this GPU: chunked_prefill_size (tokens per prefill chunk) and the decode CUDA
    graphs' max batch (memory_hook.py, the GPU-memory tiers)."""
    gib = device_bytes / GIB
    if gib < 20:
        chunk, max_bs = 2048, 8
    elif gib < 35:
        chunk, max_bs = 4096, 48 if dep.gpus < 4 else 160
    elif gib < 60:
        chunk, max_bs = 4096, 32 if dep.gpus < 4 else 160
    elif gib < 160:
        chunk, max_bs = 8192, 256 if dep.gpus < 4 else 512
    else:
        chunk, max_bs = 16384, 512
    if dep.max_running_requests is not None:
        max_bs = min(max_bs, dep.max_running_requests)
    return {"chunked_prefill_size": chunk, "cuda_graph_max_bs": max_bs}


def reserved_bytes(dep: Deployment, device_bytes: int) -> int:
    """The engine's reserve outside weights and KV (see the module docstring)."""
    limits = engine_limits(dep, device_bytes)
    max_bs = limits["cuda_graph_max_bs"]
    mib = 512 + 1.5 * max(limits["chunked_prefill_size"], 2048) + dep.gpus / 8 * 1024 + 2 * max_bs
    if dep.attention_dp > 1:
        mib += 3 * max_bs * dep.attention_dp + (1.5 * max_bs * dep.attention_dp if max_bs > 300 else 0)
    if device_bytes > 60 * GIB:
        mib = max(mib, 10 * 1024)
    if dep.moe_a2a == DEEPEP:
        mib += 2 * 1024
    return int(mib * MIB)


def weight_bytes(model: EngineModel, dep: Deployment) -> int:
    """Weights one GPU holds."""
    tp, world = dep.attention_tp, dep.gpus
    compute = WEIGHT_BYTES[model.compute_dtype]
    slots = (model.num_experts + dep.redundant_experts) / dep.moe_ep
    experts = model.num_moe_layers * slots * model.expert_params / dep.moe_tp * WEIGHT_BYTES[model.moe_quant]
    routers = model.num_moe_layers * model.num_experts * model.hidden * compute
    shared_split = 1 if dep.moe_a2a == DEEPEP else world
    shared = model.num_moe_layers * model.shared_params / shared_split * WEIGHT_BYTES[model.dense_quant]
    dense = model.num_dense_layers * model.dense_mlp_params / world * WEIGHT_BYTES[model.dense_quant]
    attention = 0.0
    for kind in model.attention_kinds:
        if kind == LINEAR:
            attention += model.linear_attention_params / tp
        elif model.mla is not None:
            m = model.mla
            replicated = model.hidden * (m.q_lora_rank + m.kv_lora_rank + m.qk_rope_head_dim)
            attention += replicated + (model.attention_params - replicated) / tp
        else:
            attention += model.attention_params / tp
    attention *= WEIGHT_BYTES[model.attention_quant]
    heads = (1 if model.tied_embeddings else 2) * model.embedding_params / tp * compute
    return int(experts + routers + shared + dense + attention + heads)


def kv_bytes(model: EngineModel, dep: Deployment, requests: int, context: int) -> int:
    """KV cache (and linear-attention state) one GPU holds for `requests` over the whole deployment at
    `context` tokens each."""
    per_gpu = requests if dep.attention_dp == 1 else math.ceil(requests / dep.attention_dp)
    element = KV_BYTES[dep.kv_cache_dtype or model.kv_dtype]
    total = 0.0
    for layer, kind in enumerate(model.attention_kinds):
        if kind == LINEAR:
            total += per_gpu * model.linear.state_elements / dep.attention_tp * 4
            continue
        tokens = min(context, model.windows[layer]) if kind == SLIDING and model.windows[layer] else context
        total += per_gpu * tokens * model.kv_elements_per_token(layer, dep.attention_tp) * element
    return int(total)


def memory_per_gpu(model: EngineModel, dep: Deployment, device_bytes: int, requests: int, context: int) -> dict:
    """{weights_bytes, kv_bytes, reserved_bytes, memory_per_gpu_bytes, device_bytes, fits}."""
    weights, kv, reserve = weight_bytes(model, dep), kv_bytes(model, dep, requests, context), reserved_bytes(dep, device_bytes)
    total = weights + kv + reserve
    return {"weights_bytes": weights, "kv_bytes": kv, "reserved_bytes": reserve, "memory_per_gpu_bytes": total,
            "device_bytes": int(device_bytes), "fits": total <= device_bytes}
