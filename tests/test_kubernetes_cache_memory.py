"""Kubernetes pods of an offloaded bundle request memory for what a rank holds in host memory.

With an expert cache (issue 13) a rank keeps its dense weights (read buffer + float32 copy), its
host tier of experts (float32) and the runtime; the cache is GPU memory and the other experts stay
on the volume. Checked against the shard files' own safetensors headers, not the codegen's sums.
The service's node 0 pod (statefulset.yaml, one node here) adds rank 0's HTTP front.
"""
import json
import math
import struct
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_expert_store import _compile, tiny

from moeplan.backends.kubernetes.pod_memory import AGENT_MIB, FRONT_OVERHEAD_MIB, RANK_OVERHEAD_MIB
from moeplan.backends.kubernetes.pod_memory import rank_host_bytes
from moeplan.core.plan import Plan

K8S = ("--cpu-only", "--image", "registry.example/moe:1")  # CPU pods: what this machine runs
OVERHEADS_MIB = 2 * RANK_OVERHEAD_MIB + AGENT_MIB + FRONT_OVERHEAD_MIB  # 2 ranks on node 0 of the service


def _tensor_bytes(shard: Path, experts: bool) -> int:
    """A shard's expert (or dense) tensors' bytes as stored plus as float32, from its own header."""
    raw = shard.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    chosen = [e for k, e in header.items() if k != "__metadata__" and (".experts." in k) == experts]
    return sum(e["data_offsets"][1] - e["data_offsets"][0] + 4 * math.prod(e["shape"]) for e in chosen)


def _pod_memory_mib(out: Path) -> int:
    pod = yaml.safe_load((out / "kubernetes" / "statefulset.yaml").read_text())["spec"]["template"]["spec"]
    return int(pod["containers"][0]["resources"]["requests"]["memory"].removesuffix("Mi"))


def _host_bytes(out: Path) -> list:
    """Per rank, the host bytes the codegen sizes pods by."""
    return rank_host_bytes(out, Plan.from_json((out / "plan.json").read_text()))


def test_cached_pods_request_dense_weights_and_host_tier_not_every_expert(tmp_path):
    directory = tiny.build("mixtral", tmp_path / "models")
    shards = [tmp_path / "none" / "shards" / f"rank-{r:05d}.safetensors" for r in (0, 1)]
    plain = _compile(directory, tmp_path / "plain", 2, "--target", "kubernetes", *K8S)
    none = _compile(directory, tmp_path / "none", 2, "--target", "kubernetes", "--expert-cache", "2", "--host-memory", "0", *K8S)
    full = _compile(directory, tmp_path / "full", 2, "--target", "kubernetes", "--expert-cache", "2", "--host-memory", "1GiB", *K8S)
    assert plain["communication"].get("expert_cache") is None
    dense = sum(_tensor_bytes(s, experts=False) for s in shards)
    assert sum(_host_bytes(tmp_path / "none")) == dense
    assert _pod_memory_mib(tmp_path / "none") == math.ceil(dense / 2**20) + OVERHEADS_MIB
    cache = full["communication"]["expert_cache"]
    tier = sum(cache["host"]["capacity"]) * cache["runtime_expert_bytes"]
    assert sum(cache["host"]["capacity"]) == 16  # 1 GiB holds every expert of both ranks
    assert sum(_host_bytes(tmp_path / "full")) == dense + tier
    assert _pod_memory_mib(tmp_path / "full") == math.ceil((dense + tier) / 2**20) + OVERHEADS_MIB
    whole = dense + sum(_tensor_bytes(s, experts=True) for s in shards)
    assert sum(_host_bytes(tmp_path / "plain")) == whole > dense + tier  # every expert as well, read and float32
    assert _pod_memory_mib(tmp_path / "plain") == math.ceil(whole / 2**20) + OVERHEADS_MIB
    assert none["communication"]["expert_cache"]["host"]["capacity"] == [0, 0]
