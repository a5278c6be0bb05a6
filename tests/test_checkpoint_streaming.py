"""compile streams a Hugging Face checkpoint into rank shards (or per-rank indexes into it).

The streamed bundle must be byte-identical to the bundle written from the library's own loaded
state dict (transformers' `from_pretrained`), for a per-expert-module checkpoint (Mixtral:
`experts.N.w1/w3/w2` merged into fused tensors), a fused one (gpt-oss: `experts.gate_up_proj`
[E, ...]) and DBRX's flattened [E * r, D]; a checkpoint sharded with an index json gives the same
shards; `--weights reference` runs and verifies at 2 ranks under real torchrun, and a changed
checkpoint is refused in one line.
"""
import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from moeplan.planner.cli import main
from moeplan.passes.importers.resolve import import_file
from runtime_fixtures import random_trace

REPO = Path(__file__).resolve().parents[1]
tiny = import_file(REPO / "examples" / "hf_tiny" / "architectures.py")


def _trace(path: Path, layers: int, top_k: int = 2) -> Path:
    from moeplan.passes.analysis.trace.format import save_trace

    save_trace(random_trace(300, layers, 8, top_k=top_k, seed=1), path)
    return path


def _compile(model_dir: Path, trace: Path, out: Path, *extra) -> None:
    result = CliRunner().invoke(main, ["compile", str(model_dir), "--trace", str(trace), "--nodes", "1", "--gpus-per-node",
                                       "2", "--policy", "contiguous", "--mode", "coherent", "--out", str(out), "--quiet",
                                       *extra])
    assert result.exit_code == 0, result.output


def _files(root: Path) -> dict:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _moe_layers(model_dir: Path) -> int:
    from moeplan.backends.common.model_source import expert_containers, model_files

    return len(expert_containers(*model_files(str(model_dir))))


@pytest.mark.parametrize("arch", ["mixtral", "gpt_oss", "dbrx"])
def test_streamed_bundle_equals_the_bundle_of_the_loaded_state_dict(tmp_path, arch):
    import transformers

    from moeplan.backends.common.model_source import model_files
    from moeplan.backends.torchrun.codegen import write_bundle
    from moeplan.core.plan import Plan

    directory = tiny.build(arch, tmp_path / "models")
    trace = _trace(tmp_path / "trace.npz", _moe_layers(directory))
    _compile(directory, trace, tmp_path / "streamed")
    plan = Plan.from_json((tmp_path / "streamed" / "plan.json").read_text())
    state = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).state_dict()
    arch_name, files = model_files(str(directory))
    write_bundle(tmp_path / "loaded", plan, state, {"architecture": arch_name, "files": files})
    streamed, loaded = _files(tmp_path / "streamed"), _files(tmp_path / "loaded")
    assert sorted(streamed) == sorted(loaded)
    assert [n for n in streamed if n.startswith("shards/")] == ["shards/rank-00000.safetensors", "shards/rank-00001.safetensors"]
    for name in streamed:
        assert streamed[name] == loaded[name], name
    _compile(directory, trace, tmp_path / "again")  # same inputs, same bytes
    assert _files(tmp_path / "again") == streamed


def test_sharded_checkpoint_with_an_index_gives_the_same_shards(tmp_path):
    import transformers

    directory = tiny.build("qwen3_moe", tmp_path / "single")
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    sharded = tmp_path / "sharded" / "qwen3_moe"
    model.save_pretrained(sharded, max_shard_size="40KB")
    assert (sharded / "model.safetensors.index.json").is_file() and len(list(sharded.glob("*.safetensors"))) > 2
    trace = _trace(tmp_path / "trace.npz", _moe_layers(directory))
    _compile(directory, trace, tmp_path / "a")
    _compile(sharded, trace, tmp_path / "b")
    for rank in (0, 1):
        name = f"shards/rank-{rank:05d}.safetensors"
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    sha = [json.loads((tmp_path / b / "plan.json").read_text())["model"]["weights_sha256"] for b in "ab"]
    assert sha[0] == sha[1]


def test_a_rank_holds_dense_weights_and_only_its_experts(tmp_path):
    from moeplan.runtime.bundle_io import build_rank_model
    from moeplan.runtime.ep.expert_table import ExpertTable

    directory = tiny.build("qwen3_moe", tmp_path / "models")
    _compile(directory, _trace(tmp_path / "trace.npz", _moe_layers(directory)), tmp_path / "b")
    plan = json.loads((tmp_path / "b" / "plan.json").read_text())
    table = ExpertTable.from_placement(plan["placement"])
    model, _ = build_rank_model(tmp_path / "b", plan, 0, table, torch.device("cpu"))
    local = {layer: len(e) for layer, e in enumerate(plan["placement"]["layers"][l]["devices"][0] for l in range(2))}
    for adapter in model.adapters:
        experts = adapter.block.experts.library
        assert experts.gate_up_proj.shape[0] == local[adapter.moe] < 8
    assert not any(p.is_meta for p in model.model.parameters())


