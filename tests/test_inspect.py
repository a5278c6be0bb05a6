"""`moeplan inspect` through the real CLI: table and --json figures, and one-line errors with exit 2."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from moeplan.planner.cli import main

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "tiny_moe"
SUMMARY_KEYS = {
    "model", "has_weights", "name", "architecture", "source_format", "dtype", "hidden_size", "vocab_size",
    "stages", "moe_layers", "num_experts", "top_k", "shared_experts", "uniform_moe_layers", "total_params",
    "total_param_bytes", "expert_params", "expert_param_bytes", "routed_expert_params",
    "routed_expert_param_bytes", "dense_params", "dense_param_bytes", "active_params_per_token",
    "active_params_per_token_excluding_embedding", "quantization", "notes", "flops_per_token", "ir",
}


def invoke(*args):
    return CliRunner().invoke(main, ["inspect", *args])


def test_json_summary_of_the_example():
    cfg = json.loads((EXAMPLE / "config.json").read_text())
    layers, experts, k, d = cfg["num_layers"], cfg["num_experts"], cfg["top_k"], cfg["hidden_size"]
    result = invoke(str(EXAMPLE), "--json")
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert set(out) == SUMMARY_KEYS
    assert (out["moe_layers"], out["num_experts"], out["top_k"]) == (layers, experts, k)
    assert out["shared_experts"] == cfg.get("shared_experts", 0)
    assert out["total_param_bytes"] == 4 * out["total_params"]  # float32
    expert = 3 * d * cfg["expert_hidden"]
    assert (out["expert_params"], out["expert_param_bytes"]) == (expert, 4 * expert)
    assert out["routed_expert_params"] == layers * experts * expert
    assert out["dense_params"] == out["total_params"] - out["routed_expert_params"]
    assert out["dense_param_bytes"] == out["total_param_bytes"] - out["routed_expert_param_bytes"]
    assert out["active_params_per_token"] == out["dense_params"] + layers * k * expert
    embeddings = sum(s["params"] for s in out["ir"]["stages"] if s.get("kind") == "embedding")
    assert out["active_params_per_token_excluding_embedding"] == out["active_params_per_token"] - embeddings
    assert out["quantization"] == "" and out["notes"] == []
    assert out["flops_per_token"] == sum(s["flops_per_token"] for s in out["ir"]["stages"])
    assert out["ir"]["stages"][5]["name"] == "blocks.0.moe" and out["ir"]["stages"][5]["type"] == "moe"


def test_json_output_is_stable():
    first, second = invoke(str(EXAMPLE), "--json"), invoke(str(EXAMPLE), "--json")
    assert first.stdout == second.stdout


def test_table_lists_stages_and_totals():
    result = invoke(str(EXAMPLE))
    assert result.exit_code == 0, result.output
    text = result.stdout
    cfg = json.loads((EXAMPLE / "config.json").read_text())
    routed = f"{cfg['num_layers']} x {cfg['num_experts']} routed experts, top-{cfg['top_k']}"
    for needle in ("blocks.0.moe", "final_norm", "attention", routed, "active/token"):
        assert needle in text


@pytest.mark.parametrize("make, message", [
    (lambda d: d / "nope", "not found"),
    (lambda d: (d / "bad.json").write_text("{oops") and d / "bad.json", "is not valid JSON"),
    (lambda d: (d / "loader").mkdir() or (d / "loader" / "config.json").write_text(
        '{"moeplan_loader": "gone.py:load"}') and d / "loader", "model code"),
    (lambda d: "no_such_module.sub:factory", "cannot import 'no_such_module.sub'"),
    (lambda d: "torch.nn:Sequential", "has no Mixture-of-Experts layer; moeplan plans MoE models only"),
])
def test_bad_models_exit_2_with_one_line(tmp_path, make, message):
    result = invoke(str(make(tmp_path)))
    assert result.exit_code == 2
    assert result.stdout == ""
    assert result.stderr.startswith("error: ") and message in result.stderr
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr


def test_deepseek_v3_config_acceptance_figures():
    result = invoke(str(ROOT / "examples/configs/deepseek-v3.json"), "--json")
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert (out["moe_layers"], out["num_experts"], out["shared_experts"], out["top_k"]) == (58, 256, 1, 8)
    assert 670e9 < out["total_params"] < 672e9 and out["has_weights"] is False


def test_real_process_fails_cleanly():
    """The console entry point itself, in its own process: one line, exit 2, no traceback."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    exe = [sys.executable, "-m", "moeplan.planner.cli", "inspect"]
    bad = subprocess.run([*exe, str(ROOT / "examples/configs/missing.json")],
                         capture_output=True, text=True, env=env, timeout=120)
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.startswith("error: model ") and bad.stderr.count("\n") == 1
