"""Fine-grained FP8 checkpoints (DeepSeek-V3's and Qwen3's `-FP8` format) compile and run.

examples/hf_tiny/fp8_checkpoint.py rewrites a tiny model's checkpoint in that format (float8_e4m3fn
weights with `weight_scale_inv` block scales). Checked: the dequantization against a per-block loop
(partial edge blocks included); a compiled bundle's shards hold exactly the weights transformers'
own FP8 loader dequantizes to (`FineGrainedFP8Config(dequantize=True)`), for Qwen3-MoE and
DeepSeek-V3; a `--weights reference` bundle reads the FP8 checkpoint at each rank and verifies at 2
ranks under real torchrun; an FP8 tensor without its scale, or scales off the config's block grid,
are refused in one line. On an FP8 device (forced: MOEPLAN_WEIGHT_PRECISION=fp8) the ranks hold the
experts as FP8 with block scales (from a reference bundle the checkpoint's own bytes and scales)
and generate the bfloat16-held run's tokens; experts the runtime
cannot hold so are refused in one line, and an expert cache holds them at bfloat16.
"""
import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from hypothesis import given, settings, strategies as st

from moeplan.passes.importers.resolve import import_file
from moeplan.planner.cli import main
from moeplan.runtime.fp8_blocks import dequantize, quantize
from runtime_fixtures import random_trace

