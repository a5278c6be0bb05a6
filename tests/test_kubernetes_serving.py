"""`moeplan compile --target kubernetes` (issue 29 item 5): by default a long-running service.

Compile-only checks of the manifests (strict schemas, probes, selectors, disruption budget, memory,
the image, the README's instructions), and one run of the head pod's own container command on this
machine, whose `/health` (the probes' path and port) must answer 200 and which must drain on SIGTERM.
"""
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from click.testing import CliRunner

from moeplan.backends.kubernetes import pod_memory
from moeplan.backends.kubernetes.codegen import KUBERNETES_VERSION, METRICS_PATH, MIN_KUBERNETES_VERSION, SERVE_PORT
from moeplan.passes.analysis.trace.format import save_trace
from moeplan.planner.commands.compile import compile_cmd
from runtime_fixtures import SMALL, random_trace, small_model_dir
from serving_helpers import ServerProcess, raw

MIB = 1 << 20
CPU = ("--cpu-only", "--image", "registry.example/moe:1")  # CPU pods: their commands run on this machine


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    root = tmp_path_factory.mktemp("k8s-serve")
    save_trace(random_trace(300, SMALL["num_layers"], SMALL["num_experts"]), root / "trace.npz")
    return small_model_dir(root / "model"), root / "trace.npz"


def compile_bundle(model, out: Path, nodes: int, gpus: int, *extra) -> dict:
    """{file name: [documents]} of kubernetes/*.yaml after compiling `model` at `out`."""
    directory, trace = model
    result = CliRunner().invoke(compile_cmd, [str(directory), "--trace", str(trace), "--target", "kubernetes", "--nodes",
                                              str(nodes), "--gpus-per-node", str(gpus), "--policy", "contiguous", "--out",
                                              str(out), "--quiet", *extra, *(() if "--hardware" in extra else CPU)])
    assert result.exit_code == 0, result.output
    return {p.name: list(yaml.safe_load_all(p.read_text())) for p in sorted((out / "kubernetes").glob("*.yaml"))}


@pytest.fixture(scope="module")
def two_nodes(model, tmp_path_factory):
    out = tmp_path_factory.mktemp("two") / "b"
    return out, compile_bundle(model, out, 2, 2)


def one(docs: dict, kind: str, role: str | None = None) -> dict:
    found = [d for items in docs.values() for d in items if d["kind"] == kind
             and (role is None or d["spec"].get("selector", {}).get("matchLabels", {}).get("moeplan.io/role") == role)]
    assert len(found) == 1, (kind, role, [d["metadata"]["name"] for d in found])
    return found[0]


def selects(selector: dict, labels: dict) -> bool:
    return selector.items() <= labels.items()


def test_the_service_manifests_validate_strict(two_nodes):
    _, docs = two_nodes
    kinds = []
    for name, items in docs.items():
        assert len(items) == 1, name
        for version in (MIN_KUBERNETES_VERSION, KUBERNETES_VERSION):
            kubernetes_validate.validate(items[0], version, strict=True)
        kinds.append(items[0]["kind"])
    # --weights-from image (the default): no claim, and no ConfigMap (the bundle in the image holds the plan)
    assert sorted(kinds) == ["PodDisruptionBudget", "Service", "Service", "StatefulSet", "StatefulSet"]
    assert "job.yaml" not in docs


