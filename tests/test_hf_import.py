"""Hugging Face MoE architectures: fused experts recognised by structure, configs built on meta at full size."""
import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from moeplan.core.errors import UserError
from moeplan.passes.importers import load_model
from moeplan.passes.importers.torch_module import import_module

CONFIGS = Path(__file__).resolve().parents[1] / "examples" / "configs"
BASE = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, eos_token_id=1, bos_token_id=0, pad_token_id=None)
D, MOE_I = 32, 16

# model_type -> (extra config, experts, top-k, shared-expert equivalents, routed expert params)
TINY = {
    "mixtral": (dict(num_local_experts=4, num_experts_per_tok=2), 4, 2, 0, 3 * D * 48),
    "qwen2_moe": (dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=MOE_I,
                       shared_expert_intermediate_size=2 * MOE_I, decoder_sparse_step=1), 6, 2, 2, 3 * D * MOE_I),
    "qwen3_moe": (dict(num_experts=6, num_experts_per_tok=3, moe_intermediate_size=MOE_I, head_dim=8),
                  6, 3, 0, 3 * D * MOE_I),
    "olmoe": (dict(num_experts=4, num_experts_per_tok=2), 4, 2, 0, 3 * D * 48),
    "deepseek_v3": (dict(num_hidden_layers=3, first_k_dense_replace=1, n_routed_experts=8, n_shared_experts=1,
                         num_experts_per_tok=2, moe_intermediate_size=MOE_I, n_group=2, topk_group=1,
                         q_lora_rank=16, kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
                         num_key_value_heads=4), 8, 2, 1, 3 * D * MOE_I),
}


def tiny_model(model_type):
    torch.manual_seed(0)
    config = CONFIG_MAPPING[model_type](**{**BASE, **TINY[model_type][0]})
    return AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize("model_type", sorted(TINY))
def test_tiny_hf_moe_models_import(model_type):
    _, experts, top_k, shared, expert_params = TINY[model_type]
    model = tiny_model(model_type)
    ir = import_module(model)
    assert ir.total_params == sum(p.numel() for p in model.parameters())
    assert ir.total_param_bytes == sum(p.numel() * p.element_size() for p in model.parameters())
    assert (ir.hidden_size, ir.vocab_size) == (D, 64)
    layers = model.config.num_hidden_layers
    dense_layers = getattr(model.config, "first_k_dense_replace", 0)
    assert len(ir.moe_stages) == layers - dense_layers
    for s in ir.moe_stages:
        assert (s.num_experts, s.top_k, s.shared_experts, s.expert_params) == (experts, top_k, shared, expert_params)
        assert s.router_params == experts * D
        block = model.get_submodule(s.name)
        assert s.params == sum(p.numel() for p in block.parameters())
        assert s.shared_expert_params == s.params - s.router_params - experts * expert_params
    kinds = [s.kind for s in ir.stages]
    assert kinds[0] == "embedding" and kinds[-1] == "head" and kinds.count("attention") == layers
    assert kinds.count("mlp") == dense_layers
    first_moe = ir.moe_stages[0]
    assert first_moe.name == f"model.layers.{dense_layers}.mlp"
    # Forward order, as the decoder layer runs them (registration order puts the norms last).
    assert [s.name for s in ir.stages[1:5]] == [
        "model.layers.0.input_layernorm", "model.layers.0.self_attn",
        "model.layers.0.post_attention_layernorm", "model.layers.0.mlp"]
    assert [s.name for s in ir.stages[-2:]] == ["model.norm", "lm_head"]


def test_deepseek_mla_attention_and_dense_layers_are_whole_modules():
    model = tiny_model("deepseek_v3")
    ir = import_module(model)
    by_name = {s.name: s for s in ir.stages}
    attn = model.model.layers[0].self_attn
    assert by_name["model.layers.0.self_attn"].params == sum(p.numel() for p in attn.parameters())
    assert by_name["model.layers.0.mlp"].kind == "mlp"
    moe = by_name["model.layers.1.mlp"]
    assert moe.shared_expert_params == 3 * D * MOE_I  # one shared expert of the routed width


