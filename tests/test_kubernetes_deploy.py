"""`compile --target kubernetes` deployable as written (issue 40 item 1): the choices are flags, never
edits of hashed files; the bundle README's own commands are run here where they can be (its docker
build emulated from the Dockerfile, its tar and kubectl client commands run), then the pods' own
commands run on what they produce; the pods are non-root on a read-only root filesystem (their
writes traced), schedulable on GPU nodes, and every manifest validates strictly at 1.28 and 1.31.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import http.server
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import threading
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from click.testing import CliRunner

from moeplan.backends.kubernetes.codegen import KUBERNETES_VERSION, MIN_KUBERNETES_VERSION, SERVE_PORT, USER_ID
from moeplan.passes.analysis.trace.format import save_trace
from moeplan.planner.cli import main
from runtime_fixtures import SMALL, random_trace, small_model_dir
from serving_helpers import ServerProcess, raw

IMAGE = "registry.example.com/team/moe:1"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    root = tmp_path_factory.mktemp("k8s-deploy")
    save_trace(random_trace(300, SMALL["num_layers"], SMALL["num_experts"]), root / "trace.npz")
    return small_model_dir(root / "model"), root / "trace.npz"


def run_compile(model, out: Path, *flags, nodes: int = 1, gpus: int = 1):
    directory, trace = model
    return CliRunner().invoke(main, ["compile", str(directory), "--trace", str(trace), "--target", "kubernetes",
                                     "--nodes", str(nodes), "--gpus-per-node", str(gpus), "--policy", "contiguous",
                                     "--out", str(out), "--quiet", *flags])


def compiled(model, out: Path, *flags, nodes: int = 1, gpus: int = 1) -> dict:
    """{file name: document} of kubernetes/*.yaml, each validated strictly at the oldest and a current version."""
    result = run_compile(model, out, *flags, nodes=nodes, gpus=gpus)
    assert result.exit_code == 0, result.output
    docs = {}
    for path in sorted((out / "kubernetes").glob("*.yaml")):
        (doc,) = yaml.safe_load_all(path.read_text())
        for version in (MIN_KUBERNETES_VERSION, KUBERNETES_VERSION):
            kubernetes_validate.validate(doc, version, strict=True)
        docs[path.name] = doc
    return docs


def pod_specs(docs: dict) -> list:
    return [d["spec"]["template"]["spec"] for d in docs.values() if d["kind"] in ("StatefulSet", "Job")]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def readme_blocks(bundle: Path) -> list:
    """The ```sh blocks of kubernetes/README.md's Steps, in order: what a user copies."""
    steps = (bundle / "kubernetes" / "README.md").read_text().split("## Steps\n", 1)[1]
    return re.findall(r"```sh\n(.*?)```", steps, flags=re.S)


def emulate_docker_build(line: str, cwd: Path, root: Path) -> dict:
    """What `docker build -f F -t T CONTEXT` (run in `cwd`) puts in the image's filesystem under `root`:
    its COPY instructions carried out (the pip install is this Python's environment, which holds the
    same pins); returns {"tag", "env", "user"}."""
    args = shlex.split(line)
    assert args[:2] == ["docker", "build"], line
    opts = dict(zip(args[2:-1:2], args[3:-1:2]))
    context = cwd / args[-1]
    dockerfile = cwd / opts.get("-f", str(Path(args[-1]) / "Dockerfile"))
    env, user = {}, None
    for instruction in dockerfile.read_text().splitlines():
        if not instruction.strip() or instruction.startswith("#"):
            continue
        kind, rest = instruction.split(None, 1)
        if kind == "COPY":
            source, target = rest.split()
            destination = root / target.lstrip("/")
            if (context / source).is_dir():
                shutil.copytree(context / source, destination)
            else:
                destination.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(context / source, destination)
        elif kind == "ENV":
            env.update(item.split("=", 1) for item in rest.split())
        elif kind == "USER":
            user = rest
    return {"tag": opts["-t"], "env": env, "user": user}


def writes_outside(trace: Path, allowed: tuple) -> list:
    """The calls of an `strace -f -y` log that wrote outside `allowed` and succeeded: opened a file for
    writing, created, renamed or removed one. On a read-only root filesystem each of those would have
    failed (a failed call here fails there too, so it changes nothing). `-y` prints the directory of
    a descriptor-relative call, `AT_FDCWD</cwd>` or `3</dir>`, so relative paths resolve."""
    bad = []
    for line in trace.read_text().splitlines():
        call = re.match(r"\d+\s+(\w+)\((.*)\)\s+=\s+(-?\d+)", line)
        if call is None or call.group(3).startswith("-"):
            continue
        name, args, _ = call.groups()
        if name.startswith("open") and not re.search(r"O_WRONLY|O_RDWR|O_CREAT|O_TRUNC", args):
            continue
        where = re.match(r'(?:(?:AT_FDCWD|\d+)(?:<([^>]*)>)?, )?"([^"]*)"', args)
        if where is None:
            bad.append(line)
            continue
        base, path = where.groups()
        path = path if path.startswith("/") else f"{base}/{path}"
        if not path.startswith(allowed):
            bad.append(line)
    return bad


REFUSALS = [
    ((), "--target kubernetes needs --hardware NAME, the GPU its pods run on"),
    (("--hardware", "h100-sxm", "--cpu-only"), "--cpu-only pods run on CPUs, but --hardware h100-sxm is a GPU profile"),
    (("--hardware", "cpu-gloo"), "--hardware cpu-gloo prices ranks on CPUs, but without --cpu-only the pods request GPUs"),
    (("--cpu-only", "--image", None), "--target kubernetes needs --image REGISTRY/NAME:TAG"),
    (("--cpu-only", "--weights-from", "s3://models/b.tar"), "aws s3 presign s3://models/b.tar"),
    (("--cpu-only", "--storage-class", "gp3"), "--weights-from image (the default) puts the bundle in the image"),
    (("--cpu-only", "--weights-from", "volume"), "--weights-from volume needs --storage-class"),
    (("--cpu-only", "--weights-from", "volume", "--storage-class", "gp3", "--access-mode", "ReadWriteOnce", "--nodes", "2"),
     "the one shared volume of --weights-from volume is mounted on all 2 nodes"),
    (("--cpu-only", "--weights-from", "https://h.example/b.tar", "--access-mode", "ReadOnlyMany"),
     "each pod's init container writes the bundle onto its own volume"),
    (("--cpu-only", "--toleration", "gpu:Sometimes"), "--toleration entry 'gpu:Sometimes': effect 'Sometimes' is not one of"),
    (("--cpu-only", "--node-selector", "pool"), "--node-selector entry 'pool' is not KEY=VALUE"),
]


@pytest.mark.parametrize("flags, message", REFUSALS)
def test_a_missing_or_contradictory_choice_is_one_line_and_writes_nothing(model, tmp_path, flags, message):
    flags = list(flags)
    if None in flags:
        del flags[flags.index(None) - 1:flags.index(None) + 1]  # no --image at all
    elif "--image" not in flags:
        flags += ["--image", IMAGE]
    nodes = "2" if "--nodes" in flags else "1"
    if "--nodes" in flags:
        del flags[flags.index("--nodes"):flags.index("--nodes") + 2]
    result = run_compile(model, tmp_path / "out", *flags, nodes=int(nodes))
    lines = result.output.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1 and message in lines[0], result.output
    assert not (tmp_path / "out").exists()


def test_gpu_pods_are_priced_on_the_gpu_they_request_and_cpu_pods_on_a_cpu(model, tmp_path):
    gpu = compiled(model, tmp_path / "gpu", "--hardware", "h100-sxm", "--image", IMAGE, nodes=2, gpus=2)
    plan = json.loads((tmp_path / "gpu" / "plan.json").read_text())
    assert plan["predicted"]["cost"]["hardware"] == "h100-sxm"
    assert plan["communication"]["capacity"]["device_memory_source"] == "hardware profile h100-sxm"
    for spec in pod_specs(gpu):
        assert spec["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "2"
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    readme = (tmp_path / "gpu" / "kubernetes" / "README.md").read_text()
    assert "GiB of device memory per GPU (hardware profile h100-sxm)" in readme and "cpu-gloo" not in readme
    assert "download.pytorch.org" not in (tmp_path / "gpu" / "kubernetes" / "Dockerfile").read_text()  # CUDA wheels
    cpu = compiled(model, tmp_path / "cpu", "--cpu-only", "--image", IMAGE, nodes=2, gpus=2)
    plan = json.loads((tmp_path / "cpu" / "plan.json").read_text())
    assert plan["predicted"]["cost"]["hardware"] == "cpu-gloo" and plan["deployment"]["cpu_only"] is True
    assert not any("nvidia.com/gpu" in json.dumps(doc) for doc in cpu.values())
    assert "Each pod requests no GPU" in (tmp_path / "cpu" / "kubernetes" / "README.md").read_text()


def test_scheduling_flags_reach_every_pod_and_are_recorded(model, tmp_path):
    out = tmp_path / "b"
    docs = compiled(model, out, "--hardware", "h100-sxm", "--image", IMAGE, "--node-selector",
                    "nvidia.com/gpu.product=NVIDIA-H100-80GB-HBM3,pool=inference", "--toleration",
                    "dedicated=moe:NoSchedule,spot", "--image-pull-secret", "regcred", nodes=2)
    for spec in pod_specs(docs):
        assert spec["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3", "pool": "inference"}
        assert spec["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
                                       {"key": "dedicated", "operator": "Equal", "value": "moe", "effect": "NoSchedule"},
                                       {"key": "spot", "operator": "Exists"}]
        assert spec["imagePullSecrets"] == [{"name": "regcred"}]
    assert json.loads((out / "plan.json").read_text())["deployment"]["image_pull_secrets"] == ["regcred"]
    result = CliRunner().invoke(main, ["codegen", str(out / "plan.json"), "--out", str(tmp_path / "again")])
    assert result.exit_code == 0, result.output  # plan.json alone writes the same manifests
    files = lambda root: {p.name: p.read_bytes() for p in sorted((root / "kubernetes").iterdir())}
    assert files(tmp_path / "again") == files(out)


@pytest.mark.parametrize("flags", [(), ("--weights-from", "https://h.example/b.tar", "--batch-job"),
                                   ("--weights-from", "volume", "--storage-class", "efs")])
def test_every_container_runs_as_the_images_user_on_a_read_only_root(model, tmp_path, flags):
    docs = compiled(model, tmp_path / "b", "--cpu-only", "--image", IMAGE, *flags, nodes=2)
    dockerfile = (tmp_path / "b" / "kubernetes" / "Dockerfile").read_text()
    assert f"\nUSER {USER_ID}:{USER_ID}\n" in dockerfile
    for spec in pod_specs(docs):
        assert spec["securityContext"]["runAsNonRoot"] is True and spec["securityContext"]["runAsUser"] == USER_ID
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert volumes["tmp"] == {"name": "tmp", "emptyDir": {"sizeLimit": "1Gi"}}
        for container in spec["containers"] + spec.get("initContainers", []):
            assert container["securityContext"] == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                                    "capabilities": {"drop": ["ALL"]}}
            assert {"name": "tmp", "mountPath": "/tmp"} in container["volumeMounts"]
            assert {"name": "HOME", "value": "/tmp"} in container["env"]
            assert container["resources"]["requests"] == container["resources"]["limits"]  # Guaranteed, init too


def test_following_the_image_readme_gives_a_pod_that_serves_and_writes_only_its_empty_dirs(model, tmp_path):
    """README step 1 (docker build, emulated from the Dockerfile; push), then the head pod's own command in
    that image's filesystem, traced: /health and /metrics answer, every write lands in /tmp or /dev/shm
    (the pod's emptyDirs), SIGTERM drains to exit 0. An image built from another bundle is refused."""
    if shutil.which("strace") is None:
        pytest.skip("strace is not installed")
    bundle = tmp_path / "bundle"
    docs = compiled(model, bundle, "--cpu-only", "--image", IMAGE)
    build, = readme_blocks(bundle)[:1]
    lines = build.strip().splitlines()
    root = tmp_path / "image"
    built = emulate_docker_build(lines[0], bundle, root)
    assert built["tag"] == IMAGE and lines[1] == f"docker push {IMAGE}"
    assert built["user"] == f"{USER_ID}:{USER_ID}" and built["env"]["HOME"] == "/tmp"
    pod = docs["statefulset.yaml"]["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["image"] == built["tag"]
    subprocess.run(["chmod", "-R", "a-w", str(root / "bundle")], check=True)
    scratch = tmp_path / "tmp"  # the pod's /tmp emptyDir
    scratch.mkdir()
    http_port, rendezvous = free_port(), free_port()
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    assert env["HOME"] == "/tmp"
    env.update(built["env"], HOME=str(scratch), TMPDIR=str(scratch), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(rendezvous),
               PATH=f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}")
    env.pop("PYTHONPATH", None)
    command = [c.replace("/bundle", str(root / "bundle")) for c in container["command"]]
    args = [{"0.0.0.0": "127.0.0.1", str(SERVE_PORT): str(http_port)}.get(a, a) for a in container["args"]]
    trace = tmp_path / "writes.txt"
    traced = ["strace", "-f", "-qq", "-y", "--seccomp-bpf", "-o", str(trace), "-e",
              "trace=open,openat,creat,mkdir,mkdirat,rename,renameat,renameat2,unlink,unlinkat,rmdir,link,symlink"]
    server = ServerProcess(traced + ["--"] + command + args, cwd=root, env=env, ready_timeout_s=240)
    try:
        assert raw(server, "GET", "/health")[0] == 200
        scrape = docs["statefulset.yaml"]["spec"]["template"]["metadata"]["annotations"]
        assert raw(server, "GET", scrape["prometheus.io/path"])[0] == 200
        launch = int(Path(f"/proc/{server.proc.pid}/task/{server.proc.pid}/children").read_text().split()[0])
        os.kill(launch, 15)  # what the kubelet sends to the container's first process
        assert server.wait(90) == 0, server.output()
    finally:
        server.kill()
    outside = writes_outside(trace, (str(scratch) + "/", "/dev/", "/proc/"))
    assert not outside, "\n".join(outside[:20])
    assert writes_outside(trace, ("/dev/", "/proc/"))  # the log does hold the writes to /tmp: the check sees them
    # the same image name over another bundle: launch.sh refuses before anything runs
    wrong = dict(env, MOEPLAN_PLAN_SHA256="0" * 64)
    proc = subprocess.run(command + args, env=dict(os.environ, **wrong), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "is not the plan this deployment was written for" in proc.stderr


def test_the_bundle_is_readable_by_the_pods_user_whatever_the_umask(model, tmp_path):
    """The image copies the bundle as it is on disk, and the pods run as user 10001, not its owner."""
    previous = os.umask(0o077)
    try:
        result = run_compile(model, tmp_path / "b", "--cpu-only", "--image", IMAGE)
    finally:
        os.umask(previous)
    assert result.exit_code == 0, result.output
    for path in [tmp_path / "b", *(tmp_path / "b").rglob("*")]:
        need = 0o755 if path.is_dir() else 0o644
        assert path.stat().st_mode & need == need, (path, oct(path.stat().st_mode))


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@contextlib.contextmanager
def serving(directory: Path, port: int):
    """A plain HTTP server of `directory` on `port` (what the --weights-from URL stands for)."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), functools.partial(_Quiet, directory=str(directory)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield
    finally:
        server.shutdown()
        server.server_close()


def test_following_the_url_readme_fetches_the_bundle_once_and_runs_the_batch_job(model, tmp_path):
    """--weights-from URL with --batch-job: README's docker build (context kubernetes/), its tar, a
    server answering at the URL, its prompts ConfigMap (kubectl's client), then the pod's init
    containers and ranks in order; a second fetch downloads nothing; a tar of another plan is refused."""
    port = free_port()
    url = f"http://127.0.0.1:{port}/bundle.tar"
    bundle = tmp_path / "bundle"
    docs = compiled(model, bundle, "--cpu-only", "--image", IMAGE, "--weights-from", url, "--batch-job")
    build, upload, apply = readme_blocks(bundle)
    built = emulate_docker_build(build.splitlines()[0], bundle, tmp_path / "image")
    assert built["tag"] == IMAGE and not (tmp_path / "image" / "bundle").exists()  # no weights in this image
    subprocess.run(["bash", "-euo", "pipefail", "-c", upload], cwd=bundle, check=True)  # tar -cf ../bundle.tar .
    pod = docs["job.yaml"]["spec"]["template"]["spec"]
    claim = {v["name"]: v for v in pod["volumes"]}["bundle"]["ephemeral"]["volumeClaimTemplate"]["spec"]
    assert claim["accessModes"] == ["ReadWriteOnce"] and "storageClassName" not in claim  # the default class
    volume, work, results, config, scratch = (tmp_path / n for n in ("volume", "work", "results", "config", "tmp"))
    for d in (volume, work, results, config, scratch):
        d.mkdir()
    # README: the prompts file, the ConfigMap the pods mount (by kubectl's own client), then apply
    commands = apply.strip().splitlines()
    assert commands[-1] == "kubectl apply -f kubernetes/"
    subprocess.run(["bash", "-euo", "pipefail", "-c", commands[0]], cwd=bundle, check=True)
    create = shlex.split(commands[1])
    assert create[:3] == ["kubectl", "create", "configmap"]
    if shutil.which("kubectl"):
        made = subprocess.run(create + ["--dry-run=client", "-o", "yaml"], cwd=bundle, capture_output=True, text=True,
                              timeout=60, check=True)
        configmap = yaml.safe_load(made.stdout)
    else:  # what `kubectl create configmap NAME --from-file=KEY=FILE` makes
        key, _, source = create[4].removeprefix("--from-file=").partition("=")
        configmap = {"metadata": {"name": create[3]}, "data": {key: (bundle / source).read_text()}}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert configmap["metadata"]["name"] == volumes["prompts"]["configMap"]["name"]
    for key, text in configmap["data"].items():
        (config / key).write_text(text)
    paths = {"/plan": config, "/work": work, "/results": results, "/data": volume, "/tmp": scratch}
    pattern = re.compile(r"(?<![\w/.-])(" + "|".join(paths) + r")(?=/|\s|$)")  # a pod path, not part of another
    local = lambda text: pattern.sub(lambda m: str(paths[m.group(1)]), text)
    stage, fetch = pod["initContainers"]
    subprocess.run([local(c) for c in stage["command"]], check=True)
    fetch_command = [sys.executable if c == "python" else c for c in fetch["command"]]
    fetch_command[-2] = str(volume)  # the claim's mount point, /data
    assert fetch_command[3] == url
    with serving(tmp_path, port):
        first = subprocess.run(fetch_command, capture_output=True, text=True, timeout=120)
    assert first.returncode == 0, first.stderr
    again = subprocess.run(fetch_command, capture_output=True, text=True, timeout=60)  # the server is gone
    assert again.returncode == 0 and "already on this volume" in again.stdout, again.stderr
    container = pod["containers"][0]
    mount = next(m for m in container["volumeMounts"] if m["name"] == "bundle")
    assert mount == {"name": "bundle", "mountPath": "/bundle", "subPath": "bundle", "readOnly": True}
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    env.update(NODE_RANK="0", HOME=str(scratch), TMPDIR=str(scratch), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               PATH=f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}")
    env.pop("PYTHONPATH", None)
    command = [c.replace("/bundle", str(volume / "bundle")) for c in container["command"]]
    args = [local(a) for a in container["args"]]
    args[args.index("--new-tokens") + 1] = "2"
    ranks = subprocess.run(command + args, env=dict(os.environ, **env), capture_output=True, text=True, timeout=240)
    assert ranks.returncode == 0, ranks.stderr[-2000:]
    mode = json.loads((bundle / "plan.json").read_text())["communication"]["mode"]
    assert len(json.loads((results / mode / "result.json").read_text())["texts"]) == 2  # the README's two prompts
    # a tar whose plan is not this one: refused in one line, and nothing is left as the bundle
    other = tmp_path / "other"
    other.mkdir()
    fetch_command[-1] = hashlib.sha256(b"another plan").hexdigest()
    fetch_command[-2] = str(other)
    with serving(tmp_path, port):
        refused = subprocess.run(fetch_command, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1
    assert "not" in refused.stderr and not (other / "bundle").exists() and not (other / "complete").exists()


def test_the_shared_volume_readme_fills_the_claim_the_pods_mount(model, tmp_path):
    bundle = tmp_path / "bundle"
    docs = compiled(model, bundle, "--cpu-only", "--image", IMAGE, "--weights-from", "volume", "--storage-class", "efs",
                    nodes=2)
    claim = docs["pvc.yaml"]
    assert claim["spec"]["storageClassName"] == "efs" and claim["spec"]["accessModes"] == ["ReadWriteMany"]
    for spec in pod_specs(docs):
        volume = {v["name"]: v for v in spec["volumes"]}["bundle"]
        assert volume["persistentVolumeClaim"] == {"claimName": claim["metadata"]["name"], "readOnly": True}
    _, upload, _ = readme_blocks(bundle)
    lines = upload.strip().splitlines()
    assert lines[0] == "kubectl apply -f kubernetes/pvc.yaml"
    overrides = json.loads(shlex.split(lines[1])[-1].removeprefix("--overrides="))
    assert overrides["spec"]["volumes"][0]["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    assert lines[3].startswith("kubectl cp . ") and lines[3].endswith(":/bundle")
