"""The kubernetes target: a torchrun bundle plus kubernetes/, written by `write_bundle` with one
manifest over both. By default a long-running service; with `--batch-job` (recorded in the plan's
deployment as `batch_job`) an indexed batch Job. What the plan records of the deployment (image,
GPUs or `--cpu-only`, the weights' way to the pods, scheduling) is `deployment.py`'s.

The service (docs/serving.md, "Kubernetes"): every pod runs one node's ranks with the bundle's own
`launch.sh --serve`, so a deployed bundle behaves as `moeplan serve` does locally.
* StatefulSet `<name>` (1 pod: node 0, rank 0 and its HTTP front) and, with more than one node,
  StatefulSet `<name>-worker` (nodes 1..N-1; NODE_RANK = its pod index + 1). Two sets because only
  node 0 serves HTTP: its pod alone carries the `/health` startup, readiness and liveness probes,
  the served port and the Prometheus scrape annotations (`/metrics` on that port), while the
  workers' liveness is their process (a rank that dies takes its service down; every node's ranks
  then exit non-zero and the kubelet restarts them). StatefulSets give stable DNS names through the
  headless Service (MASTER_ADDR = `<name>-0.<name>-ranks`), restart pods in place and keep each
  pod's volume claims; a Deployment would not, and LeaderWorkerSet, which has this shape built in,
  is not core API.
* Service `<name>-ranks`: headless, every pod, publishing not-ready pods (the rendezvous happens
  before node 0 is ready). Service `<name>-api`: ClusterIP on the served port, node 0 only.
* PodDisruptionBudget `<name>`: every pod must stay (the ranks are one model: evicting any pod takes
  the service down), so drains wait for an operator; pods that are not ready may still be evicted.
* Memory requests from the plan (`pod_memory.py`); the image installs the bundle's pinned
  requirements (Dockerfile).

The weights (`--weights-from`): `image` builds the bundle into the image at /bundle (the Dockerfile's
build context is the bundle itself); a URL gives each pod its own ReadWriteOnce claim (the
StatefulSets' volumeClaimTemplates, the Job's ephemeral volumes: what a default storage class
provides) and an init container `fetch` (`fetch_bundle.py`) that downloads the bundle's tar onto it
once; `volume` mounts one shared claim the user fills. Either way the ranks run `launch.sh` in place
from a read-only /bundle, so it checks every file against manifest.json, and the pods set
MOEPLAN_PLAN_SHA256, so launch.sh also refuses a bundle that is not the one these manifests were
written from (an image built from another bundle).

Every pod runs as a non-root user with a read-only root filesystem: the ranks write only to /tmp
(torchrun's rendezvous files; HOME is /tmp) and /dev/shm, both emptyDirs (tests trace the writes).
Both shapes: required anti-affinity on the hostname keeps one pod per node. The batch Job reads its
prompts from a ConfigMap the user creates from a file (README), so no hashed file is ever edited.

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

from moeplan.backends.common.files import finish_bundle
from moeplan.backends.common.templating import template_env, to_yaml
from moeplan.backends.kubernetes import pod_memory
from moeplan.backends.kubernetes.deployment import tolerations, weights_mode
from moeplan.backends.torchrun import codegen as torchrun
from moeplan.core.atomic import atomic_path

# The image installs exactly the bundle's requirements.txt (torch pinned as the plan was compiled)
# on Debian's Python of the version the runtime is tested with; from PyPI, torch's Linux x86_64
# wheels carry CUDA, which the GPU pods need (--cpu-only images take torch's CPU wheels instead).
BASE_IMAGE = "python:3.11-slim-bookworm"
CPU_TORCH_INDEX = "https://download.pytorch.org/whl/cpu"
MASTER_PORT = 29500
SERVE_PORT = 8000  # rank 0's HTTP port in the pod, as `moeplan serve` and vLLM default
METRICS_PATH = "/metrics"  # Prometheus text on the served port (runtime/serving/openai_service.py), no API key
SHM_SIZE = "1Gi"
TMP_SIZE = "1Gi"  # /tmp: torchrun's rendezvous files, Python's temporary files (a few KiB in practice)
KUBERNETES_VERSION = "1.31.0"  # a schema the tests validate against
MIN_KUBERNETES_VERSION = "1.28.0"  # the oldest that runs the manifests: the pod-index label the workers read is 1.28+
USER_ID = 10001  # the image's user (the Dockerfile's USER) and the pods' runAsUser: not root
CHECKPOINT_MOUNT = "/checkpoint"  # where --weights reference bundles find the checkpoint volume
VOLUME_MOUNT = "/data"  # the fetch init container's view of a pod's own weights volume
INIT_RESOURCES = {"cpu": "1", "memory": "512Mi"}  # init containers: requests = limits keeps the pods Guaranteed
# Probes on /health (200 only while every rank is up). Startup: loading the weights may take long
# (up to STARTUP_PERIOD_S x STARTUP_FAILURES); liveness allows a minute of failures, beyond the
# service's own exit within 30 s of a rank's death; readiness takes node 0 out of its Service at once.
STARTUP_PERIOD_S, STARTUP_FAILURES = 10, 360
LIVENESS_PERIOD_S, LIVENESS_FAILURES = 10, 6
READINESS_PERIOD_S, READINESS_FAILURES = 5, 2
PROBE_TIMEOUT_S = 5
GRACE_SECONDS = 300  # SIGTERM: admission stops and the requests in flight finish within this
WORKERS_FILE = "workers.yaml"  # the worker StatefulSet, with more than one node
PVC_FILE = "pvc.yaml"  # the shared claim of --weights-from volume


def manifest_files(nodes: int, batch_job: bool, weights: str = "image") -> tuple:
    """The YAML files kubernetes/ holds for a plan of `nodes` nodes; `weights`: 'image', 'url' or 'volume'."""
    claim = (PVC_FILE,) if weights == "volume" else ()
    if batch_job:
        return claim + ("service.yaml", "job.yaml")
    return claim + ("service.yaml", "api-service.yaml", "statefulset.yaml", "pdb.yaml") + ((WORKERS_FILE,) if nodes > 1 else ())


def other_files(weights: str) -> tuple:
    """The other files of kubernetes/: the image's Dockerfile (and, where kubernetes/ is its build
    context, a copy of the bundle's requirements.txt) and the README."""
    return ("Dockerfile", "README.md") + (() if weights == "image" else ("requirements.txt",))


