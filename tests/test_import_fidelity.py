"""Import fidelity: configs counted as transformers counts them, storage as checkpoints store it.

Tiny configs of the architectures that were miscounted (tied embeddings on meta, DBRX's flattened
experts, JetMoE's attention experts), quantized storage, float8 dtypes, multimodal notes and
one-line refusals, through `load_model` and the real CLI.
"""
import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
from click.testing import CliRunner
from transformers import AutoModelForCausalLM
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from moeplan.planner.cli import main
from moeplan.core.errors import UserError
from moeplan.passes.importers import load_model
from moeplan.passes.importers.resolve import import_file

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "examples" / "configs"
bench = import_file(ROOT / "benchmarks" / "import_fidelity.py")


JSON_ONLY = ("quantization_config", "torch_dtype", "dtype")


def write_config(tmp_path, model_type, **extra) -> tuple:
    """(config.json path, the same model with weights) for a tiny `model_type` model.

    Storage keys (`quantization_config`, dtypes) go into the file only: the model with weights
    is the float32 reference whose parameters are counted.
    """
    shape = {k: v for k, v in extra.items() if k not in JSON_ONLY}
    config = CONFIG_MAPPING[model_type](**{**bench.BASE, **bench.TINY.get(model_type, {}), **shape})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    data = config.to_dict()
    data.update(extra)
    path = tmp_path / f"{model_type}.json"
    path.write_text(json.dumps(data))
    return path, model


def numel(model) -> int:
    return sum(p.numel() for p in model.parameters())