def test_probes_ask_health_on_the_port_rank_0_serves(two_nodes):
    _, docs = two_nodes
    head = one(docs, "StatefulSet", "head")
    container = head["spec"]["template"]["spec"]["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    args = container["args"]
    assert container["command"] == ["bash", "/bundle/launch.sh"] and args[0] == "--serve"
    served = int(args[args.index("--port") + 1])
    assert served == ports["http"] == SERVE_PORT and args[args.index("--host") + 1] == "0.0.0.0"
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        get = container[kind]["httpGet"]
        assert get["path"] == "/health" and ports[get["port"]] == served, kind
    # the startup probe outlasts loading; liveness does not fire before the service's own exit (30 s)
    startup, live = container["startupProbe"], container["livenessProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600
    assert live["periodSeconds"] * live["failureThreshold"] > 30
    worker = one(docs, "StatefulSet", "worker")["spec"]["template"]["spec"]["containers"][0]
    assert not {"ports", "startupProbe", "readinessProbe", "livenessProbe"} & set(worker)  # workers serve no HTTP
    assert "prometheus.io/scrape" not in one(docs, "StatefulSet", "worker")["spec"]["template"]["metadata"]["annotations"]
    assert worker["args"] == args


def test_the_cluster_ip_service_selects_rank_0_only(two_nodes):
    _, docs = two_nodes
    api = docs["api-service.yaml"][0]
    head, workers = one(docs, "StatefulSet", "head"), one(docs, "StatefulSet", "worker")
    assert api["spec"]["type"] == "ClusterIP" and api["spec"]["ports"][0]["port"] == SERVE_PORT
    assert api["spec"]["ports"][0]["targetPort"] == "http"
    assert selects(api["spec"]["selector"], head["spec"]["template"]["metadata"]["labels"])
    assert not selects(api["spec"]["selector"], workers["spec"]["template"]["metadata"]["labels"])
    assert head["spec"]["replicas"] == 1 and workers["spec"]["replicas"] == 1
    env = {e["name"]: e for e in head["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["NODE_RANK"]["value"] == "0"
    # the headless Service covers every pod, ready or not (node 0 is ready only after the rendezvous)
    headless = docs["service.yaml"][0]["spec"]
    assert headless["clusterIP"] == "None" and headless["publishNotReadyAddresses"] is True
    for s in (head, workers):
        assert s["spec"]["serviceName"] == docs["service.yaml"][0]["metadata"]["name"]
        assert selects(headless["selector"], s["spec"]["template"]["metadata"]["labels"])
        assert selects(s["spec"]["selector"]["matchLabels"], s["spec"]["template"]["metadata"]["labels"])
    assert env["MASTER_ADDR"]["value"] == f"{head['metadata']['name']}-0.{docs['service.yaml'][0]['metadata']['name']}"


def test_worker_pods_take_node_ranks_1_to_n_1(tmp_path, two_nodes):
    """The worker container's own shell command, with launch.sh replaced by a script printing NODE_RANK."""
    _, docs = two_nodes
    container = one(docs, "StatefulSet", "worker")["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e for e in container["env"]}
    assert env["POD_INDEX"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.labels['apps.kubernetes.io/pod-index']"
    probe = tmp_path / "launch.sh"
    probe.write_text('echo "$NODE_RANK $*"\n')
    command = [c.replace("/bundle/launch.sh", str(probe)) for c in container["command"]]
    for index in (0, 1, 5):
        out = subprocess.run(command + container["args"], env={"PATH": os.environ["PATH"], "POD_INDEX": str(index)},
                             capture_output=True, text=True, check=True).stdout
        assert out.split() == [str(index + 1), *container["args"]]


def test_the_disruption_budget_keeps_every_pod(two_nodes):
    _, docs = two_nodes
    pdb = docs["pdb.yaml"][0]["spec"]
    assert pdb["minAvailable"] == 2 and pdb["unhealthyPodEvictionPolicy"] == "AlwaysAllow"
    for role in ("head", "worker"):
        assert selects(pdb["selector"]["matchLabels"], one(docs, "StatefulSet", role)["spec"]["template"]["metadata"]["labels"])


def _tensor_bytes(path: Path) -> tuple:
    """(stored bytes, float32 bytes) of a shard, read with the safetensors library itself."""
    from safetensors import safe_open

    stored = float32 = 0
    with safe_open(str(path), "pt") as f:
        for key in f.keys():
            t = f.get_tensor(key)
            stored += t.numel() * t.element_size()
            float32 += t.numel() * 4
    return stored, float32


def test_pod_memory_covers_each_ranks_weights_twice_over_and_the_measured_overheads(two_nodes):
    out, docs = two_nodes
    plan = json.loads((out / "plan.json").read_text())
    weights = [sum(_tensor_bytes(out / s)) for s in plan["shards"]]
    for role, node, front in (("head", 0, pod_memory.FRONT_OVERHEAD_MIB), ("worker", 1, 0)):
        container = one(docs, "StatefulSet", role)["spec"]["template"]["spec"]["containers"][0]
        requests = container["resources"]["requests"]
        assert requests == container["resources"]["limits"]  # Guaranteed: the request is what the pod may use
        mib = int(requests["memory"].removesuffix("Mi"))
        floor = sum(weights[2 * node:2 * node + 2]) + (2 * pod_memory.RANK_OVERHEAD_MIB + pod_memory.AGENT_MIB + front) * MIB
        assert floor <= mib * MIB < floor + MIB
    # the overheads cover the measured ones recorded in docs/serving.md (benchmarks/rank_memory.py)
    doc = (Path(__file__).resolve().parents[1] / "docs" / "serving.md").read_text()
    measured = {k: float(v) for k, v in re.findall(r"measured (rank|front|agent) overhead: ([0-9.]+) MiB", doc)}
    assert measured.keys() == {"rank", "front", "agent"}
    assert pod_memory.RANK_OVERHEAD_MIB >= measured["rank"] and pod_memory.FRONT_OVERHEAD_MIB >= measured["front"]
    assert pod_memory.AGENT_MIB >= measured["agent"]


def _instructions(dockerfile: Path) -> dict:
    """{instruction: [its arguments, in order]} of a Dockerfile (no line continuations in ours)."""
    by_kind = {}
    for line in dockerfile.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            kind, rest = line.split(None, 1)
            by_kind.setdefault(kind, []).append(rest)
    return by_kind


def _hadolint(dockerfile: Path) -> None:
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    lint = subprocess.run([hadolint, "--no-color", str(dockerfile)], capture_output=True, text=True)
    assert lint.returncode == 0, lint.stdout + lint.stderr


def test_the_image_installs_exactly_the_bundles_pinned_requirements(two_nodes, model, tmp_path):
    out, _ = two_nodes
    pins = (out / "requirements.txt").read_text()
    import torch

    lines = pins.split()
    assert f"torch=={torch.__version__.split('+')[0]}" in lines and all("==" in line for line in lines)
    # --weights-from image: the build context is the bundle, so it copies the bundle's own requirements.txt
    by_kind = _instructions(out / "kubernetes" / "Dockerfile")
    assert by_kind["FROM"] == ["python:3.11-slim-bookworm"] and "torch" not in by_kind["FROM"][0]
    assert by_kind["COPY"] == ["requirements.txt /opt/moeplan/requirements.txt", ". /bundle"]
    installs = [r for r in by_kind["RUN"] if "pip" in r]
    # that file, and nothing else; --cpu-only pods take torch's CPU wheel of the same version
    assert installs == ["pip install --no-cache-dir --extra-index-url https://download.pytorch.org/whl/cpu "
                        "-r /opt/moeplan/requirements.txt"]
    # and a C++ compiler for the compiled decode step of a CPU rank (docs/serving.md), pinned to the base's release
    assert [r for r in by_kind["RUN"] if "pip" not in r] == [
        "apt-get update && apt-get install -y --no-install-recommends g++=4:12.2.0-3 && rm -rf /var/lib/apt/lists/*"]
    assert by_kind["USER"] == ["10001:10001"] and not (out / "kubernetes" / "requirements.txt").exists()
    assert "kubernetes/Dockerfile" in json.loads((out / "manifest.json").read_text())["files"]
    _hadolint(out / "kubernetes" / "Dockerfile")
    # a GPU image fetching its weights: kubernetes/ is the context, with a copy of the pins; torch from PyPI (CUDA)
    gpu = tmp_path / "gpu"
    compile_bundle(model, gpu, 1, 1, "--hardware", "h100-sxm", "--image", "registry.example/moe:1",
                   "--weights-from", "https://models.example/b.tar")
    assert (gpu / "kubernetes" / "requirements.txt").read_text() == pins
    by_kind = _instructions(gpu / "kubernetes" / "Dockerfile")
    assert by_kind["COPY"] == ["requirements.txt /opt/moeplan/requirements.txt"]  # no weights in this image
    assert by_kind["RUN"] == ["pip install --no-cache-dir -r /opt/moeplan/requirements.txt"]  # GPU ranks: no g++
    assert "kubernetes/requirements.txt" in json.loads((gpu / "manifest.json").read_text())["files"]
    _hadolint(gpu / "kubernetes" / "Dockerfile")


def test_the_readme_instructions_name_the_real_objects(two_nodes):
    out, docs = two_nodes
    readme = (out / "kubernetes" / "README.md").read_text()
    rows = re.findall(r"^\| `([^`]+)` \| (.+?) `([^`]+)`.* \|", readme, flags=re.M)
    kinds = {"PersistentVolumeClaim": "PersistentVolumeClaim", "headless Service": "Service",
             "ClusterIP Service": "Service", "StatefulSet": "StatefulSet", "PodDisruptionBudget": "PodDisruptionBudget"}
    assert {f for f, _, _ in rows} == set(docs)  # every manifest, and only those, is listed
    for file, kind, name in rows:
        doc = docs[file][0]
        assert (doc["kind"], doc["metadata"]["name"]) == (kinds[kind], name), file
    head = one(docs, "StatefulSet", "head")
    api = docs["api-service.yaml"][0]
    assert f"kubectl rollout status statefulset/{head['metadata']['name']}" in readme
    port = api["spec"]["ports"][0]["port"]
    assert f"kubectl port-forward service/{api['metadata']['name']} {port}:{port}" in readme
    assert f"http://{api['metadata']['name']}:{port}/v1" in readme
    env = {e["name"]: e for e in head["spec"]["template"]["spec"]["containers"][0]["env"]}
    secret = env["MOEPLAN_API_KEY"]["valueFrom"]["secretKeyRef"]
    assert f"kubectl create secret generic {secret['name']} --from-literal={secret['key']}=KEY" in readme
    # the image the manifests name is the one the README builds and pushes; no step edits a file
    image = head["spec"]["template"]["spec"]["containers"][0]["image"]
    assert f"docker build -f kubernetes/Dockerfile -t {image} .\ndocker push {image}\n" in readme
    assert "edit" not in readme.lower().replace("never edited", "").replace("is ever edited", "")
    assert "Kubernetes 1.28 or later" in readme
    # the memory figures it states are the pods'
    stated = [int(m) for m in re.search(r"([0-9 /]+) MiB for nodes", readme).group(1).split("/")]
    memory = lambda role: int(one(docs, "StatefulSet", role)["spec"]["template"]["spec"]["containers"][0]["resources"]
                              ["requests"]["memory"].removesuffix("Mi"))
    assert memory("head") == stated[0] and memory("worker") == max(stated[1:])


def test_the_batch_job_flag_gives_the_indexed_job_and_is_recorded(model, tmp_path):
    docs = compile_bundle(model, tmp_path / "job", 2, 2, "--batch-job")
    assert set(docs) == {"service.yaml", "job.yaml"}
    job = docs["job.yaml"][0]
    assert job["kind"] == "Job" and job["spec"]["completionMode"] == "Indexed" and job["spec"]["completions"] == 2
    container = job["spec"]["template"]["spec"]["containers"][0]
    assert "--serve" not in container["args"] and "--prompts" in container["args"]
    assert {"name": "prompts", "configMap": {"name": f"{job['metadata']['name']}-prompts"}} in \
        job["spec"]["template"]["spec"]["volumes"]
    assert json.loads((tmp_path / "job" / "plan.json").read_text())["deployment"]["batch_job"] is True
    from moeplan.planner.cli import main  # the recorded choice: plan.json alone writes the same Job

    result = CliRunner().invoke(main, ["codegen", str(tmp_path / "job" / "plan.json"), "--out", str(tmp_path / "again")])
    assert result.exit_code == 0, result.output
    files = lambda root: {p.name: p.read_bytes() for p in sorted((root / "kubernetes").iterdir())}
    assert files(tmp_path / "again") == files(tmp_path / "job")
    compile_bundle(model, tmp_path / "svc", 1, 1)
    assert "batch_job" not in json.loads((tmp_path / "svc" / "plan.json").read_text())["deployment"]


def test_the_head_pods_command_serves_health_on_the_probed_port_and_drains(model, tmp_path):
    """The head container's command and args, run here (1 node x 1 rank): GET the startup probe's
    path on its port once the service is up and the path the Prometheus annotations name, then
    SIGTERM (what the kubelet sends) exits 0."""
    out = tmp_path / "b"
    docs = compile_bundle(model, out, 1, 1)
    container = docs["statefulset.yaml"][0]["spec"]["template"]["spec"]["containers"][0]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        http = s.getsockname()[1]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        rendezvous = s.getsockname()[1]
    args = [{"0.0.0.0": "127.0.0.1", str(SERVE_PORT): str(http)}.get(a, a) for a in container["args"]]
    command = [c.replace("/bundle", str(out)) for c in container["command"]]
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(rendezvous), PATH=f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}")
    env.pop("PYTHONPATH", None)
    server = ServerProcess(command + args, env=env, ready_timeout_s=240)
    try:
        probe = container["startupProbe"]["httpGet"]
        assert probe["port"] == "http" and server.host_port[1] == http
        status, _, _ = raw(server, "GET", probe["path"])
        assert status == 200
        # Prometheus finds /metrics where the pod's scrape annotations say: the served port, no API key needed
        scrape = docs["statefulset.yaml"][0]["spec"]["template"]["metadata"]["annotations"]
        assert scrape["prometheus.io/scrape"] == "true" and scrape["prometheus.io/path"] == METRICS_PATH
        assert int(scrape["prometheus.io/port"]) == next(p["containerPort"] for p in container["ports"] if p["name"] == "http")
        status, headers, body = raw(server, "GET", scrape["prometheus.io/path"])
        assert status == 200 and headers["content-type"].startswith("text/plain") and "# TYPE moeplan_" in body
        server.signal(signal.SIGTERM)
        assert server.wait(60) == 0, server.output()
    finally:
        server.kill()
