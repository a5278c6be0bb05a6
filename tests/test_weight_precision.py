"""Weights at the checkpoint's precision (runtime/precision.py, issue 39 item 1): the held dtypes by
checkpoint and device, the bytes they take, the rank's override, and `moeplan run --verify` of a
bfloat16 checkpoint held at bfloat16, compared with the source model at bfloat16 within its stated
tolerance."""
from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from moeplan.planner.cli import main
from moeplan.planner.pipeline.run import LOGIT_TOLERANCE
from moeplan.runtime.precision import FP8, device_precision, held_bytes, held_dtypes
from runtime_fixtures import contiguous_placement, hf_model_dir, write_hf_bundle


@pytest.mark.parametrize("stored, quantization, on_gpu, precision, dense, experts", [
    ("float32", "", True, "fp8", "float32", "float32"),          # never below the checkpoint
    ("bfloat16", "", True, "bf16", "bfloat16", "bfloat16"),      # bf16 stays bf16 on GPU
    ("bfloat16", "", False, "fp32", "float32", "float32"),       # a CPU without native bf16
    ("float16", "", True, "bf16", "float16", "float16"),
    ("float16", "", False, "bf16", "bfloat16", "bfloat16"),      # CPUs hold fp16 as bf16
    ("bfloat16", "fp8 blocks 128x128", True, "fp8", "bfloat16", FP8),  # FP8 experts with their scales
    ("bfloat16", "fp8 blocks 128x128", True, "bf16", "bfloat16", "bfloat16"),
    ("bfloat16", "mxfp4", True, "fp8", "bfloat16", "bfloat16"),  # dequantized
])
def test_held_dtypes_follow_the_checkpoint_and_the_device(stored, quantization, on_gpu, precision, dense, experts):
    assert held_dtypes(stored, quantization, on_gpu, precision) == {"dense": dense, "experts": experts}


def test_held_bytes_keep_fp8_scales_and_count_casts_by_element():
    assert held_bytes(1000, 1032, "bfloat16", "fp8 blocks 128x128", FP8) == 1032  # as stored, scales included
    assert held_bytes(1000, 1032, "bfloat16", "fp8 blocks 128x128", "bfloat16") == 2000
    assert held_bytes(1000, 2000, "bfloat16", "", "bfloat16") == 2000
    assert held_bytes(1000, 2000, "bfloat16", "", "float32") == 4000


def test_the_rank_precision_override_is_checked(monkeypatch):
    monkeypatch.setenv("MOEPLAN_WEIGHT_PRECISION", "bf16")
    assert device_precision("cpu") == "bf16"
    monkeypatch.setenv("MOEPLAN_WEIGHT_PRECISION", "fp4")
    with pytest.raises(ValueError, match="fp8, bf16, fp32"):
        device_precision("cpu")
    monkeypatch.delenv("MOEPLAN_WEIGHT_PRECISION")
    amx = getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()
    assert device_precision("cpu") == ("bf16" if amx else "fp32")


@pytest.mark.parametrize("precision, held", [("bf16", "bfloat16"), ("fp32", "float32")])
def test_run_verify_holds_a_bf16_checkpoint_at_the_rank_precision(tmp_path, monkeypatch, precision, held):
    """A bfloat16 Mixtral on 2 ranks: held at bfloat16 where the rank computes bf16 (compared with the source
    model at bfloat16, tolerance 0.25), at float32 elsewhere (tolerance 1e-4); greedy tokens identical."""
    directory, model = hf_model_dir(tmp_path, "mixtral")
    model = model.to(torch.bfloat16)
    model.save_pretrained(directory)
    assert json.loads((directory / "config.json").read_text())["dtype"] == "bfloat16"
    bundle = write_hf_bundle(tmp_path / "bundle", directory, model, contiguous_placement(3, 8, 1, 2))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("0123\n9.,;\n")  # bytes below the vocabulary of 64
    monkeypatch.setenv("MOEPLAN_WEIGHT_PRECISION", precision)
    result = CliRunner().invoke(main, ["run", str(bundle), "--verify", "--nproc", "2", "--new-tokens", "3",
                                       "--prompts", str(prompts), "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output.strip().splitlines()[-1])
    assert report["weight_dtype"] == held and report["logit_tolerance"] == LOGIT_TOLERANCE[held]
    assert report["verified"] and report["tokens_match"] and report["max_abs_logit_diff"] <= LOGIT_TOLERANCE[held]


@pytest.mark.parametrize("arch", ["llama4_text", "qwen3_moe"])
def test_experts_held_at_bf16_serve_rows_received_as_float32(arch):
    """A rank's experts at bf16 compute the rows other ranks send, which the exchange carries as float32
    (Llama-4's experts once refused them: "expected m1 and m2 to have the same dtype")."""
    import json
    import tempfile
    from pathlib import Path

    from moeplan.passes.importers.resolve import import_file

    repo = Path(__file__).resolve().parents[1]
    build_engine = import_file(repo / "benchmarks" / "single_rank_engine.py").build_engine
    tiny = import_file(repo / "examples" / "hf_tiny" / "architectures.py")
    config = json.loads((tiny.build(arch, Path(tempfile.mkdtemp())) / "config.json").read_text())
    engine, _, top_k = build_engine(config, torch.device("cpu"), torch.bfloat16, seed=0)
    adapter = engine.model.adapters[0]
    h = torch.randn(6, config["hidden_size"])  # float32, as received
    slots = torch.stack([torch.arange(6) % 8, (torch.arange(6) + 3) % 8], 1)[:, :top_k]
    weights = torch.rand(6, top_k)
    out = adapter.local_expert_output(h, slots, weights)
    reference = adapter.local_expert_output(h.to(torch.bfloat16), slots, weights.to(torch.bfloat16))
    assert out.shape == h.shape and torch.isfinite(out).all()
    assert torch.allclose(out.float(), reference.float(), atol=1e-2)