def slug(name: str, max_len: int = 40) -> str:
    """A DNS-1123 label from any string; a hash suffix keeps distinct names distinct."""
    base = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")[: max_len - 9].strip("-") or "model"
    if base == name:
        return base
    return f"{base}-{hashlib.sha256(name.encode()).hexdigest()[:8]}"


def _size(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def fetch_command(url: str, plan_sha256: str) -> list:
    """The fetch init container's command: `fetch_bundle.py`'s own text run by the image's Python."""
    source = (Path(__file__).with_name("fetch_bundle.py")).read_text()
    return ["python", "-c", source, url, VOLUME_MOUNT, plan_sha256]


def _weights(mode: str, deployment: dict, names: dict, labels: dict, storage: str, batch_job: bool) -> dict:
    """Volumes, mounts and init containers that bring the bundle to /bundle (module docstring)."""
    claim = {"accessModes": [deployment.get("access_mode")], "resources": {"requests": {"storage": storage}}}
    if deployment.get("storage_class") is not None:
        claim["storageClassName"] = deployment["storage_class"]
    out = {"volumes": [], "mounts": [], "claim_templates": [], "claim": claim}
    if mode == "volume":
        out["volumes"] = [{"name": "bundle", "persistentVolumeClaim": {"claimName": names["pvc"], "readOnly": True}}]
        out["mounts"] = [{"name": "bundle", "mountPath": "/bundle", "readOnly": True}]
    elif mode == "url":
        out["mounts"] = [{"name": "bundle", "mountPath": "/bundle", "subPath": "bundle", "readOnly": True}]
        template = {"metadata": {"labels": labels}, "spec": claim}
        if batch_job:  # a Job has no volumeClaimTemplates: a generic ephemeral volume is each pod's own claim
            out["volumes"] = [{"name": "bundle", "ephemeral": {"volumeClaimTemplate": template}}]
        else:  # kept across restarts of the pod, so the download happens once
            out["claim_templates"] = [{"metadata": {"name": "bundle", **template["metadata"]}, "spec": claim}]
    return out


def context(bundle: Path, plan) -> dict:
    """Everything the templates read, from the written bundle and its plan."""
    topo, deployment = plan.topology, plan.deployment
    nodes, gpn = int(topo["nodes"]), int(topo["gpus_per_node"])
    batch_job, cpu_only = bool(deployment.get("batch_job")), bool(deployment.get("cpu_only"))
    image, source = str(deployment["image"]), deployment.get("weights_from", "image")
    mode = weights_mode(source)
    name = slug(str(plan.model["name"]))
    host_bytes = pod_memory.rank_host_bytes(bundle, plan)
    node_mib = pod_memory.node_memory_mib(host_bytes, gpn, front=not batch_job)
    bundle_bytes = sum(p.stat().st_size for p in bundle.rglob("*") if p.is_file())  # before its manifest
    storage_gib = max(1, math.ceil(bundle_bytes * 1.25 / 2**30))
    plan_sha256 = hashlib.sha256((bundle / "plan.json").read_bytes()).hexdigest()
    names = {"prompts": f"{name}-prompts", "pvc": f"{name}-bundle", "service": f"{name}-ranks", "job": name,
             "head": name, "workers": f"{name}-worker", "api": f"{name}-api", "pdb": name,
             "api_key": f"{name}-api-key", "checkpoint_pvc": f"{name}-checkpoint"}
    # --weights reference: the original checkpoint is a second, read-only volume the user provides
    checkpoint = plan.model.get("checkpoint") if isinstance(plan.model.get("checkpoint"), dict) else None
    labels = {"app.kubernetes.io/managed-by": "moeplan", "app.kubernetes.io/name": name}
    selector = {"moeplan.io/deployment": name}
    annotations = {"moeplan.io/model-name": str(plan.model["name"]), "moeplan.io/plan-version": str(plan.version)}
    gpus = {} if cpu_only else {"nvidia.com/gpu": str(gpn)}
    resources = lambda mib: {**gpus, "memory": f"{mib}Mi", "cpu": str(gpn)}
    weights = _weights(mode, deployment, names, labels, f"{storage_gib}Gi", batch_job)
    env = [{"name": "HOME", "value": "/tmp"}, {"name": "MOEPLAN_PLAN_SHA256", "value": plan_sha256}]
    scratch = [{"name": "tmp", "mountPath": "/tmp"}]
    security = {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]}}
    pod_security = {"runAsNonRoot": True, "runAsUser": USER_ID, "runAsGroup": USER_ID,
                    "seccompProfile": {"type": "RuntimeDefault"}}
    if mode == "url":  # the fetch container writes the pod's own volume: it must belong to the pods' group
        pod_security.update(fsGroup=USER_ID, fsGroupChangePolicy="OnRootMismatch")
    init = []
    if batch_job:
        init.append({"name": "stage", "image": image, "command": ["sh", "-c", "set -eu; cp /plan/prompts.txt /work/prompts.txt"],
                     "env": env[:1], "resources": {"requests": INIT_RESOURCES, "limits": INIT_RESOURCES},
                     "securityContext": security,
                     "volumeMounts": [{"name": "prompts", "mountPath": "/plan", "readOnly": True},
                                      {"name": "work", "mountPath": "/work"}] + scratch})
    if mode == "url":
        init.append({"name": "fetch", "image": image, "command": fetch_command(source, plan_sha256), "env": env[:1],
                     "resources": {"requests": INIT_RESOURCES, "limits": INIT_RESOURCES}, "securityContext": security,
                     "volumeMounts": [{"name": "bundle", "mountPath": VOLUME_MOUNT}] + scratch})
    volumes = weights["volumes"] + [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": SHM_SIZE}},
                                    {"name": "tmp", "emptyDir": {"sizeLimit": TMP_SIZE}}]
    mounts = weights["mounts"] + [{"name": "dshm", "mountPath": "/dev/shm"}] + scratch
    if checkpoint:
        volumes.append({"name": "checkpoint", "persistentVolumeClaim": {"claimName": names["checkpoint_pvc"], "readOnly": True}})
        mounts.append({"name": "checkpoint", "mountPath": CHECKPOINT_MOUNT, "readOnly": True})
        env.append({"name": "MOEPLAN_CHECKPOINT", "value": CHECKPOINT_MOUNT})
    scheduling = {"tolerations": tolerations(deployment)}
    if deployment.get("node_selector"):
        scheduling["nodeSelector"] = deployment["node_selector"]
    if deployment.get("image_pull_secrets"):
        scheduling["imagePullSecrets"] = [{"name": n} for n in deployment["image_pull_secrets"]]
    if not scheduling["tolerations"]:
        del scheduling["tolerations"]
    capacity = plan.communication.capacity or {}
    launch = ["bash", "/bundle/launch.sh"]
    scrape = {"prometheus.io/scrape": "true", "prometheus.io/port": str(SERVE_PORT), "prometheus.io/path": METRICS_PATH}
    head = {"name": names["head"], "head": True, "replicas": 1, "selector": {**selector, "moeplan.io/role": "head"},
            "resources": resources(node_mib[0]), "command": launch, "pod_annotations": {**annotations, **scrape}}
    workers = {"name": names["workers"], "head": False, "replicas": nodes - 1,
               "selector": {**selector, "moeplan.io/role": "worker"},
               "resources": resources(max(node_mib[1:], default=node_mib[0])), "pod_annotations": annotations,
               # NODE_RANK = pod index + 1: the shell does the sum, then becomes launch.sh (signals reach its trap)
               "command": ["sh", "-c", 'export NODE_RANK=$((POD_INDEX + 1)); exec bash /bundle/launch.sh "$@"', "launch.sh"]}
    for role in (head, workers):
        role["pod_labels"] = {**labels, **role["selector"]}
    return {
        "slug": name, "names": names, "labels": labels, "selector": selector, "pod_labels": {**labels, **selector},
        "annotations": annotations, "model_name_json": to_yaml(str(plan.model["name"])), "plan_version": plan.version,
        "batch_job": batch_job, "cpu_only": cpu_only, "nodes": nodes, "gpus_per_node": gpn, "world_size": nodes * gpn,
        "image": image, "base_image": BASE_IMAGE, "torch_index": CPU_TORCH_INDEX if cpu_only else None,
        "weights": mode, "weights_from": source, "claim": weights["claim"], "claim_templates": weights["claim_templates"],
        "storage_class": deployment.get("storage_class"), "storage_request": f"{storage_gib}Gi",
        "access_mode": deployment.get("access_mode"), "volumes": volumes, "mounts": mounts, "init_containers": init,
        "env": env, "security": security, "pod_security": pod_security, "user_id": USER_ID, "scheduling": scheduling,
        "image_pull_secrets": deployment.get("image_pull_secrets") or [], "plan_sha256": plan_sha256,
        "resources": resources(max(node_mib)), "node_mib": node_mib, "head": head, "workers": workers,
        "host_mib": [int(math.ceil(b / pod_memory.MIB)) for b in host_bytes], "rank_overhead_mib": pod_memory.RANK_OVERHEAD_MIB,
        "front_overhead_mib": pod_memory.FRONT_OVERHEAD_MIB, "agent_mib": pod_memory.AGENT_MIB,
        "master_port": MASTER_PORT, "serve_port": SERVE_PORT, "metrics_path": METRICS_PATH, "scrape": scrape,
        "master_addr": f"{names['job'] if batch_job else names['head']}-0.{names['service']}",
        "launch_args": ["--prompts", "/work/prompts.txt", "--new-tokens", "16", "--out", "/results"],
        "serve_args": ["--serve", "--host", "0.0.0.0", "--port", str(SERVE_PORT)],
        "probes": {"startup": (STARTUP_PERIOD_S, STARTUP_FAILURES), "liveness": (LIVENESS_PERIOD_S, LIVENESS_FAILURES),
                   "readiness": (READINESS_PERIOD_S, READINESS_FAILURES)}, "probe_timeout_s": PROBE_TIMEOUT_S,
        "grace_seconds": GRACE_SECONDS, "capacity": capacity, "min_kubernetes": MIN_KUBERNETES_VERSION.rsplit(".", 1)[0],
        "checkpoint": checkpoint, "checkpoint_mount": CHECKPOINT_MOUNT, "volume_mount": VOLUME_MOUNT,
        "expert_cache": bool(plan.communication.expert_cache), "bundle_size": _size(bundle_bytes),
    }