def test_reference_weights_run_verified_at_two_ranks_and_a_changed_checkpoint_is_refused(tmp_path):
    directory = tiny.build("mixtral", tmp_path / "models")
    bundle = tmp_path / "bundle"
    _compile(directory, _trace(tmp_path / "trace.npz", _moe_layers(directory)), bundle, "--weights", "reference")
    plan = json.loads((bundle / "plan.json").read_text())
    assert plan["deployment"]["weights"] == "reference"
    assert plan["model"]["checkpoint"]["path"] == str(directory.resolve())
    assert set(plan["model"]["checkpoint"]["files"]) == {"model.safetensors"}
    assert not list(bundle.rglob("*.safetensors"))  # nothing copied
    index = json.loads((bundle / "shards" / "rank-00001.index.json").read_text())["tensors"]
    gate_up = index["model.layers.0.mlp.experts.7.gate_up_proj"]
    assert [p["tensor"] for p in gate_up["parts"]] == ["model.layers.0.block_sparse_moe.experts.7.w1.weight",
                                                       "model.layers.0.block_sparse_moe.experts.7.w3.weight"]
    assert "model.layers.0.mlp.experts.0.gate_up_proj" not in index  # rank 1 holds experts 4..7 only
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("ids: 5 9 11 3\nids: 60 12 33\n")
    runner = CliRunner()
    args = ["run", str(bundle), "--verify", "--nproc", "2", "--new-tokens", "3", "--mode", "both", "--prompts",
            str(prompts), "--json"]
    result = runner.invoke(main, args)
    assert result.exit_code == 0, result.output
    modes = json.loads(result.output.strip().splitlines()[-1])["modes"]
    for report in modes.values():
        assert report["verified"] and report["max_abs_logit_diff"] <= 1e-4 and report["tokens_match"]
    checkpoint = directory / "model.safetensors"
    data = bytearray(checkpoint.read_bytes())
    data[-1] ^= 0x01  # one bit of the last tensor's data: same size, same header
    checkpoint.write_bytes(bytes(data))
    result = runner.invoke(main, args)
    assert result.exit_code == 2
    assert result.output.strip().count("\n") == 0 and "not the one the bundle was compiled from" in result.output


def test_reference_weights_need_a_safetensors_directory(tmp_path):
    from runtime_fixtures import small_model_dir

    directory = small_model_dir(tmp_path)
    result = CliRunner().invoke(main, ["compile", str(directory), "--trace", str(_trace(tmp_path / "t.npz", 3)),
                                       "--nodes", "1", "--gpus-per-node", "2", "--policy", "contiguous", "--out",
                                       str(tmp_path / "b"), "--weights", "reference"])
    assert result.exit_code == 2 and "--weights reference needs a Hugging Face model directory" in result.output
    assert not (tmp_path / "b").exists()


def test_kubernetes_bundle_with_reference_weights_mounts_the_checkpoint_and_validates(tmp_path):
    import kubernetes_validate
    import yaml

    from moeplan.backends.kubernetes.codegen import KUBERNETES_VERSION

    directory = tiny.build("qwen3_moe", tmp_path / "models")
    out = tmp_path / "bundle"
    _compile(directory, _trace(tmp_path / "trace.npz", _moe_layers(directory)), out, "--target", "kubernetes",
             "--weights", "reference", "--cpu-only", "--image", "registry.example/moe:1")
    docs = {p.name: list(yaml.safe_load_all(p.read_text())) for p in sorted((out / "kubernetes").glob("*.yaml"))}
    for name, items in docs.items():
        assert len(items) == 1, name
        kubernetes_validate.validate(items[0], KUBERNETES_VERSION, strict=True)
    pod = docs["statefulset.yaml"][0]["spec"]["template"]["spec"]  # the service's node 0
    ranks = pod["containers"][0]
    assert {"name": "MOEPLAN_CHECKPOINT", "value": "/checkpoint"} in ranks["env"]
    assert {"name": "checkpoint", "mountPath": "/checkpoint", "readOnly": True} in ranks["volumeMounts"]
    claim = next(v for v in pod["volumes"] if v["name"] == "checkpoint")["persistentVolumeClaim"]
    assert claim["readOnly"] and claim["claimName"].endswith("-checkpoint")
    assert "--weights reference" in (out / "kubernetes" / "README.md").read_text()


@pytest.mark.parametrize("arch", ["mixtral", "deepseek_v3", "llama4_text"])
def test_the_meta_import_gives_the_ir_of_the_weighted_import(tmp_path, arch):
    """compile imports on meta: its plans must not depend on which importer ran."""
    from moeplan.passes.importers import load_model
    from moeplan.passes.importers.hf_streaming import load_directory_meta

    directory = tiny.build(arch, tmp_path)
    weighted, meta = load_model(str(directory)), load_directory_meta(directory)
    assert meta.has_weights and next(meta.module.parameters()).is_meta
    assert weighted.ir.to_dict() == meta.ir.to_dict()


def test_codegen_of_a_written_plan_streams_the_same_bundle_and_checks_the_weights(tmp_path):
    directory = tiny.build("olmoe", tmp_path / "models")
    trace = _trace(tmp_path / "trace.npz", _moe_layers(directory))
    _compile(directory, trace, tmp_path / "compiled", "--weights", "reference")
    runner = CliRunner()
    result = runner.invoke(main, ["codegen", str(tmp_path / "compiled" / "plan.json"), "--out", str(tmp_path / "again")])
    assert result.exit_code == 0, result.output
    assert _files(tmp_path / "again") == _files(tmp_path / "compiled")
    other = tiny.build("olmoe", tmp_path / "other", seed=1)
    result = runner.invoke(main, ["codegen", str(tmp_path / "compiled" / "plan.json"), "--model", str(other), "--out",
                                  str(tmp_path / "wrong")])
    assert result.exit_code == 2 and "weights_sha256 differs" in result.output
    assert not (tmp_path / "wrong").exists()
