"""Per-rank weight shards: dense weights and gates on every rank, each rank only its experts.

A tensor belongs to an expert if the architecture says so (`is_expert_tensor`); the placement
decides which ranks hold that expert (replicas included). Tensors keep their source names, so a
rank's shard is a subset of the source state dict. safetensors writes tensors in a fixed order
and we pass fixed metadata, so shard bytes depend only on the weights and the placement.
"""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file


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


def write_shard(path: Path, tensors: dict, rank: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    clean = {k: v.detach().to("cpu").contiguous().clone() for k, v in tensors.items()}
    save_file(clean, str(path), metadata={"format": "pt", "moeplan_rank": str(rank)})


def state_dict_sha256(state: dict) -> str:
    """Hash of names, dtypes, shapes and bytes of a state dict, in name order."""
    import hashlib

    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name].detach().to("cpu").contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()
