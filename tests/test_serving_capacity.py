"""Serving capacity as a plan decision (passes/cost/capacity.py): KV bytes per token from the
model's config, the sequences and context the ranks hold, recorded in plan.json and printed by
`compile`; the runtime's limits come from it (tests/test_serving_units.py)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from moeplan.core.hardware import load_hardware
from moeplan.passes.cost.capacity import (MAX_SEQUENCES, held_weights, model_positions, runtime_kv_bytes_per_token,
                                          serving_capacity)
from moeplan.planner.cli import main
from moeplan.passes.importers import load_model
from runtime_fixtures import small_model_dir

CONFIGS = Path(__file__).resolve().parent.parent / "examples" / "configs"


@pytest.fixture(scope="module")
def loaded():
    return {name: load_model(str(CONFIGS / f"{name}.json")) for name in ("mixtral-8x7b", "deepseek-v3", "qwen3-30b-a3b")}


def test_kv_bytes_per_token_follow_the_configs(loaded):
    for name, model in loaded.items():
        c = json.loads((CONFIGS / f"{name}.json").read_text())
        if c.get("kv_lora_rank"):  # MLA: the compressed latent and the rotated key
            per_layer = c["kv_lora_rank"] + c["qk_rope_head_dim"]
        else:
            head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
            per_layer = 2 * c["num_key_value_heads"] * head_dim
        for dtype, size in (("float32", 4), ("bfloat16", 2)):
            expected = c["num_hidden_layers"] * per_layer * size
            assert runtime_kv_bytes_per_token(model.module.config, model.ir, dtype) == expected, name
        assert model_positions(model.module.config) == c["max_position_embeddings"]


@settings(max_examples=60, deadline=None)
@given(memory_gib=st.floats(0.5, 4096), experts=st.lists(st.integers(0, 300), min_size=1, max_size=8),
       mode=st.sampled_from(["coherent", "standard"]))
def test_what_the_capacity_admits_fits_the_memory_it_was_given(loaded, memory_gib, experts, mode):
    model = loaded["mixtral-8x7b"]
    memory = int(memory_gib * (1 << 30))
    held = held_weights(model.ir, load_hardware("h100-sxm"))
    cap = serving_capacity(model.ir, model.module.config, experts, mode, memory, "test", held)
    assert cap["fits"] == (cap["max_sequences"] > 0)
    free = min(memory - w - cap["activation_bytes"] - cap["reserve_bytes"] for w in cap["weight_bytes_per_rank"])
    if cap["fits"]:
        per_rank = -(-cap["max_sequences"] // (len(experts) if mode == "standard" else 1))
        assert per_rank * cap["max_context"] * cap["kv_bytes_per_token"] <= free  # every sequence at full context
        assert cap["max_context"] <= model_positions(model.module.config) and cap["max_sequences"] <= MAX_SEQUENCES
        more = serving_capacity(model.ir, model.module.config, experts, mode, 2 * memory, "test", held)
        assert more["max_sequences"] >= cap["max_sequences"] and more["max_context"] >= cap["max_context"]
    else:
        assert free < cap["kv_bytes_per_token"] * 1 or cap["max_context"] == 0


def test_standard_mode_holds_more_sequences_than_coherent(loaded):
    model = loaded["qwen3-30b-a3b"]
    args = (model.ir, model.module.config, [64] * 4)
    held = held_weights(model.ir, load_hardware("h100-sxm"))
    coherent = serving_capacity(*args, "coherent", 80 << 30, "test", held)
    standard = serving_capacity(*args, "standard", 80 << 30, "test", held)
    assert coherent["max_context"] == standard["max_context"] == 40960
    assert standard["max_sequences"] == min(MAX_SEQUENCES, 4 * coherent["max_sequences"]) > coherent["max_sequences"]


def test_compile_records_and_prints_the_capacity(tmp_path):
    model_dir = small_model_dir(tmp_path)
    (tmp_path / "data.txt").write_text("the quick brown fox jumps over the lazy dog. " * 20)
    runner = CliRunner()
    result = runner.invoke(main, ["trace", str(model_dir), "--data", str(tmp_path / "data.txt"), "--out",
                                  str(tmp_path / "t.npz"), "--seq-len", "16", "--quiet"])
    assert result.exit_code == 0, result.output
    result = runner.invoke(main, ["compile", str(model_dir), "--trace", str(tmp_path / "t.npz"), "--gpus-per-node", "2",
                                  "--policy", "contiguous", "--out", str(tmp_path / "b")])
    assert result.exit_code == 0, result.output
    cap = json.loads((tmp_path / "b" / "plan.json").read_text())["communication"]["capacity"]
    assert cap["kv_bytes_per_token"] == 3 * 2 * 32 * 4  # TinyMoE: layers x (K + V) x hidden x fp32 (a float32 checkpoint)
    assert cap["weight_dtypes"] == {"dense": "float32", "experts": "float32"}
    assert cap["max_context"] == 64 and cap["fits"]
    line = next(l for l in result.output.splitlines() if l.startswith("serving capacity:"))
    assert f"{cap['max_sequences']} sequences of up to 64 tokens" in line


def _config_model(name):
    return load_model(str(CONFIGS / f"{name}.json"))


def test_expert_cache_and_serving_capacity_agree_on_the_held_precision():
    """Issue 39: --gpu-memory 24GiB on rtx4090-pcie4 for Qwen3-30B-A3B sized the cache at bf16 and then said
    nothing fits at fp32. Both now count the weights as the ranks hold them (runtime/precision.py: bf16 there):
    the cache the budget sizes leaves the service at least one sequence at the planned length."""
    from moeplan.passes.cost.capacity import MAX_PREFILL_TOKENS
    from moeplan.passes.optimize.offload.cache_plan import OffloadRequest, kv_bytes_per_token, memory_budget
    from moeplan.passes.optimize.offload.rank_caches import runtime_expert_bytes

    model, profile = _config_model("qwen3-30b-a3b"), load_hardware("rtx4090-pcie4")
    gpu = 24 << 30
    req = OffloadRequest(hardware=profile, gpu_memory_bytes=gpu)
    budget = memory_budget(model.ir, kv_bytes_per_token(model.module.config, model.ir), req, prefill_tokens=MAX_PREFILL_TOKENS)
    held = held_weights(model.ir, profile)
    assert held["dtypes"] == {"dense": "bfloat16", "experts": "bfloat16"}  # a bf16 checkpoint stays bf16 on the GPU
    assert budget["expert_bytes"] == held["expert"] == runtime_expert_bytes(model.ir, profile)
    assert budget["dense_bytes"] == held["dense"]
    assert budget["expert_bytes"] == model.ir.moe_stages[0].expert_param_bytes  # bf16 as stored: 2 bytes a weight
    cap = serving_capacity(model.ir, model.module.config, [budget["capacity"]], "standard", gpu, "--gpu-memory", held)
    assert 1000 < budget["capacity"] < 48 * 128 and cap["fits"]
    assert cap["max_context"] >= req.max_length and cap["activation_bytes"] == budget["activation_bytes"]
    assert cap["kv_bytes_per_token"] * req.max_length == budget["kv_cache_bytes"]  # the same KV, at bf16
    # one more expert than the budget's capacity leaves less than the planned KV cache
    over = serving_capacity(model.ir, model.module.config, [budget["capacity"] + 1], "standard", gpu, "--gpu-memory", held)
    assert over["kv_tokens_per_rank"] < req.max_length


@pytest.mark.parametrize("name, ranks, dtype", [("deepseek-v3-fp8", 64, "float8_e4m3fn"), ("mixtral-8x7b", 2, "bfloat16")])
def test_full_size_models_fit_h100s_at_the_checkpoints_precision(name, ranks, dtype):
    """DeepSeek-V3 (FP8 experts with their block scales) on 64 H100s and Mixtral-8x7B (bf16) on 2: every rank
    holds the dense weights and its 1/ranks of the experts, as the runtime holds them on h100-sxm."""
    model = _config_model(name)
    profile = load_hardware("h100-sxm")
    held = held_weights(model.ir, profile)
    assert held["dtypes"]["experts"] == dtype
    per_rank = sum(s.num_experts for s in model.ir.moe_stages) // ranks
    cap = serving_capacity(model.ir, model.module.config, [per_rank] * ranks, "standard", profile.device_memory_bytes,
                           "profile", held)
    assert cap["fits"] and cap["max_sequences"] >= ranks, cap
    assert max(cap["weight_bytes_per_rank"]) < profile.device_memory_bytes
    # at float32 (the runtime before issue 39) neither fits
    fp32 = held_weights(model.ir, load_hardware("cpu-gloo"))
    assert fp32["dtypes"] == {"dense": "float32", "experts": "float32"}
    old = serving_capacity(model.ir, model.module.config, [per_rank] * ranks, "standard", profile.device_memory_bytes,
                           "profile", fp32)
    assert not old["fits"]