REPO = Path(__file__).resolve().parents[1]
tiny = import_file(REPO / "examples" / "hf_tiny" / "architectures.py")
fp8 = import_file(REPO / "examples" / "hf_tiny" / "fp8_checkpoint.py")


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 40), k=st.integers(1, 40), bn=st.integers(1, 16), bk=st.integers(1, 16), seed=st.integers(0, 99))
def test_dequantize_scales_each_block_partial_edges_included(n, k, bn, bk, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    q, scale = quantize(w, (bn, bk))
    out = dequantize(q, scale, (bn, bk))
    expected = torch.empty(n, k)
    for i in range(0, n, bn):
        for j in range(0, k, bk):
            expected[i:i + bn, j:j + bk] = q[i:i + bn, j:j + bk].float() * scale[i // bn, j // bk]
    assert torch.equal(out, expected)
    assert (out - w).abs().max() <= w.abs().max() / 8  # e4m3 keeps 3 mantissa bits per block


def test_scales_that_do_not_cover_the_weight_are_refused():
    q = torch.zeros(16, 16, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"do not cover weights \[16, 16\] in blocks of 8x8"):
        dequantize(q, torch.ones(3, 2), (8, 8))


def _fp8_model(tmp_path: Path, arch: str) -> Path:
    return fp8.convert(tiny.build(arch, tmp_path / "models"), tmp_path / "models" / f"{arch}-fp8", (8, 8))


def _compile(model_dir: Path, out: Path, *extra) -> object:
    from moeplan.backends.common.model_source import expert_containers, model_files
    from moeplan.passes.analysis.trace.format import save_trace

    layers = len(expert_containers(*model_files(str(model_dir))))
    top_k = json.loads((model_dir / "config.json").read_text())["num_experts_per_tok"]
    trace = out.parent / f"trace-{layers}-{top_k}.npz"
    save_trace(random_trace(300, layers, 8, top_k=top_k, seed=1), trace)
    return CliRunner().invoke(main, ["compile", str(model_dir), "--trace", str(trace), "--nodes", "1", "--gpus-per-node",
                                     "2", "--policy", "contiguous", "--mode", "coherent", "--out", str(out), "--quiet",
                                     *extra])


def _verify(bundle: Path, tmp_path: Path, *extra) -> dict:
    """`moeplan run --verify` of two prompts at 2 ranks (real torchrun): its JSON report."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("ids: 5 9 11 3\nids: 60 12 33\n")
    result = CliRunner().invoke(main, ["run", str(bundle), "--verify", "--nproc", "2", "--prompts", str(prompts), "--json",
                                       *extra])
    assert result.exit_code == 0, result.output
    return json.loads(result.output.strip().splitlines()[-1])


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_an_fp8_bundle_holds_the_weights_transformers_dequantizes_to(tmp_path, arch):
    import transformers

    from moeplan.runtime.bundle_io import read_rank_tensors
    from moeplan.runtime.model.moe_adapter import join_expert_state
    from moeplan.backends.common.model_source import expert_containers, model_files

    directory = _fp8_model(tmp_path, arch)
    result = _compile(directory, tmp_path / "bundle")
    assert result.exit_code == 0, result.output
    plan = json.loads((tmp_path / "bundle" / "plan.json").read_text())
    assert plan["model"]["ir"]["quantization"] == "fp8 blocks 8x8"
    state = {}
    for rank in range(2):
        state.update(read_rank_tensors(tmp_path / "bundle", plan, rank))
    state = join_expert_state(state, expert_containers(*model_files(str(directory))))
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        directory, quantization_config=transformers.FineGrainedFP8Config(dequantize=True, weight_block_size=(8, 8)))
    expected = reference.state_dict()
    quantized = [k for k in expected if "experts" in k or "proj" in k]
    assert len(quantized) > 10
    for name, tensor in expected.items():
        assert name in state, name
        assert torch.equal(state[name], tensor.to(state[name].dtype)), name


def test_a_reference_bundle_reads_the_fp8_checkpoint_at_each_rank_and_verifies(tmp_path):
    directory = _fp8_model(tmp_path, "mixtral")
    bundle = tmp_path / "bundle"
    result = _compile(directory, bundle, "--weights", "reference")
    assert result.exit_code == 0, result.output
    index = json.loads((bundle / "shards" / "rank-00001.index.json").read_text())["tensors"]
    part = index["model.layers.0.mlp.experts.7.gate_up_proj"]["parts"][0]
    assert part["scale"] == {"file": "model.safetensors", "block": [8, 8],
                             "tensor": "model.layers.0.block_sparse_moe.experts.7.w1.weight_scale_inv"}
    assert not list(bundle.rglob("*.safetensors"))
    report = _verify(bundle, tmp_path, "--new-tokens", "3")
    assert report["verified"] and report["tokens_match"] and report["max_abs_logit_diff"] <= 1e-4


def test_an_fp8_tensor_without_its_scale_is_refused_in_one_line(tmp_path):
    from safetensors.torch import load_file, save_file

    directory = _fp8_model(tmp_path, "qwen3_moe")
    tensors = load_file(directory / "model.safetensors")
    del tensors["model.layers.1.self_attn.q_proj.weight_scale_inv"]
    save_file(tensors, directory / "model.safetensors")
    result = _compile(directory, tmp_path / "bundle")
    assert result.exit_code == 2
    assert result.output.strip().count("\n") == 0
    assert "model.layers.1.self_attn.q_proj.weight in" in result.output
    assert "is stored as F8_E4M3 without a 'model.layers.1.self_attn.q_proj.weight_scale_inv' scale" in result.output
    assert not (tmp_path / "bundle").exists()


def test_quantizing_dequantized_bf16_weights_gives_back_the_checkpoints_fp8_values():
    g = torch.Generator().manual_seed(0)
    q, scale = quantize(torch.randn(4, 64, 96, generator=g) * 0.05, (16, 32))
    again, scale_again = quantize(dequantize(q, scale, (16, 32)).to(torch.bfloat16).float(), (16, 32))
    assert torch.equal(again.view(torch.uint8), q.view(torch.uint8))
    assert ((scale_again - scale).abs() / scale).max() < 2 ** -8  # the block maximum's bf16 rounding


def test_an_fp8_device_holds_the_experts_as_fp8_and_verifies_at_two_ranks(tmp_path, monkeypatch):
    """MOEPLAN_WEIGHT_PRECISION=fp8 stands for an sm89+ GPU: DeepSeek-V3's routed experts are held as
    FP8 with block scales (one byte per weight), dequantized per call; the run's tokens are the
    bfloat16-held run's."""
    from moeplan.runtime.bundle_io import load_bundle

    directory = _fp8_model(tmp_path, "deepseek_v3")
    bundle = tmp_path / "bundle"
    assert _compile(directory, bundle).exit_code == 0
    monkeypatch.setenv("MOEPLAN_WEIGHT_PRECISION", "fp8")
    model = load_bundle(bundle, 1, 2, torch.device("cpu"), None)[3]
    held = [a.library_experts for a in model.adapters]
    assert held and all(m.gate_up_proj.numel() == 0 and m.down_proj.numel() == 0 for m in held)
    assert all(m.gate_up_proj_fp8.dtype == torch.float8_e4m3fn and m.gate_up_proj_fp8.shape[0] == 4 for m in held)
    assert model.expert_weight_dtype == "float8_e4m3fn" and model.weight_dtype == "bfloat16"
    reports = {}
    for precision in ("fp8", "bf16"):
        monkeypatch.setenv("MOEPLAN_WEIGHT_PRECISION", precision)
        reports[precision] = _verify(bundle, tmp_path, "--new-tokens", "4", "--results", str(tmp_path / precision))
    fp8_run, bf16_run = reports["fp8"], reports["bf16"]
    assert fp8_run["verified"] and fp8_run["expert_weight_dtype"] == "float8_e4m3fn"
    assert bf16_run["expert_weight_dtype"] == bf16_run["weight_dtype"] == "bfloat16"
    generated = [json.loads((tmp_path / p / "coherent" / "result.json").read_text())["generated"] for p in reports]
    assert generated[0] == generated[1]


def test_experts_the_runtime_cannot_hold_as_fp8_are_refused_in_one_line(tmp_path, monkeypatch):
    from moeplan.runtime.bundle_io import BundleError, load_bundle

    directory = _fp8_model(tmp_path, "llama4_text")
    assert _compile(directory, tmp_path / "bundle").exit_code == 0
    monkeypatch.setenv("MOEPLAN_WEIGHT_PRECISION", "fp8")
    with pytest.raises(BundleError, match="holds FP8 experts for transformers' grouped experts modules only, not "
                                          "Llama4TextExperts; set MOEPLAN_WEIGHT_PRECISION=bf16"):
        load_bundle(tmp_path / "bundle", 0, 2, torch.device("cpu"), None)


def test_an_expert_cache_holds_and_plans_fp8_experts_at_bf16():
    from moeplan.runtime.precision import FP8, held_dtypes

    assert held_dtypes("bfloat16", "fp8 blocks 128x128", True, "fp8")["experts"] == FP8
    assert held_dtypes("bfloat16", "fp8 blocks 128x128", True, "fp8", expert_cache=True) == \
        {"dense": "bfloat16", "experts": "bfloat16"}


def test_e8m0_and_per_tensor_scales_dequantize():
    q = torch.tensor([[1.0, -2.0], [0.5, 4.0]]).to(torch.float8_e4m3fn)
    assert torch.equal(dequantize(q, torch.tensor([[130]], dtype=torch.uint8), (2, 2)), q.float() * 8)  # 2 ** (130 - 127)
    assert torch.equal(dequantize(q, torch.tensor(0.5), None), q.float() * 0.5)


def test_scales_that_do_not_fit_the_configs_block_are_refused_in_one_line(tmp_path):
    directory = _fp8_model(tmp_path, "qwen3_moe")
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"]["weight_block_size"] = [16, 16]  # the checkpoint's scales are per 8 x 8
    (directory / "config.json").write_text(json.dumps(config))
    result = _compile(directory, tmp_path / "bundle")
    assert result.exit_code == 2 and result.output.strip().count("\n") == 0
    assert "not one per 16x16 block; the config's quantization_config.weight_block_size does not fit" in result.output


def test_a_reference_bundle_on_an_fp8_device_holds_the_checkpoints_own_fp8_bytes_and_scales(tmp_path, monkeypatch):
    from safetensors.torch import load_file

    from moeplan.runtime.bundle_io import load_bundle

    directory = _fp8_model(tmp_path, "qwen3_moe")
    bundle = tmp_path / "bundle"
    assert _compile(directory, bundle, "--weights", "reference").exit_code == 0
    monkeypatch.setenv("MOEPLAN_WEIGHT_PRECISION", "fp8")
    model = load_bundle(bundle, 1, 2, torch.device("cpu"), None)[3]
    checkpoint = load_file(directory / "model.safetensors")
    for adapter in model.adapters:
        held = adapter.library_experts
        for i, e in enumerate(adapter.local):
            name = f"model.layers.{adapter.layer}.mlp.experts.{e}"
            values = torch.cat([checkpoint[f"{name}.gate_proj.weight"], checkpoint[f"{name}.up_proj.weight"]])
            scales = torch.cat([checkpoint[f"{name}.gate_proj.weight_scale_inv"], checkpoint[f"{name}.up_proj.weight_scale_inv"]])
            assert torch.equal(held.gate_up_proj_fp8[i].view(torch.uint8), values.view(torch.uint8))
            assert torch.equal(held.gate_up_proj_fp8_scale_inv[i], scales)
            assert torch.equal(held.down_proj_fp8[i].view(torch.uint8), checkpoint[f"{name}.down_proj.weight"].view(torch.uint8))
    report = _verify(bundle, tmp_path, "--new-tokens", "3")
    assert report["verified"] and report["expert_weight_dtype"] == "float8_e4m3fn"
