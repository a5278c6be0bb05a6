"""The host memory a rank pod requests: what its processes hold at their peak, from the plan.

A pod runs one node's ranks under torchrun (`launch.sh`). Per rank r (`rank_weight_bytes`):

    weights(r) = S(r) + F(r)      S: the shard's tensor bytes as stored (the read buffer),
                                  F: the same tensors as the runtime holds them (`runtime/precision.py:
                                  held_bytes` at the plan's `capacity.weight_dtypes`: `bundle_io`
                                  reads, then casts tensor by tensor; on a GPU node both exist on the
                                  host until `model.to(device)`)

With an expert cache (issue 13) a rank loads only its dense tensors that way and keeps its host
tier of experts at the held dtype from the start; the cache itself is GPU memory, the other experts
stay on the volume:

    weights(r) = S_dense(r) + F_dense(r) + tier(r) x runtime_expert_bytes

A pod then asks, for node n:

    memory(n) = sum over its ranks (weights(r) + RANK_OVERHEAD_MIB) + AGENT_MIB
                + FRONT_OVERHEAD_MIB on node 0 of a service (rank 0's HTTP front)

The overheads are measured, not guessed: `benchmarks/rank_memory.py` serves and runs bundles under
load on CPU and reads every process's peak resident set (VmHWM) beside S + F (docs/serving.md,
"Pod memory"). The KV cache the plan sizes (`communication.capacity`: kv_bytes_per_token x
kv_tokens_per_rank) is device memory: the pods request GPUs and the runtime keeps the cache where
the model runs, so it is not host memory here; on CPU, where the measurement runs, the KV cache of
the measured load is inside the overhead.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

MIB = 1 << 20
# Measured by benchmarks/rank_memory.py on CPU (docs/serving.md, "Pod memory": a rank beyond S + F
# at most 420 MiB, rank 0's front below, torchrun's agent 222 MiB), with margin:
RANK_OVERHEAD_MIB = 448   # Python, torch, transformers, the process group, the engine, activations, the KV cache under load
# rank 0's HTTP front, a process of its own beside its engine's (runtime/serving/engine_process.py): Python, torch's
# import, uvicorn, starlette, the tokenizer, the scheduler, requests in flight. benchmarks/rank_memory.py counts both
# of rank 0's processes (2026-11-28): the front's process peaked at 227-234 MiB, rank 0 at most 231 MiB (241 at
# concurrency 16) beyond the same bundle's front-less ranks
FRONT_OVERHEAD_MIB = 272
AGENT_MIB = 256           # torchrun's agent (it imports torch) and launch.sh


def rank_weight_bytes(path: Path, dtypes: dict) -> tuple:
    """(S, F, expert S, expert F) of one rank's shard file or `--weights reference` index: its
    tensors' bytes as stored and as held at `dtypes` ({"dense", "experts"}: the plan's
    `capacity.weight_dtypes`), all of them and those of its experts alone."""
    from moeplan.runtime.checkpoint_reader import DTYPES
    from moeplan.runtime.precision import held_bytes

    path = Path(path)
    if path.name.endswith(".index.json"):
        tensors = [(name, t["dtype"], t["shape"]) for name, t in json.loads(path.read_text())["tensors"].items()]
        sizes = [(name, dtype, math.prod(shape) * DTYPES[dtype].itemsize, math.prod(shape)) for name, dtype, shape in tensors]
    else:
        with open(path, "rb") as fh:
            header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
        sizes = [(name, t["dtype"], t["data_offsets"][1] - t["data_offsets"][0], math.prod(t["shape"]))
                 for name, t in header.items() if name != "__metadata__"]

    def held(name, dtype, stored, numel):
        torch_dtype = DTYPES[dtype]
        if not torch_dtype.is_floating_point:
            return stored
        group = "experts" if ".experts." in name else "dense"
        return held_bytes(numel, stored, str(torch_dtype).replace("torch.", ""), "", dtypes[group])

    stored = sum(s for _, _, s, _ in sizes)
    expert = [(s, held(name, d, s, n)) for name, d, s, n in sizes if ".experts." in name]
    return (stored, int(sum(held(*entry) for entry in sizes)), sum(s for s, _ in expert), int(sum(h for _, h in expert)))


def rank_host_bytes(bundle: Path, plan) -> list:
    """weights(r) for every rank of the plan (module docstring), bytes."""
    cache = plan.communication.expert_cache
    dtypes = plan.communication.capacity["weight_dtypes"]
    out = []
    for rank, shard in enumerate(plan.shards):
        stored, held, expert_stored, expert_held = rank_weight_bytes(Path(bundle) / shard, dtypes)
        if not cache:
            out.append(stored + held)
            continue
        tier = int(cache["host"]["capacity"][rank])
        out.append(stored - expert_stored + held - expert_held + tier * int(cache["runtime_expert_bytes"]))
    return out


def node_memory_mib(host_bytes: list, gpus_per_node: int, front: bool) -> list:
    """memory(n) for every node, MiB (module docstring); `front`: node 0 runs the HTTP front."""
    nodes = len(host_bytes) // gpus_per_node
    out = []
    for n in range(nodes):
        weights = sum(host_bytes[n * gpus_per_node:(n + 1) * gpus_per_node])
        extra = gpus_per_node * RANK_OVERHEAD_MIB + AGENT_MIB + (FRONT_OVERHEAD_MIB if front and n == 0 else 0)
        out.append(int(math.ceil(weights / MIB)) + extra)
    return out
