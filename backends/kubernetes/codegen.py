"""The kubernetes target: a torchrun bundle plus kubernetes/, written by `write_bundle` with one
manifest over both. By default a long-running service; with `--batch-job` (recorded in the plan's
deployment as `batch_job`) today's indexed batch Job.

The service (docs/serving.md, "Kubernetes"): every pod runs one node's ranks with the bundle's own
`launch.sh --serve`, so a deployed bundle behaves as `moeplan serve` does locally.
* StatefulSet `<name>` (1 pod: node 0, rank 0 and its HTTP front) and, with more than one node,
  StatefulSet `<name>-worker` (nodes 1..N-1; NODE_RANK = its pod index + 1). Two sets because only
  node 0 serves HTTP: its pod alone carries the `/health` startup, readiness and liveness probes
  and the served port, while the workers' liveness is their process (a rank that dies takes its
  service down; every node's ranks then exit non-zero and the kubelet restarts them). StatefulSets
  give stable DNS names through the headless Service (MASTER_ADDR = `<name>-0.<name>-ranks`) and
  restart pods in place; a Deployment would not, and LeaderWorkerSet, which has this shape built
  in, is not core API.
* Service `<name>-ranks`: headless, every pod, publishing not-ready pods (the rendezvous happens
  before node 0 is ready). Service `<name>-api`: ClusterIP on the served port, node 0 only.
* PodDisruptionBudget `<name>`: every pod must stay (the ranks are one model: evicting any pod takes
  the service down), so drains wait for an operator; pods that are not ready may still be evicted.
* Memory requests from the plan (`pod_memory.py`); the image installs the bundle's pinned
  requirements (Dockerfile, its own copy of requirements.txt as build context).

Both shapes: required anti-affinity on the hostname keeps one pod per node; the weights are on a
PersistentVolumeClaim the pods mount read-only and run `launch.sh` in place from; the plan and
launch script also travel in a ConfigMap.

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
from moeplan.backends.kubernetes import pod_memory
from moeplan.backends.torchrun import codegen as torchrun
from moeplan.core.atomic import atomic_path

DEFAULT_IMAGE = "moeplan-torchrun:latest"
# The image installs exactly the bundle's requirements.txt (torch pinned as the plan was compiled)
# on Debian's Python of the version the runtime is tested with; from PyPI, torch's Linux x86_64
# wheels carry CUDA, which the GPU pods need.
BASE_IMAGE = "python:3.11-slim-bookworm"
MASTER_PORT = 29500
SERVE_PORT = 8000  # rank 0's HTTP port in the pod, as `moeplan serve` and vLLM default
SHM_SIZE = "1Gi"
DEFAULT_PROMPTS = "The quick brown fox\nOnce upon a time\n"
KUBERNETES_VERSION = "1.31.0"  # the schema the tests validate against
CHECKPOINT_MOUNT = "/checkpoint"  # where --weights reference bundles find the checkpoint volume
# Probes on /health (200 only while every rank is up). Startup: loading the weights may take long
# (up to STARTUP_PERIOD_S x STARTUP_FAILURES); liveness allows a minute of failures, beyond the
# service's own exit within 30 s of a rank's death; readiness takes node 0 out of its Service at once.
STARTUP_PERIOD_S, STARTUP_FAILURES = 10, 360
LIVENESS_PERIOD_S, LIVENESS_FAILURES = 10, 6
READINESS_PERIOD_S, READINESS_FAILURES = 5, 2
PROBE_TIMEOUT_S = 5
GRACE_SECONDS = 300  # SIGTERM: admission stops and the requests in flight finish within this
JOB_FILES = ("configmap.yaml", "pvc.yaml", "service.yaml", "job.yaml")
SERVICE_FILES = ("configmap.yaml", "pvc.yaml", "service.yaml", "api-service.yaml", "statefulset.yaml", "pdb.yaml")
WORKERS_FILE = "workers.yaml"  # the worker StatefulSet, with more than one node
OTHER_FILES = ("Dockerfile", "requirements.txt", "README.md")


def manifest_files(nodes: int, batch_job: bool) -> tuple:
    """The YAML files kubernetes/ holds for a plan of `nodes` nodes."""
    if batch_job:
        return JOB_FILES
    return SERVICE_FILES + ((WORKERS_FILE,) if nodes > 1 else ())


def slug(name: str, max_len: int = 40) -> str:
    """A DNS-1123 label from any string; a hash suffix keeps distinct names distinct."""
    base = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")[: max_len - 9].strip("-") or "model"
    if base == name:
        return base
    return f"{base}-{hashlib.sha256(name.encode()).hexdigest()[:8]}"


def context(bundle: Path, plan, image: str = DEFAULT_IMAGE, storage_class=None, new_tokens: int = 16) -> dict:
    """Everything the templates read, from the written bundle and its plan."""
    topo = plan.topology
    nodes, gpn = int(topo["nodes"]), int(topo["gpus_per_node"])
    batch_job = bool(plan.deployment.get("batch_job"))
    name = slug(str(plan.model["name"]))
    host_bytes = pod_memory.rank_host_bytes(bundle, plan)
    node_mib = pod_memory.node_memory_mib(host_bytes, gpn, front=not batch_job)
    bundle_bytes = sum(p.stat().st_size for p in bundle.rglob("*") if p.is_file())  # before its manifest
    storage_gib = max(1, math.ceil(bundle_bytes * 1.25 / 2**30))
    names = {"configmap": f"{name}-plan", "pvc": f"{name}-bundle", "service": f"{name}-ranks", "job": name,
             "head": name, "workers": f"{name}-worker", "api": f"{name}-api", "pdb": name,
             "api_key": f"{name}-api-key", "checkpoint_pvc": f"{name}-checkpoint"}
    # --weights reference: the original checkpoint is a second, read-only volume the user provides
    checkpoint = plan.model.get("checkpoint") if isinstance(plan.model.get("checkpoint"), dict) else None
    labels = {"app.kubernetes.io/managed-by": "moeplan", "app.kubernetes.io/name": name}
    selector = {"moeplan.io/deployment": name}
    resources = lambda mib: {"nvidia.com/gpu": str(gpn), "memory": f"{mib}Mi", "cpu": str(gpn)}
    # The ranks run the bundle in place from the read-only volume, so launch.sh checks the files
    # it runs against manifest.json (a staged partial copy could not be checked); only the batch
    # Job's prompts come from the ConfigMap.
    configmap = [(k, (bundle / k).read_text()) for k in ("launch.sh", "placement.json", "plan.json")]
    if batch_job:
        configmap.append(("prompts.txt", DEFAULT_PROMPTS))
    launch = ["bash", "/bundle/launch.sh"]
    capacity = plan.communication.capacity or {}
    head = {"name": names["head"], "head": True, "replicas": 1, "selector": {**selector, "moeplan.io/role": "head"},
            "resources": resources(node_mib[0]), "command": launch}
    workers = {"name": names["workers"], "head": False, "replicas": nodes - 1,
               "selector": {**selector, "moeplan.io/role": "worker"},
               "resources": resources(max(node_mib[1:], default=node_mib[0])),
               # NODE_RANK = pod index + 1: the shell does the sum, then becomes launch.sh (signals reach its trap)
               "command": ["sh", "-c", 'export NODE_RANK=$((POD_INDEX + 1)); exec bash /bundle/launch.sh "$@"', "launch.sh"]}
    for role in (head, workers):
        role["pod_labels"] = {**labels, **role["selector"]}
    return {
        "slug": name, "names": names, "labels": labels, "selector": selector, "pod_labels": {**labels, **selector},
        "annotations": {"moeplan.io/model-name": str(plan.model["name"]), "moeplan.io/plan-version": str(plan.version)},
        "model_name_json": to_yaml(str(plan.model["name"])), "plan_version": plan.version, "batch_job": batch_job,
        "nodes": nodes, "gpus_per_node": gpn, "world_size": nodes * gpn, "image": str(image), "base_image": BASE_IMAGE,
        "storage_class": storage_class, "storage_request": f"{storage_gib}Gi",
        "resources": resources(max(node_mib)), "node_mib": node_mib, "head": head, "workers": workers,
        "host_mib": [int(math.ceil(b / pod_memory.MIB)) for b in host_bytes], "rank_overhead_mib": pod_memory.RANK_OVERHEAD_MIB,
        "front_overhead_mib": pod_memory.FRONT_OVERHEAD_MIB, "agent_mib": pod_memory.AGENT_MIB, "shm_size": SHM_SIZE,
        "master_port": MASTER_PORT, "serve_port": SERVE_PORT,
        "master_addr": f"{names['job'] if batch_job else names['head']}-0.{names['service']}",
        "stage_command": ["sh", "-c", "set -eu; cp /plan/prompts.txt /work/prompts.txt"],
        "launch_args": ["--prompts", "/work/prompts.txt", "--new-tokens", str(int(new_tokens)), "--out", "/results"],
        "serve_args": ["--serve", "--host", "0.0.0.0", "--port", str(SERVE_PORT)],
        "probes": {"startup": (STARTUP_PERIOD_S, STARTUP_FAILURES), "liveness": (LIVENESS_PERIOD_S, LIVENESS_FAILURES),
                   "readiness": (READINESS_PERIOD_S, READINESS_FAILURES)}, "probe_timeout_s": PROBE_TIMEOUT_S,
        "grace_seconds": GRACE_SECONDS, "capacity": capacity,
        "configmap_data": sorted(configmap),
        "checkpoint": checkpoint, "checkpoint_mount": CHECKPOINT_MOUNT,
        "expert_cache": bool(plan.communication.expert_cache),
    }


def write_manifests(bundle: Path, plan, image: str = DEFAULT_IMAGE, storage_class=None) -> list:
    """Write kubernetes/ (manifests, Dockerfile and its requirements.txt, README) into a written
    torchrun bundle; returns paths."""
    bundle = Path(bundle)
    env = template_env("kubernetes")
    ctx = context(bundle, plan, image=image, storage_class=storage_class)
    out = bundle / "kubernetes"
    out.mkdir(parents=True, exist_ok=True)
    roles = {"statefulset.yaml": ("statefulset.yaml", {"role": ctx["head"]}),
             WORKERS_FILE: ("statefulset.yaml", {"role": ctx["workers"]})}  # one template, two roles
    written = []
    for name in manifest_files(ctx["nodes"], ctx["batch_job"]) + ("Dockerfile", "README.md"):
        template, extra = roles.get(name, (name, {}))
        path = out / name
        path.write_text(env.get_template(f"{template}.j2").render(**ctx, **extra))
        written.append(path)
    written.append(out / "requirements.txt")  # the image's build context holds the bundle's own pins
    written[-1].write_bytes((bundle / "requirements.txt").read_bytes())
    for path in written:
        os.chmod(path, 0o644)
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
