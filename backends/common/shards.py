"""Per-rank weight shards: dense weights and gates on every rank, each rank only its experts.

A tensor belongs to an expert if the architecture says so (`is_expert_tensor`); the placement
decides which ranks hold that expert (replicas included). Tensors keep their source names, so a
rank's shard is a subset of the source state dict. The file is standard safetensors, but written
here with a header whose keys are sorted: the safetensors library keeps metadata in a hash map
whose order changes between processes, which would make bundle bytes differ run to run.
"""
from __future__ import annotations

import json
import struct
from pathlib import Path

import torch


def shard_name(rank: int) -> str:
    return f"shards/rank-{rank:05d}.safetensors"


def split_state_dict(state: dict, placement: dict, is_expert_tensor) -> list:
    """One {name: tensor} per rank, rank order."""
    devices_per_layer = [layer["devices"] for layer in sorted(placement["layers"], key=lambda e: e["layer"])]
    world = len(devices_per_layer[0])
    hosted = [{(l, int(e)) for l, devices in enumerate(devices_per_layer) for e in devices[r]} for r in range(world)]
    shards = [dict() for _ in range(world)]
    for name in sorted(state):
        owner = is_expert_tensor(name)
        for r in range(world):
            if owner is None or owner in hosted[r]:
                shards[r][name] = state[name]
    return shards


SAFETENSORS_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
                      torch.int64: "I64", torch.int32: "I32", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}


def write_shard(path: Path, tensors: dict, rank: int) -> None:
    """Write a safetensors file with sorted header keys and data in name order."""
    path.parent.mkdir(parents=True, exist_ok=True)
    header = {"__metadata__": {"format": "pt", "moeplan_rank": str(rank)}}
    blobs, offset = [], 0
    for name in sorted(tensors):
        t = tensors[name].detach().to("cpu").contiguous()
        if t.dtype not in SAFETENSORS_DTYPES:
            raise ValueError(f"tensor {name} has dtype {t.dtype}, which shards do not support")
        data = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
        header[name] = {"dtype": SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    head = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(head)))
        fh.write(head)
        for data in blobs:
            fh.write(data)


def state_dict_sha256(state: dict) -> str:
    """Hash of names, dtypes, shapes and bytes of a state dict, in name order."""
    import hashlib

    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name].detach().to("cpu").contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()
