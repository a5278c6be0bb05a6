"""`moeplan compile --target kubernetes`: manifests that validate, carry the plan, and resist injection."""
import hashlib
import json
import subprocess

import kubernetes_validate
import pytest
import yaml
from click.testing import CliRunner

from moeplan.backends.kubernetes import pod_memory
from moeplan.backends.kubernetes.codegen import KUBERNETES_VERSION, MIN_KUBERNETES_VERSION, manifest_files, other_files, slug
from moeplan.passes.analysis.trace.format import save_trace
from moeplan.planner.cli import main
from moeplan.planner.commands.compile import compile_cmd
from runtime_fixtures import SMALL, random_trace, small_model_dir

CPU = ("--cpu-only", "--image", "registry.example/moe:1")  # CPU pods: their commands run on this machine
EVIL = 'evil"name\': {x: 1}\n- $(touch /tmp/pwned) `id`; --- #\t\\ & *a !!python/object'


@pytest.fixture(scope="module")
def trace_path(tmp_path_factory):
    root = tmp_path_factory.mktemp("k8s")
    save_trace(random_trace(300, SMALL["num_layers"], SMALL["num_experts"]), root / "trace.npz")
    return root / "trace.npz"


def _compile(model_dir, trace_path, out, *extra):
    result = CliRunner().invoke(compile_cmd, [str(model_dir), "--trace", str(trace_path), "--target", "kubernetes",
                                              "--nodes", "2", "--gpus-per-node", "2", "--policy", "contiguous",
                                              "--out", str(out), "--quiet", *(CPU if "--image" not in extra else ("--cpu-only",)),
                                              *extra])
    assert result.exit_code == 0, result.output
    return {p.name: list(yaml.safe_load_all(p.read_text())) for p in sorted((out / "kubernetes").glob("*.yaml"))}


def _validate(docs):
    for name, items in docs.items():
        assert len(items) == 1, name
        for version in (MIN_KUBERNETES_VERSION, KUBERNETES_VERSION):
            kubernetes_validate.validate(items[0], version, strict=True)


def test_the_batch_job_manifests_validate_and_carry_the_plan(tmp_path, trace_path):
    model_dir = small_model_dir(tmp_path)
    out = tmp_path / "b"
    docs = _compile(model_dir, trace_path, out, "--batch-job")
    assert set(docs) == set(manifest_files(2, batch_job=True)) == {"service.yaml", "job.yaml"}
    _validate(docs)
    job = docs["job.yaml"][0]
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"] == 2
    pod = spec["template"]["spec"]
    service = docs["service.yaml"][0]
    assert service["spec"]["clusterIP"] == "None" and pod["subdomain"] == service["metadata"]["name"]
    assert service["spec"]["selector"].items() <= spec["template"]["metadata"]["labels"].items()
    anti = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][0]
    assert anti["topologyKey"] == "kubernetes.io/hostname"
    assert anti["labelSelector"]["matchLabels"].items() <= spec["template"]["metadata"]["labels"].items()
    ranks = pod["containers"][0]
    assert ranks["command"] == ["bash", "/bundle/launch.sh"]
    assert "nvidia.com/gpu" not in ranks["resources"]["limits"] and "tolerations" not in pod  # --cpu-only
    # float32 shards: each rank's tensor bytes as read and as its float32 copy, plus the measured overheads
    payload = lambda p: p.stat().st_size - 8 - int.from_bytes(p.read_bytes()[:8], "little")
    shard_bytes = sum(payload(out / f"shards/rank-0000{r}.safetensors") for r in (0, 1))
    overheads = 2 * pod_memory.RANK_OVERHEAD_MIB + pod_memory.AGENT_MIB  # no HTTP front in the batch Job
    assert int(ranks["resources"]["requests"]["memory"].removesuffix("Mi")) * 2**20 >= 2 * shard_bytes + overheads * 2**20
    env = {e["name"]: e for e in ranks["env"]}
    assert env["NNODES"]["value"] == "2" and env["MASTER_ADDR"]["value"].startswith(job["metadata"]["name"] + "-0.")
    assert "job-completion-index" in env["NODE_RANK"]["valueFrom"]["fieldRef"]["fieldPath"]
    # the pods check that the bundle they run is this plan's; the prompts' ConfigMap is the user's (README)
    assert env["MOEPLAN_PLAN_SHA256"]["value"] == hashlib.sha256((out / "plan.json").read_bytes()).hexdigest()
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert "bundle" not in volumes  # --weights-from image: /bundle is in the image
    assert volumes["prompts"]["configMap"]["name"] == f"{job['metadata']['name']}-prompts"
    assert f"kubectl create configmap {job['metadata']['name']}-prompts --from-file=prompts.txt=" in \
        (out / "kubernetes" / "README.md").read_text()
    assert json.loads((out / "plan.json").read_text())["target"] == "kubernetes"
    # the manifest covers the kubernetes files, so `moeplan run` still accepts the bundle
    files = json.loads((out / "manifest.json").read_text())["files"]
    assert {f"kubernetes/{n}" for n in manifest_files(2, True) + other_files("image")} == \
        {f for f in files if f.startswith("kubernetes/")}
    assert "kubectl apply -f kubernetes/" in (out / "kubernetes" / "README.md").read_text()