def write_manifests(bundle: Path, plan) -> list:
    """Write kubernetes/ (manifests, Dockerfile, README and, where kubernetes/ is the image's build
    context, its requirements.txt) into a written torchrun bundle; returns paths."""
    bundle = Path(bundle)
    env = template_env("kubernetes")
    ctx = context(bundle, plan)
    out = bundle / "kubernetes"
    out.mkdir(parents=True, exist_ok=True)
    roles = {"statefulset.yaml": ("statefulset.yaml", {"role": ctx["head"]}),
             WORKERS_FILE: ("statefulset.yaml", {"role": ctx["workers"]})}  # one template, two roles
    written = []
    for name in manifest_files(ctx["nodes"], ctx["batch_job"], ctx["weights"]) + ("Dockerfile", "README.md"):
        template, extra = roles.get(name, (name, {}))
        path = out / name
        path.write_text(env.get_template(f"{template}.j2").render(**ctx, **extra))
        written.append(path)
    if ctx["weights"] != "image":  # kubernetes/ is the build context: it holds the bundle's own pins
        written.append(out / "requirements.txt")
        written[-1].write_bytes((bundle / "requirements.txt").read_bytes())
    for path in written:
        os.chmod(path, 0o644)
    return written


def write_bundle(out, plan, weights, model_files: dict, checkpoint: dict | None = None) -> dict:
    """The torchrun bundle (`backends/torchrun/codegen.py`, same arguments) plus kubernetes/, written
    atomically at `out` with one manifest over both; returns the manifest. The plan's deployment
    holds the image, the weights' source and the scheduling (`deployment.py`)."""
    plan = torchrun.bundle_plan(plan, model_files, checkpoint)
    with atomic_path(Path(out), kind="bundle") as tmp:
        torchrun.write_files(tmp, plan, weights, model_files["files"])
        write_manifests(tmp, plan)
        return finish_bundle(tmp)  # modes fixed: the pods' user (USER_ID) reads the image's, volume's or tar's copy
