"""The kubernetes target: a torchrun bundle plus kubernetes/ (ConfigMap, PVC, headless Service,
indexed Job, Dockerfile, README), written by `write_bundle` with one manifest over both.

Why these objects: an indexed Job gives each pod a completion index (= NODE_RANK for the bundle's
`launch.sh`) and, with a headless Service as subdomain, a stable DNS name so pod 0 can be the
rendezvous master; required anti-affinity on the hostname keeps one pod per node. The plan and
launch script travel in a ConfigMap; the weights on a PersistentVolumeClaim.

Every interpolated value goes through the `y` filter (JSON, which is YAML, ASCII-escaped), and
Kubernetes names are DNS-1123 slugs derived from the model name, so a model name holding YAML or
shell metacharacters cannot change the documents' structure. Output bytes depend only on the
inputs (sorted keys, no timestamps).
"""
from __future__ import annotations

import hashlib
import math
import os
import re
from pathlib import Path

from moeplan.backends.common.manifest import write_manifest
from moeplan.backends.common.templating import template_env, to_yaml
from moeplan.backends.torchrun import codegen as torchrun
from moeplan.planner.atomic import atomic_path

DEFAULT_IMAGE = "moeplan-torchrun:latest"
BASE_IMAGE = "pytorch/pytorch:2.4.1-cuda12.1-cudnn9-runtime"
MASTER_PORT = 29500
# Python + torch + a process group per rank: the torch import alone measures ~218 MB RSS
# (planner/platform_data/aws_lambda.yaml); doubled for the communicator buffers and activations.
RANK_RUNTIME_MIB = 512
SHM_SIZE = "1Gi"
DEFAULT_PROMPTS = "The quick brown fox\nOnce upon a time\n"
KUBERNETES_VERSION = "1.31.0"  # the schema the tests validate against
CHECKPOINT_MOUNT = "/checkpoint"  # where --weights reference bundles find the checkpoint volume
FILES = ("configmap.yaml", "pvc.yaml", "service.yaml", "job.yaml")


def slug(name: str, max_len: int = 40) -> str:
    """A DNS-1123 label from any string; a hash suffix keeps distinct names distinct."""
    base = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")[: max_len - 9].strip("-") or "model"
    if base == name:
        return base
    return f"{base}-{hashlib.sha256(name.encode()).hexdigest()[:8]}"


def _mib(n_bytes: float) -> int:
    return int(math.ceil(n_bytes / 2**20))


def context(bundle: Path, plan, image: str = DEFAULT_IMAGE, storage_class=None, new_tokens: int = 16) -> dict:
    """Everything the templates read, from the written bundle and its plan."""
    topo = plan.topology
    nodes, gpn = int(topo["nodes"]), int(topo["gpus_per_node"])
    name = slug(str(plan.model["name"]))
    shard_sizes = [_rank_weight_bytes(bundle / s) for s in plan.shards]
    largest_node = lambda per_rank: max(sum(per_rank[n * gpn:(n + 1) * gpn]) for n in range(nodes))
    node_shards = largest_node(shard_sizes)
    node_host = largest_node(_rank_host_bytes(plan, shard_sizes))
    memory_mib = _mib(node_host) + gpn * RANK_RUNTIME_MIB
    bundle_bytes = sum(p.stat().st_size for p in bundle.rglob("*") if p.is_file())  # before its manifest
    storage_gib = max(1, math.ceil(bundle_bytes * 1.25 / 2**30))
    names = {"configmap": f"{name}-plan", "pvc": f"{name}-bundle", "service": f"{name}-ranks", "job": name,
             "checkpoint_pvc": f"{name}-checkpoint"}
    # --weights reference: the original checkpoint is a second, read-only volume the user provides
    checkpoint = plan.model.get("checkpoint") if isinstance(plan.model.get("checkpoint"), dict) else None
    labels = {"app.kubernetes.io/managed-by": "moeplan", "app.kubernetes.io/name": name}
    selector = {"moeplan.io/deployment": name}
    # The ranks run the bundle in place from the read-only volume, so launch.sh checks the files
    # it runs against manifest.json (a staged partial copy could not be checked); only the
    # prompts come from the ConfigMap.
    stage = "set -eu; cp /plan/prompts.txt /work/prompts.txt"
    configmap = [(k, (bundle / k).read_text()) for k in ("launch.sh", "placement.json", "plan.json")]
    configmap.append(("prompts.txt", DEFAULT_PROMPTS))
    return {
        "slug": name, "names": names, "labels": labels, "selector": selector, "pod_labels": {**labels, **selector},
        "annotations": {"moeplan.io/model-name": str(plan.model["name"]), "moeplan.io/plan-version": str(plan.version)},
        "model_name_json": to_yaml(str(plan.model["name"])), "plan_version": plan.version,
        "nodes": nodes, "gpus_per_node": gpn, "world_size": nodes * gpn, "image": str(image), "base_image": BASE_IMAGE,
        "storage_class": storage_class, "storage_request": f"{storage_gib}Gi",
        "resources": {"nvidia.com/gpu": str(gpn), "memory": f"{memory_mib}Mi", "cpu": str(gpn)},
        "shard_mib": _mib(node_shards), "host_mib": _mib(node_host), "rank_runtime_mib": RANK_RUNTIME_MIB, "shm_size": SHM_SIZE,
        "master_port": MASTER_PORT, "master_addr": f"{names['job']}-0.{names['service']}",
        "stage_command": ["sh", "-c", stage],
        "launch_args": ["--prompts", "/work/prompts.txt", "--new-tokens", str(int(new_tokens)), "--out", "/results"],
        "configmap_data": sorted(configmap),
        "pip_packages": _pip_packages(bundle),
        "checkpoint": checkpoint, "checkpoint_mount": CHECKPOINT_MOUNT,
        "expert_cache": bool(plan.communication.get("expert_cache")),
    }