def test_tied_embeddings_count_once_on_meta(tmp_path):
    path, model = write_config(tmp_path, "granitemoe", tie_word_embeddings=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    loaded = load_model(str(path))
    assert not loaded.has_weights
    assert loaded.ir.total_params == numel(model)
    head = loaded.ir.stages[-1]
    assert head.kind == "head" and head.params == 0 and head.flops_per_token == 2 * 64 * 32


def test_dbrx_flattened_experts_are_an_moe_layer(tmp_path):
    path, model = write_config(tmp_path, "dbrx")
    ir = load_model(str(path)).ir
    assert ir.total_params == numel(model)
    assert [s.name for s in ir.moe_stages] == ["transformer.blocks.0.ffn", "transformer.blocks.1.ffn"]
    moe = ir.moe_stages[0]
    # w1, v1, w2: each [E x 16, 32]; one expert is a 16-row slice of each.
    assert (moe.num_experts, moe.top_k, moe.shared_experts) == (4, 2, 0)
    assert moe.expert_params == 3 * 16 * 32 and moe.router_params == 4 * 32


def test_jetmoe_attention_experts_stay_attention_and_output_weights_are_experts(tmp_path):
    path, model = write_config(tmp_path, "jetmoe")
    ir = load_model(str(path)).ir
    assert ir.total_params == numel(model)
    assert len(ir.moe_stages) == 2  # the MLP experts only, not the attention experts
    moe = ir.moe_stages[0]
    mlp = model.model.layers[0].mlp
    per_expert = (mlp.input_linear.weight.numel() + mlp.output_linear.weight.numel()) // 4
    assert (moe.expert_params, moe.shared_experts, moe.num_experts) == (per_expert, 0, 4)
    attn = next(s for s in ir.stages if s.name == "model.layers.0.self_attention")
    experts = model.model.layers[0].self_attention.experts
    one = (experts.input_linear.weight.numel() + experts.output_linear.weight.numel()) // 4
    assert attn.kind == "attention" and attn.inactive_params == (4 - 2) * one
    assert attn.flops_per_token == 2 * (attn.params - attn.inactive_params)


def test_more_experts_per_token_than_experts_is_refused_in_one_line(tmp_path):
    path, _ = write_config(tmp_path, "mixtral", num_experts_per_tok=6)
    with pytest.raises(UserError, match="picks 6 experts per token but has only 4"):
        load_model(str(path))
    result = CliRunner().invoke(main, ["inspect", str(path)])
    assert result.exit_code == 2 and result.stdout == ""
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1


def test_active_parameters_in_both_conventions():
    """gpt-oss-20b: the card's 3.61B leaves the input embedding out; 4.19B keeps it."""
    ir = load_model(str(CONFIGS / "gpt-oss-20b.json")).ir
    embedding = 201088 * 2880
    assert ir.active_params - ir.active_params_excluding_embedding == embedding
    assert round(ir.active_params_excluding_embedding / 1e9, 2) == 3.61
    assert round(ir.active_params / 1e9, 2) == 4.19


def test_mxfp4_experts_are_planned_at_their_stored_size():
    ir = load_model(str(CONFIGS / "gpt-oss-120b.json")).ir
    assert ir.quantization == "mxfp4"
    moe = ir.moe_stages[0]
    weights = 3 * 2880 * 2880  # gate_up [D, 2I] + down [I, D]; biases stay bf16
    biases = 2 * 2880 + 2880
    assert moe.expert_params == weights + biases
    assert moe.expert_param_bytes == int(weights * 4.25 / 8 + 2 * biases)
    assert 60.5 < ir.total_param_bytes / 2**30 < 61.0  # the published checkpoint: 60.8 GiB
    attn = next(s for s in ir.stages if s.kind == "attention")
    assert attn.param_bytes == 2 * attn.params  # modules_to_not_convert: attention stays bf16


@pytest.mark.parametrize("qconfig, bits", [
    ({"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [16, 16], "activation_scheme": "dynamic"},
     8 + 32 / 256),
    ({"quant_method": "gptq", "bits": 4, "group_size": 16, "desc_act": False, "sym": True}, None),
    ({"quant_method": "awq", "bits": 4, "group_size": 16, "zero_point": True, "version": "gemm"}, None),
])
def test_quantized_linear_weights_and_full_precision_embeddings(tmp_path, qconfig, bits):
    path, model = write_config(tmp_path, "qwen3_moe", quantization_config=qconfig, torch_dtype="bfloat16")
    ir = load_model(str(path)).ir
    assert ir.total_params == numel(model) and ir.quantization.startswith(qconfig["quant_method"])
    embed = ir.stages[0]
    assert embed.kind == "embedding" and embed.param_bytes == 2 * embed.params
    moe = ir.moe_stages[0]
    d, i = 32, 16
    if bits is None:  # int4 values + fp16 scale and 4-bit zero per 16 inputs (+ int32 g_idx for GPTQ)
        gate_up = 2 * i * d / 2 + 2 * i * (d // 16) * 2.5 + (4 * d if qconfig["quant_method"] == "gptq" else 0)
        down = d * i / 2 + d * (i // 16) * 2.5 + (4 * i if qconfig["quant_method"] == "gptq" else 0)
        assert moe.expert_param_bytes == int(gate_up + down)
    else:
        assert moe.expert_param_bytes == int(3 * d * i * bits / 8)
    assert moe.param_bytes - moe.num_experts * moe.expert_param_bytes >= 2 * moe.router_params  # router bf16


def test_float8_dtype_config_builds_on_meta(tmp_path):
    path, model = write_config(tmp_path, "mixtral", torch_dtype="float8_e4m3fn", dtype="float8_e4m3fn")
    loaded = load_model(str(path))
    assert loaded.ir.total_params == numel(model)
    assert loaded.ir.total_param_bytes == loaded.ir.total_params  # one byte each
    assert loaded.ir.quantization == "float8_e4m3fn"


def test_unmodelled_quantization_is_noted_not_ignored(tmp_path):
    path, _ = write_config(tmp_path, "mixtral", quantization_config={"quant_method": "bitsandbytes"})
    loaded = load_model(str(path))
    assert any("'bitsandbytes' is not modelled" in n for n in loaded.notes)


def test_multimodal_config_says_what_is_left_out():
    result = CliRunner().invoke(main, ["inspect", str(CONFIGS / "llama-4-scout-17b-16e.json"), "--json", "--summary"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert "ir" not in out and out["moe_layers"] == 48
    (note,) = out["notes"]
    assert "vision" in note and "871,932,416 parameters" in note


def test_inspect_summary_prints_no_stage_rows():
    result = CliRunner().invoke(main, ["inspect", str(CONFIGS / "gpt-oss-20b.json"), "--summary"])
    assert result.exit_code == 0, result.output
    assert "model.layers.3.mlp" not in result.stdout and "99 stages" in result.stdout
    assert "3.61B params without the input embedding (model-card convention), 4.19B with it" in result.stdout
    assert "mxfp4 storage" in result.stdout


def test_trace_help_lists_the_record_options():
    result = CliRunner().invoke(main, ["trace", "--help"])
    assert result.exit_code == 0
    for option in ("--data", "--out", "--max-tokens", "--seq-len", "import", "stats"):
        assert option in result.stdout


@pytest.mark.parametrize("stem", ["granite-3.0-3b-a800m", "dbrx", "jetmoe-8b", "hunyuan-a13b"])
def test_full_size_totals_equal_transformers_count(stem):
    data = json.loads((CONFIGS / f"{stem}.json").read_text())
    _, theirs = bench.transformers_count(data)
    assert load_model(str(CONFIGS / f"{stem}.json")).ir.total_params == theirs


from hypothesis import given, settings, strategies as st  # noqa: E402

from moeplan.passes.importers.quantization import Quantization  # noqa: E402

dims = st.integers(min_value=1, max_value=3000)


@settings(max_examples=60, deadline=None)
@given(experts=st.integers(1, 8), out=dims, inp=dims, block=st.sampled_from([32, 64, 128]))
def test_stored_bytes_bound_the_payload(experts, out, inp, block):
    """Scales only add: every scheme stores at least its payload bits and at most one scale (and
    zero point) per block or group more."""
    shape, n = (experts, out, inp), experts * out * inp
    fp8 = Quantization({"quant_method": "fp8", "weight_block_size": [block, block]}, "t").stored_bytes(shape)
    assert n <= fp8 <= n + 4 * experts * (-(-out // block)) * (-(-inp // block))
    mx = Quantization({"quant_method": "mxfp4"}, "t").stored_bytes(shape)
    assert mx == n * 4.25 / 8
    awq = Quantization({"quant_method": "awq", "bits": 4, "group_size": block}, "t").stored_bytes(shape)
    assert n / 2 <= awq <= n / 2 + experts * out * (-(-inp // block)) * 2.5
    gptq = Quantization({"quant_method": "gptq", "bits": 4, "group_size": block}, "t").stored_bytes(shape)
    assert gptq == awq + 4 * experts * inp  # GPTQ adds g_idx, one int32 per input
