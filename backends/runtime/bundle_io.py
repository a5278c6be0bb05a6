"""Reading a bundle from the runtime's side: plan, placement, model config and one rank's shard.

Only the standard library, torch and safetensors: the bundle is self-contained. The planner's
validation (`moeplan run`) checks hashes before launching; the runtime re-checks what would make
ranks disagree (world size, shard presence) and fails with one line if the launch is wrong.
"""
from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import load_file

from . import hf_moe, tiny_moe

ARCHITECTURES = {"tiny_moe": tiny_moe, "hf_moe": hf_moe}


class BundleError(Exception):
    """The bundle or its launch does not match: one line for the operator."""


def bundle_root() -> Path:
    return Path(__file__).resolve().parent.parent


def read_json(root: Path, name: str) -> dict:
    path = root / name
    if not path.is_file():
        raise BundleError(f"bundle file '{path}' is missing; re-run 'moeplan compile'")
    return json.loads(path.read_text())


def world_size_of(plan: dict) -> int:
    topo = plan["topology"]
    return int(topo["nodes"]) * int(topo["gpus_per_node"])


def architecture(plan: dict):
    name = plan["model"]["architecture"]
    if name not in ARCHITECTURES:
        raise BundleError(f"this runtime supports architectures {sorted(ARCHITECTURES)}, the plan names '{name}'")
    return ARCHITECTURES[name]


def load_rank_weights(root: Path, plan: dict, rank: int, device) -> dict:
    """The tensors of `rank`'s shard (dense weights, gates and its experts), as float32 on device."""
    path = root / plan["shards"][rank]
    if not path.is_file():
        raise BundleError(f"shard '{path}' for rank {rank} is missing; re-run 'moeplan compile'")
    return {k: v.float().to(device) for k, v in load_file(str(path)).items()}