def _rank_host_bytes(plan, shard_sizes: list) -> list:
    """Host memory per rank for its weights: twice what it loads (read buffer + the loaded copy),
    or, with an expert cache (issue 13), twice its dense weights plus its host tier of experts:
    the cache itself lives in GPU memory and the other experts stay on the volume."""
    cache = plan.communication.get("expert_cache")
    if not cache:
        return [2 * size for size in shard_sizes]
    local = [sum(len(layer["devices"][r]) for layer in plan.placement["layers"]) for r in range(len(shard_sizes))]
    disk, host = int(cache["disk_expert_bytes"]), int(cache["runtime_expert_bytes"])
    tier = cache["host"]["capacity"]
    return [2 * max(size - n * disk, 0) + t * host for size, n, t in zip(shard_sizes, local, tier)]


def _rank_weight_bytes(path: Path) -> int:
    """Bytes a rank loads: its shard file, or what its checkpoint index reads (--weights reference)."""
    if not path.name.endswith(".index.json"):
        return os.path.getsize(path)
    import json

    from moeplan.backends.runtime.checkpoint_reader import DTYPES

    tensors = json.loads(path.read_text())["tensors"].values()
    return sum(math.prod(t["shape"]) * DTYPES[t["dtype"]].itemsize for t in tensors)


def _pip_packages(bundle: Path) -> list:
    """What the image adds to its torch base: the bundle's pinned requirements (model library included)."""
    path = bundle / "requirements.txt"
    if not path.is_file():
        return ["safetensors>=0.4"]
    return [line for line in path.read_text().split() if not line.startswith("torch==")]


def write_manifests(bundle: Path, plan, image: str = DEFAULT_IMAGE, storage_class=None) -> list:
    """Write kubernetes/ (manifests, Dockerfile, README) into a written torchrun bundle; returns paths."""
    bundle = Path(bundle)
    env = template_env("kubernetes")
    ctx = context(bundle, plan, image=image, storage_class=storage_class)
    out = bundle / "kubernetes"
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name in FILES + ("Dockerfile", "README.md"):
        path = out / name
        path.write_text(env.get_template(f"{name}.j2").render(**ctx))
        os.chmod(path, 0o644)
        written.append(path)
    return written


def write_bundle(out, plan, weights, model_files: dict, checkpoint: dict | None = None) -> dict:
    """The torchrun bundle (`backends/torchrun/codegen.py`, same arguments) plus kubernetes/, written
    atomically at `out` with one manifest over both; returns the manifest. The plan's deployment
    holds the image and storage class."""
    plan = torchrun.bundle_plan(plan, model_files, checkpoint)
    with atomic_path(Path(out), kind="bundle") as tmp:
        torchrun.write_files(tmp, plan, weights, model_files["files"])
        write_manifests(tmp, plan, image=plan.deployment["image"], storage_class=plan.deployment.get("storage_class"))
        return write_manifest(tmp)
