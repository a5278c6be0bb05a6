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

from moeplan.passes.cost.capacity import (MAX_SEQUENCES, RUNTIME_BYTES, model_positions,
                                              runtime_kv_bytes_per_token, serving_capacity)
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
        expected = c["num_hidden_layers"] * per_layer * RUNTIME_BYTES
        assert runtime_kv_bytes_per_token(model.module.config, model.ir) == expected, name
        assert model_positions(model.module.config) == c["max_position_embeddings"]


@settings(max_examples=60, deadline=None)
@given(memory_gib=st.floats(0.5, 4096), experts=st.lists(st.integers(0, 300), min_size=1, max_size=8),
       mode=st.sampled_from(["coherent", "standard"]))
def test_what_the_capacity_admits_fits_the_memory_it_was_given(loaded, memory_gib, experts, mode):
    model = loaded["mixtral-8x7b"]
    memory = int(memory_gib * (1 << 30))
    cap = serving_capacity(model.ir, model.module.config, experts, mode, memory, "test")
    assert cap["fits"] == (cap["max_sequences"] > 0)
    free = min(memory - w - cap["activation_bytes"] - cap["reserve_bytes"] for w in cap["weight_bytes_per_rank"])
    if cap["fits"]:
        per_rank = -(-cap["max_sequences"] // (len(experts) if mode == "standard" else 1))
        assert per_rank * cap["max_context"] * cap["kv_bytes_per_token"] <= free  # every sequence at full context
        assert cap["max_context"] <= model_positions(model.module.config) and cap["max_sequences"] <= MAX_SEQUENCES
        more = serving_capacity(model.ir, model.module.config, experts, mode, 2 * memory, "test")
        assert more["max_sequences"] >= cap["max_sequences"] and more["max_context"] >= cap["max_context"]
    else:
        assert free < cap["kv_bytes_per_token"] * 1 or cap["max_context"] == 0


def test_standard_mode_holds_more_sequences_than_coherent(loaded):
    model = loaded["qwen3-30b-a3b"]
    args = (model.ir, model.module.config, [64] * 4)
    coherent = serving_capacity(*args, "coherent", 80 << 30, "test")
    standard = serving_capacity(*args, "standard", 80 << 30, "test")
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
    assert cap["kv_bytes_per_token"] == 3 * 2 * 32 * RUNTIME_BYTES  # TinyMoE: layers x (K + V) x hidden x fp32
    assert cap["max_context"] == 64 and cap["fits"]
    line = next(l for l in result.output.splitlines() if l.startswith("serving capacity:"))
    assert f"{cap['max_sequences']} sequences of up to 64 tokens" in line
