"""The torchrun bundle: layout, deterministic bytes, manifest, and refusal of tampered bundles.

Tampering must be caught by `moeplan run` before any rank starts: these tests never launch.
"""
import json
import os

import pytest
from safetensors.torch import load_file

from moeplan.backends.common.manifest import sha256_file
from moeplan.planner.pipeline.run import run_bundle
from moeplan.core.errors import UserError
from runtime_fixtures import SMALL, contiguous_placement, small_model_dir, write_small_bundle


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return small_model_dir(tmp_path_factory.mktemp("model"))


def _bundle(tmp_path, model_dir, name="bundle", nodes=1, gpus=2, replicate=()):
    placement = contiguous_placement(SMALL["num_layers"], SMALL["num_experts"], nodes, gpus, replicate)
    return write_small_bundle(tmp_path / name, model_dir, placement)


def _all_bytes(root):
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_bundle_has_the_documented_layout(tmp_path, model_dir):
    root = _bundle(tmp_path, model_dir)
    for rel in ("plan.json", "placement.json", "launch.sh", "README.md", "manifest.json", "model/config.json",
                "model/model.py", "runtime/serve.py", "runtime/ep/engine.py",
                "shards/rank-00000.safetensors", "shards/rank-00001.safetensors"):
        assert (root / rel).is_file(), rel
    assert os.access(root / "launch.sh", os.X_OK)
    launch = (root / "launch.sh").read_text()
    assert "NNODES" in launch and "NODE_RANK" in launch and "MASTER_ADDR" in launch and "-m runtime.serve" in launch
    manifest = json.loads((root / "manifest.json").read_text())["files"]
    assert set(manifest) == set(_all_bytes(root)) - {"manifest.json"}
    assert all(sha256_file(root / rel) == digest for rel, digest in manifest.items())
    # whole runtime subpackages: no expert caches in this plan, so no runtime/offload/; no Lambda code either
    assert sorted(p.name for p in (root / "runtime").iterdir() if p.is_dir()) == ["ep", "model", "serving"]
    # the runtime is self-contained: it never imports moeplan
    for f in (root / "runtime").rglob("*.py"):
        assert "moeplan" not in "".join(l for l in f.read_text().splitlines() if l.lstrip().startswith(("import", "from")))


def test_shards_hold_dense_weights_everywhere_and_only_their_experts(tmp_path, model_dir):
    root = _bundle(tmp_path, model_dir, nodes=1, gpus=2, replicate=(7,))
    ranks = [load_file(str(root / f"shards/rank-0000{r}.safetensors")) for r in range(2)]
    for r, shard in enumerate(ranks):
        experts = {int(k.split(".")[4]) for k in shard if ".moe.experts." in k and k.startswith("blocks.0.")}
        assert experts == ({0, 1, 2, 3, 7} if r == 0 else {4, 5, 6, 7})
        assert "embed.weight" in shard and "blocks.2.moe.gate.weight" in shard and "head.weight" in shard


def test_bundle_bytes_are_deterministic(tmp_path, model_dir):
    a = _all_bytes(_bundle(tmp_path, model_dir, "a"))
    b = _all_bytes(_bundle(tmp_path, model_dir, "b"))
    assert a == b


def test_missing_shard_stops_before_launch(tmp_path, model_dir):
    root = _bundle(tmp_path, model_dir)
    (root / "shards/rank-00001.safetensors").unlink()
    with pytest.raises(UserError, match="rank-00001.safetensors.*missing"):
        run_bundle(str(root), None, None, 2, "coherent", True, str(tmp_path / "res"), 60)
    assert not (tmp_path / "res").exists()


def test_hash_mismatch_stops_before_launch(tmp_path, model_dir):
    root = _bundle(tmp_path, model_dir)
    with open(root / "shards/rank-00000.safetensors", "r+b") as fh:
        fh.seek(-4, 2)
        fh.write(b"\x00\x01\x02\x03")
    with pytest.raises(UserError, match="rank-00000.safetensors.*sha256"):
        run_bundle(str(root), None, None, 2, "coherent", True, None, 60)


def test_world_size_mismatch_stops_before_launch(tmp_path, model_dir):
    root = _bundle(tmp_path, model_dir)
    with pytest.raises(UserError, match="--nproc 3 does not match the plan's world size 2"):
        run_bundle(str(root), 3, None, 2, "coherent", True, None, 60)


def test_a_plan_edited_to_another_world_size_is_refused(tmp_path, model_dir):
    root = _bundle(tmp_path, model_dir)
    plan = json.loads((root / "plan.json").read_text())
    plan["topology"]["gpus_per_node"] = 4
    (root / "plan.json").write_text(json.dumps(plan))
    with pytest.raises(UserError, match="plan.json.*sha256"):
        run_bundle(str(root), None, None, 2, "coherent", True, None, 60)


def test_not_a_bundle_is_one_line(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        run_bundle(str(tmp_path / "nowhere"), None, None, 2, "coherent", True, None, 60)


def test_launch_script_checks_the_node_count_before_starting(tmp_path, model_dir):
    import subprocess

    root = _bundle(tmp_path, model_dir, nodes=2, gpus=1)
    assert subprocess.run(["bash", "-n", str(root / "launch.sh")]).returncode == 0
    proc = subprocess.run(["bash", str(root / "launch.sh"), "--prompts", "p.txt", "--out", "r"],
                          env={"NNODES": "3", "PATH": "/usr/bin:/bin"}, capture_output=True, text=True)
    assert proc.returncode == 2 and "compiled for 2 node(s) but NNODES=3" in proc.stderr


def test_run_json_prints_the_documented_keys(monkeypatch):
    from click.testing import CliRunner

    from moeplan.planner.commands import run as run_module

    report = {"verified": True, "max_abs_logit_diff": 1e-6, "tokens_match": True, "gpu_local_fraction": 0.5,
              "predicted_gpu_local_fraction": 0.5, "bytes_per_token": 100.0, "tokens_per_second": 9.0,
              "messages_per_token": 1.0, "total_bytes_per_token": 200.0, "mode": "coherent", "world_size": 2,
              "locality_matches_prediction": True, "per_layer": [], "texts": ["x"], "totals": {}}
    monkeypatch.setattr(run_module, "run_modes", lambda *a, **k: {"coherent": report})
    result = CliRunner().invoke(run_module.run, ["somewhere", "--verify", "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.output.strip().splitlines()[-1])
    assert {"verified", "max_abs_logit_diff", "tokens_match", "gpu_local_fraction", "predicted_gpu_local_fraction",
            "bytes_per_token", "tokens_per_second"} <= set(out)
    monkeypatch.setattr(run_module, "run_modes", lambda *a, **k: {"coherent": dict(report, verified=False)})
    assert CliRunner().invoke(run_module.run, ["somewhere", "--verify", "--json"]).exit_code == 1
