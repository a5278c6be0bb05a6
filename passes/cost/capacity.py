"""Serving capacity: how many sequences, of what context, a deployment's ranks can hold at once.

The runtime keeps on every rank the dense weights, the rank's experts (all it hosts, or an expert
cache's C entries) and the library's KV cache, at the precision it holds them on the plan's
hardware (`runtime/precision.py: model_weight_bytes`, the rule the ranks load by: the checkpoint's
precision where the device computes at it; FP8 experts with their block scales on FP8 GPUs; the KV
cache and activations at the dense weights' dtype). What device memory leaves after the weights, a
fixed reserve (CUDA context, allocator slack) and the activations of the largest prefill step holds
KV tokens:

    kv_tokens(rank) = (device memory - dense - experts(rank) - activations - reserve) // kv_bytes_per_token

KV bytes per token: layers x KV heads x head dim x 2 (K and V) x the held element size, or for MLA
(DeepSeek-V2/V3, whose transformers cache keeps the compressed latent) the latent plus the rotated
key (`offload.cache_plan.kv_bytes_per_token`, counted at the held dtype).

Continuous batching keeps a rank's sequences as rows of one cache whose width is the longest row
(`runtime/serving/row_cache.py`), so B rows of up to `max_context` tokens take
B x max_context token slots. Coherent mode holds every sequence on every rank; standard mode holds
a sequence on its owner only, and rank 0 gives each new sequence to the least loaded rank:

    max_context   = min(the model's positions, kv_tokens of the smallest rank)
    max_sequences = min(MAX_SEQUENCES, kv_tokens // max_context x (1 coherent | world standard))

`MAX_SEQUENCES` bounds one step's batch (a scheduling bound, not memory). When the weights alone
do not fit, max_sequences is 0 and `fits` is false: the plan says so and the service refuses to start.
"""
from __future__ import annotations

from moeplan.passes.optimize.offload.cache_plan import ACT_BUFFERS

RESERVE_BYTES = 1 << 30           # CUDA context and allocator slack, as the offload planner reserves
ACTIVATION_BUFFERS = ACT_BUFFERS  # working copies of the widest activation, as the expert caches count them
MAX_PREFILL_TOKENS = 2048         # the most padded prompt tokens one step prefills (runtime/serving/scheduler.py: Limits)
MAX_SEQUENCES = 256               # the most sequences one step batches


def held_weights(ir, profile) -> dict:
    """What the ranks hold on `profile`'s device (`runtime/precision.py: model_weight_bytes`):
    {"dense": bytes, "expert": bytes of one expert, "dtypes": {"dense", "experts"}}."""
    from moeplan.runtime.precision import model_weight_bytes

    return model_weight_bytes(ir, on_gpu=not profile.device_is_host, precision=profile.precision)


def runtime_kv_bytes_per_token(config, ir, dtype: str = "float32") -> int:
    """KV-cache bytes one token adds on a rank that holds its context, at the runtime's `dtype`
    (`held_weights(...)["dtypes"]["dense"]`; the cost model's attention at context prices the same, `context.attention_of`)."""
    from moeplan.passes.optimize.offload.cache_plan import kv_bytes_per_token
    from moeplan.core.ir import dtype_bytes
    from moeplan.runtime.precision import ITEMSIZE

    return int(round(kv_bytes_per_token(config, ir) / dtype_bytes(ir.dtype))) * ITEMSIZE[dtype]


def model_positions(config) -> int | None:
    """The longest context the model's position embeddings allow (None: unbounded or unknown)."""
    if config is None:
        return None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for name in ("max_position_embeddings", "max_positions", "n_positions", "max_seq_len"):
        value = getattr(text, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def serving_capacity(ir, config, experts_per_rank: list, mode: str, device_memory_bytes: int,
                     device_memory_source: str, held: dict) -> dict:
    """The plan's `communication.capacity` (module docstring). `experts_per_rank`: the (layer,
    expert) entries each rank keeps resident (hosted experts, or its expert cache's capacity);
    `held`: `held_weights` of the plan's profile."""
    from moeplan.core.ir import dtype_bytes
    from moeplan.runtime.precision import ITEMSIZE

    dense, expert, dtype = held["dense"], held["expert"], held["dtypes"]["dense"]
    widest = max(s.activation_bytes_per_token for s in ir.stages) / dtype_bytes(ir.dtype) * ITEMSIZE[dtype]
    activations = int(MAX_PREFILL_TOKENS * widest * ACTIVATION_BUFFERS)
    kv = max(1, runtime_kv_bytes_per_token(config, ir, dtype))
    weights = [dense + n * expert for n in experts_per_rank]
    free = [int(device_memory_bytes) - w - activations - RESERVE_BYTES for w in weights]
    tokens = max(0, min(free) // kv)
    positions = model_positions(config)
    context = min(tokens, positions) if positions else tokens
    world = len(experts_per_rank)
    if context < 1:
        sequences = 0
    else:
        per_rank = tokens // context
        sequences = min(MAX_SEQUENCES, per_rank * (world if mode == "standard" else 1))
    return {"fits": sequences > 0, "max_sequences": int(sequences), "max_context": int(context),
            "kv_bytes_per_token": int(kv), "kv_tokens_per_rank": int(tokens),
            "device_memory_bytes": int(device_memory_bytes), "device_memory_source": device_memory_source,
            "weight_bytes_per_rank": [int(w) for w in weights], "weight_dtypes": dict(held["dtypes"]),
            "activation_bytes": activations,
            "reserve_bytes": RESERVE_BYTES, "model_positions": positions}


def describe_capacity(capacity: dict) -> str:
    """One line for `compile`."""
    if not capacity["fits"]:
        return (f"serving capacity: none: {capacity['device_memory_bytes'] / (1 << 30):.1f} GiB of device memory "
                f"({capacity['device_memory_source']}) cannot hold a rank's weights "
                f"({max(capacity['weight_bytes_per_rank']) / (1 << 30):.2f} GiB) and a KV cache; give more device "
                "memory (--gpu-memory) or more ranks")
    return (f"serving capacity: {capacity['max_sequences']} sequences of up to {capacity['max_context']} tokens at once "
            f"({capacity['kv_bytes_per_token']} KV bytes per token, {capacity['kv_tokens_per_rank']} tokens per rank in "
            f"{capacity['device_memory_bytes'] / (1 << 30):.1f} GiB, {capacity['device_memory_source']})")


def device_memory(offload_options: dict | None, profile, ranks_per_node: int = 1) -> tuple:
    """(bytes, where the figure comes from) for one rank: compile's --gpu-memory, else the device
    memory of the plan's hardware profile (`profile`: core/hardware.py, the one the cost model and
    expert caches price with; --hardware NAME|FILE|this-machine). Where the device is the host
    (`profile.device_is_host`: CPU ranks), the node's `ranks_per_node` ranks share its memory."""
    o = offload_options or {}
    if o.get("gpu_memory_bytes"):
        return int(o["gpu_memory_bytes"]), "--gpu-memory"
    profile.require(("device_memory_bytes",), "serving capacity without --gpu-memory")
    if ranks_per_node > 1 and profile.device_is_host:
        return (int(profile.device_memory_bytes) // ranks_per_node,
                f"hardware profile {profile.name}, host memory shared by {ranks_per_node} CPU ranks")
    return int(profile.device_memory_bytes), f"hardware profile {profile.name}"