def test_hf_directory_with_safetensors_loads_weights(tmp_path):
    model = tiny_model("qwen3_moe")
    model.save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path))
    assert loaded.has_weights and loaded.ir.source_format == "hf"
    theirs = loaded.module.state_dict()
    for name, tensor in model.state_dict().items():
        assert torch.equal(theirs[name], tensor), name
    assert loaded.ir == import_module(model, name=loaded.ir.name)
    only_config = load_model(str(tmp_path / "config.json"))  # the file alone: meta, same figures
    assert not only_config.has_weights and only_config.ir == loaded.ir


def test_hf_directory_without_weights_is_built_on_meta(tmp_path):
    model = tiny_model("mixtral")
    model.config.save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path))
    assert not loaded.has_weights
    assert all(p.is_meta for p in loaded.module.parameters())
    assert loaded.ir.total_params == sum(p.numel() for p in model.parameters())


def test_deepseek_v3_full_size_from_config():
    loaded = load_model(str(CONFIGS / "deepseek-v3.json"))
    ir = loaded.ir
    assert not loaded.has_weights and ir.dtype == "bfloat16" and ir.name == "deepseek-v3"
    assert all(p.is_meta for p in loaded.module.parameters())
    assert len(ir.moe_stages) == 58
    assert {(s.num_experts, s.top_k, s.shared_experts) for s in ir.moe_stages} == {(256, 8, 1)}
    assert ir.moe_stages[0].name == "model.layers.3.mlp"
    assert [s.kind for s in ir.stages if s.name.endswith(".mlp")][:4] == ["mlp", "mlp", "mlp", "moe"]
    # HF builds no multi-token-prediction module: this is the 671B main model.
    assert ir.total_params == sum(p.numel() for p in loaded.module.parameters()) == 671_026_404_352
    # bf16 throughout, except that transformers 5.24 keeps the routers' weights in float32 as the
    # library holds and saves them (modeling_deepseek_v3.py: `_keep_in_fp32_modules_strict`)
    fp32 = sum(p.numel() for p in loaded.module.parameters() if p.dtype == torch.float32)
    assert fp32 in (0, 58 * 256 * 7168)
    assert ir.total_param_bytes == 2 * ir.total_params + 2 * fp32
    expert = ir.moe_stages[0]
    assert expert.expert_params == 3 * 7168 * 2048 and expert.router_params == 256 * 7168


def test_mixtral_8x7b_full_size_from_config():
    ir = load_model(str(CONFIGS / "mixtral-8x7b.json")).ir
    assert len(ir.moe_stages) == 32
    assert {(s.num_experts, s.top_k, s.shared_experts) for s in ir.moe_stages} == {(8, 2, 0)}
    assert ir.total_params == 46_702_792_704  # ~46.7e9
    assert ir.moe_stages[0].expert_params == 3 * 4096 * 14336


def test_dense_hf_model_is_refused(tmp_path):
    cfg = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
           "num_hidden_layers": 2, "num_attention_heads": 4}
    (tmp_path / "llama.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError, match="has no Mixture-of-Experts layer; moeplan plans MoE models only"):
        load_model(str(tmp_path / "llama.json"))


def test_bad_dtype_in_config_is_a_user_error(tmp_path):
    cfg = json.loads((CONFIGS / "mixtral-8x7b.json").read_text())
    cfg["dtype"] = "float17"
    (tmp_path / "m.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError, match="unknown dtype 'float17'"):
        load_model(str(tmp_path / "m.json"))


@pytest.mark.parametrize("model_type", ["gpt_oss", "ernie4_5_moe", "qwen3_next"])
def test_other_architectures_are_recognised_by_structure(model_type):
    """Routers with biases or score corrections and fused experts with biases, at default full size."""
    config = CONFIG_MAPPING[model_type]()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    ir = import_module(model, config=config)
    experts = getattr(config, "num_local_experts", None) or config.num_experts
    assert ir.moe_stages and {s.num_experts for s in ir.moe_stages} == {experts}
    assert {s.top_k for s in ir.moe_stages} == {config.num_experts_per_tok}
    assert ir.total_params == sum(p.numel() for p in model.parameters())