def test_compiling_twice_gives_identical_manifests(tmp_path, trace_path):
    model_dir = small_model_dir(tmp_path)
    _compile(model_dir, trace_path, tmp_path / "a")
    _compile(model_dir, trace_path, tmp_path / "b")
    read = lambda root: {p.name: p.read_bytes() for p in sorted((root / "kubernetes").iterdir())}
    assert read(tmp_path / "a") == read(tmp_path / "b")


def test_a_model_name_with_yaml_and_shell_metacharacters_yields_safe_valid_output(tmp_path, trace_path):
    model_dir = small_model_dir(tmp_path, name=EVIL)
    out = tmp_path / "b"
    docs = _compile(model_dir, trace_path, out)
    _validate(docs)
    name = slug(EVIL)
    for items in docs.values():
        meta = items[0]["metadata"]
        assert meta["name"].startswith(name) and meta["annotations"]["moeplan.io/model-name"] == EVIL
    assert set(docs) == set(manifest_files(2, batch_job=False))  # the service, by default
    for name in ("statefulset.yaml", "workers.yaml"):
        pod = docs[name][0]["spec"]["template"]["spec"]
        assert pod["containers"][0]["image"] == "registry.example/moe:1"
        assert set(pod) == {"enableServiceLinks", "terminationGracePeriodSeconds", "affinity", "containers", "volumes",
                            "securityContext"}
    launch = (out / "launch.sh").read_text()
    assert subprocess.run(["bash", "-n", str(out / "launch.sh")]).returncode == 0
    # the name stays inside one comment line: no line of launch.sh runs it
    assert all(l.startswith("#") for l in launch.splitlines() if "pwned" in l)
    assert all(l.startswith("#") for l in (out / "kubernetes" / "Dockerfile").read_text().splitlines() if "pwned" in l)


@pytest.mark.parametrize("image", ["registry.example/x:1 # $(id)", "Registry/UPPER:1", "r.io/a:b:c", "r.io/a\n- x"])
def test_an_image_that_is_no_image_reference_is_one_line_and_writes_nothing(tmp_path, trace_path, image):
    model_dir = small_model_dir(tmp_path)
    result = CliRunner().invoke(main, ["compile", str(model_dir), "--trace", str(trace_path), "--target", "kubernetes",
                                       "--cpu-only", "--image", image, "--out", str(tmp_path / "o")])
    assert result.exit_code == 2 and "--image must be an image reference" in result.output
    assert len(result.output.strip().splitlines()) == 1 and not (tmp_path / "o").exists()


def test_kubernetes_flags_on_the_torchrun_target_are_refused(tmp_path, trace_path):
    model_dir = small_model_dir(tmp_path)
    result = CliRunner().invoke(compile_cmd, [str(model_dir), "--trace", str(trace_path), "--image", "x",
                                              "--policy", "contiguous", "--out", str(tmp_path / "o"), "--quiet"])
    assert result.exit_code != 0 and "--target kubernetes" in str(result.exception)
    assert not (tmp_path / "o").exists()


def test_the_staged_pod_layout_runs_launch_sh(tmp_path, trace_path):
    """The batch Job's init container script, run with local paths, gives a directory the container command runs."""
    import os
    import socket
    import sys

    model_dir = small_model_dir(tmp_path)
    out = tmp_path / "b"
    result = CliRunner().invoke(compile_cmd, [str(model_dir), "--trace", str(trace_path), "--target", "kubernetes",
                                              "--nodes", "1", "--gpus-per-node", "1", "--policy", "contiguous",
                                              "--batch-job", "--out", str(out), "--quiet", *CPU])
    assert result.exit_code == 0, result.output
    job = yaml.safe_load((out / "kubernetes" / "job.yaml").read_text())
    plan_dir, work = tmp_path / "plan", tmp_path / "work"
    plan_dir.mkdir()
    work.mkdir()
    (plan_dir / "prompts.txt").write_text("The quick brown fox\nOnce upon a time\n")  # the user's ConfigMap (README)
    pod = job["spec"]["template"]["spec"]
    (stage,) = pod["initContainers"]
    script = stage["command"][2]
    script = script.replace("/plan/", f"{plan_dir}/").replace("/work", str(work))
    subprocess.run(["sh", "-c", script], check=True)
    container = pod["containers"][0]
    assert container["command"] == ["bash", "/bundle/launch.sh"]
    args = [a.replace("/work", str(work)).replace("/results", str(tmp_path / "results")) for a in container["args"]]
    args[args.index("--new-tokens") + 1] = "2"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, NNODES="1", NODE_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               PATH=f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}",
               MOEPLAN_PLAN_SHA256=next(e["value"] for e in container["env"] if e["name"] == "MOEPLAN_PLAN_SHA256"))
    env.pop("PYTHONPATH", None)
    proc = subprocess.run(["bash", str(out / "launch.sh"), *args], env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    mode = json.loads((out / "plan.json").read_text())["communication"]["mode"]  # the plan's (auto: by predicted time)
    assert json.loads((tmp_path / "results" / mode / "result.json").read_text())["texts"]
