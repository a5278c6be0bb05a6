"""Coherent mode's context exchange (issue 12, item 5): per block the smaller of the hidden state
and what the library's KV cache stores, exact, and priced exactly by the cost model.

Real 2-rank runs of the tiny GQA (1 KV head) and MLA models of examples/hf_tiny/kv_rows.py: the
outputs equal transformers' own model (max |logit diff| <= 1e-4, identical tokens), the measured
bytes equal the cost model's prediction on the run's routing, and the context rows shrink by
exactly (K/V elements + 2) / (hidden + 2) against a run forced to send the hidden state. Every
other architecture's cache path is run in tests/test_runtime_architectures.py (`--context kv`).
"""
import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from moeplan.runtime.ep.context_exchange import HIDDEN, KV, context_plan, kv_elements, model_context_plan
from moeplan.passes.analysis.trace.format import save_trace
from moeplan.planner.commands.compile import compile_cmd
from moeplan.passes.importers.resolve import import_file
from moeplan.planner.pipeline.run import run_modes
from runtime_fixtures import random_trace

REPO = Path(__file__).resolve().parents[1]
kv_rows = import_file(REPO / "examples" / "hf_tiny" / "kv_rows.py")
LAYERS = 2


def _meta(config):
    import transformers

    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config)


def test_the_plan_takes_kv_where_smaller_the_hidden_state_on_a_tie_or_without_a_kv_cache():
    import transformers

    assert model_context_plan(_meta(kv_rows.config("gqa", 2))) == [(KV, 16)] * 2  # 2 x 1 head x 8 < 64
    assert model_context_plan(_meta(kv_rows.config("mla", 2))) == [(KV, 24)] * 2  # latent 16 + rope 8 < 64
    assert model_context_plan(_meta(kv_rows.config("gqa", 2)), HIDDEN) == [(HIDDEN, 64)] * 2
    tie = transformers.Qwen3MoeConfig(**json.loads((REPO / "examples" / "qwen3_moe" / "config.json").read_text()))
    assert model_context_plan(_meta(tie)) == [(HIDDEN, 64)] * 4  # 2 x 2 heads x 16 = 64: a tie keeps the hidden state
    assert model_context_plan(_meta(tie), KV) == [(KV, 64)] * 4
    hybrid = transformers.Qwen3NextConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                          num_key_value_heads=1, head_dim=8, intermediate_size=32, moe_intermediate_size=16,
                                          num_experts=4, num_experts_per_tok=2, linear_num_value_heads=2,
                                          linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
                                          layer_types=["linear_attention", "full_attention"])
    assert model_context_plan(_meta(hybrid)) == [(HIDDEN, 32), (KV, 16)]  # linear attention keeps no K/V cache
    assert kv_elements(None) is None
    with pytest.raises(ValueError, match="context must be one of"):
        context_plan([], 8, "latent")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{name: (plan, {context: {mode: report}})}: each model compiled for 2 ranks (contiguous,
    coherent) and run in both modes; gqa once more with the hidden state forced."""
    root = tmp_path_factory.mktemp("kv_rows")
    prompts = root / "prompts.txt"
    prompts.write_text("The module\nids: 5 6 7 8 9 10\nmixture of experts\n")
    out = {}
    for name in ("gqa", "mla"):
        model_dir = kv_rows.build(name, root / "models", layers=LAYERS)
        save_trace(random_trace(200, LAYERS, 8), root / f"{name}.npz")
        bundle = root / f"bundle-{name}"
        result = CliRunner().invoke(compile_cmd, [str(model_dir), "--trace", str(root / f"{name}.npz"), "--nodes", "1",
                                                  "--gpus-per-node", "2", "--policy", "contiguous", "--mode", "coherent",
                                                  "--out", str(bundle), "--quiet"])
        assert result.exit_code == 0, result.output
        reports = {"auto": run_modes(str(bundle), 2, str(prompts), 3, ("coherent", "standard"), True, None, 600)}
        if name == "gqa":
            reports[HIDDEN] = run_modes(str(bundle), 2, str(prompts), 3, ("coherent",), True, None, 600, context=HIDDEN)
        out[name] = (json.loads((bundle / "plan.json").read_text()), reports)
    return out


@pytest.mark.slow  # the module's torchrun runs; test_serving_engine's qwen2_moe coherent kv run keeps the path
@pytest.mark.parametrize("name, elements", [("gqa", 16), ("mla", 24)])
def test_coherent_runs_send_kv_exactly_and_as_predicted(runs, name, elements):
    plan, reports = runs[name]
    assert plan["predicted"]["cost"]["context"] == [["kv", elements]] * LAYERS
    for mode, r in reports["auto"].items():
        assert r["verified"], (mode, r["max_abs_logit_diff"], r["tokens_match"])
        assert r["bytes_match_prediction"] and r["context_matches_prediction"], mode
        assert r["predicted_total_bytes_per_token"] == r["total_bytes_per_token"] > 0
    coherent = reports["auto"]["coherent"]
    assert coherent["context_elements"] == [elements] * LAYERS
    context = [l["context_bytes"] for l in coherent["per_layer"]]
    assert context[0] == 0 and context[1] > 0 and context[1] % (4 * (elements + 2)) == 0


@pytest.mark.slow  # the module's torchrun runs; test_serving_engine's qwen2_moe coherent kv run keeps the path
def test_the_kv_rows_shrink_the_context_exactly_against_the_hidden_state(runs):
    _, reports = runs["gqa"]
    kv, hidden = reports["auto"]["coherent"], reports[HIDDEN]["coherent"]
    assert hidden["verified"] and hidden["bytes_match_prediction"] and hidden["context_elements"] == [64] * LAYERS
    assert kv["texts"] == hidden["texts"]
    for a, b in zip(kv["per_layer"], hidden["per_layer"]):
        assert a["context_bytes"] * (64 + 2) == b["context_bytes"] * (16 + 2)
        assert (a["dispatch_bytes"], a["merge_bytes"]) == (b["dispatch_bytes"], b["merge_bytes"])
    assert kv["total_bytes_per_token"] < hidden["total_bytes_per_token"]


def test_the_kv_hook_wraps_the_cache_under_the_keyword_the_library_passes():
    """transformers 5.24 hands an attention module its cache as `cache`, earlier 5.x releases as
    `past_key_values`: the hook swaps the exchanging proxy in under the same keyword."""
    from types import SimpleNamespace

    from moeplan.runtime.ep.context_exchange import CACHE_KWARGS, ContextExchange

    hook = ContextExchange(SimpleNamespace(replicated=False), [(KV, 16)])._kv_input(0)
    assert set(CACHE_KWARGS) == {"cache", "past_key_values"}
    for name in CACHE_KWARGS:
        args, kwargs = hook(None, ("h",), {name: SimpleNamespace(layers=name), "position_ids": 1})
        assert args == ("h",) and set(kwargs) == {name, "position_ids"}
        assert type(kwargs[name]).__name__ == "_ExchangingCache" and kwargs[name].layers == name
    with pytest.raises(RuntimeError, match="without a KV cache"):
        hook(None, (), {"cache": None, "past_key_values": None})
