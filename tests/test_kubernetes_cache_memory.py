"""Kubernetes pods of an offloaded bundle request memory for what a rank holds in host memory.

With an expert cache (issue 13) a rank keeps its dense weights (read buffer + float32 copy), its
host tier of experts (float32) and the runtime; the cache is GPU memory and the other experts stay
on the volume. Checked against the shard files' own safetensors headers, not the codegen's sums.
"""
import json
import math
import struct
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_expert_store import _compile, tiny  # noqa: E402  (same tiny checkpoints and compile call)

from moeplan.backends.kubernetes.codegen import RANK_RUNTIME_MIB, _rank_host_bytes  # noqa: E402
from moeplan.planner.plan import Plan  # noqa: E402


def _dense_file_bytes(shard: Path) -> int:
    """File bytes of a shard less its expert tensors' data (header included)."""
    raw = shard.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    experts = sum(e["data_offsets"][1] - e["data_offsets"][0] for k, e in header.items() if ".experts." in k)
    return len(raw) - experts


def _pod_memory_mib(out: Path) -> int:
    pod = yaml.safe_load((out / "kubernetes" / "job.yaml").read_text())["spec"]["template"]["spec"]
    return int(pod["containers"][0]["resources"]["requests"]["memory"].removesuffix("Mi"))


def _host_bytes(out: Path, shards: list) -> list:
    """Per rank, the host bytes the codegen sizes pods by (exact: the tiny shards round to 1 MiB)."""
    return _rank_host_bytes(Plan.from_json((out / "plan.json").read_text()), [s.stat().st_size for s in shards])


def test_cached_pods_request_dense_weights_and_host_tier_not_every_expert(tmp_path):
    directory = tiny.build("mixtral", tmp_path / "models")
    shards = [tmp_path / "none" / "shards" / f"rank-{r:05d}.safetensors" for r in (0, 1)]
    plain = _compile(directory, tmp_path / "plain", 2, "--target", "kubernetes")
    none = _compile(directory, tmp_path / "none", 2, "--target", "kubernetes", "--expert-cache", "2", "--host-memory", "0")
    full = _compile(directory, tmp_path / "full", 2, "--target", "kubernetes", "--expert-cache", "2", "--host-memory", "1GiB")
    assert plain["communication"].get("expert_cache") is None
    dense = sum(2 * _dense_file_bytes(s) for s in shards)
    assert sum(_host_bytes(tmp_path / "none", shards)) == dense
    assert _pod_memory_mib(tmp_path / "none") == math.ceil(dense / 2**20) + 2 * RANK_RUNTIME_MIB
    cache = full["communication"]["expert_cache"]
    tier = sum(cache["host"]["capacity"]) * cache["runtime_expert_bytes"]
    assert sum(cache["host"]["capacity"]) == 16  # 1 GiB holds every expert of both ranks
    assert sum(_host_bytes(tmp_path / "full", shards)) == dense + tier
    assert _pod_memory_mib(tmp_path / "full") == math.ceil((dense + tier) / 2**20) + 2 * RANK_RUNTIME_MIB
    whole = sum(2 * s.stat().st_size for s in shards)
    assert sum(_host_bytes(tmp_path / "plain", shards)) == whole > dense + tier  # every expert as well, twice
    assert _pod_memory_mib(tmp_path / "plain") == math.ceil(whole / 2**20) + 2 * RANK_RUNTIME_MIB
    assert none["communication"]["expert_cache"]["host"]["capacity"] == [0, 0]
