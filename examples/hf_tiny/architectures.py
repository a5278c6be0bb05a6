"""Tiny random-weight Hugging Face MoE models, one per architecture moeplan deploys.

Each is the architecture's own transformers config at toy size (hidden 32, 8 routed experts,
vocabulary 320 so that the byte fallback's ids fit), built with a fixed seed and saved with
`save_pretrained`, so every build is byte-identical. Tests and `benchmarks/architectures.py`
build them; nothing is downloaded.

Routers that hand their top-k over unsorted by weight are built so that they do: DeepSeek-V3 and
GLM-4.5 take `torch.topk(..., sorted=False)` (top-4 here, where the order comes out unsorted),
and DeepSeek-V3, GLM-4.5 and ERNIE-4.5 choose by score + `e_score_correction_bias` but weigh by
the score alone, so their router biases are set at random (a trained model's are not zero).
Phi-3.5-MoE's sparsemixer also returns some rows unsorted.

    python examples/hf_tiny/architectures.py --out build/hf_tiny [--arch qwen3_moe ...]
"""
from __future__ import annotations

import argparse
from pathlib import Path

COMMON = dict(vocab_size=320, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=64, tie_word_embeddings=False,
              bos_token_id=1, eos_token_id=2, pad_token_id=0)

# model_type -> (config class name, keyword arguments beyond COMMON)
CONFIGS = {
    "mixtral": ("MixtralConfig", dict(num_hidden_layers=2, intermediate_size=16, num_local_experts=8, num_experts_per_tok=2)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(num_hidden_layers=3, intermediate_size=24, moe_intermediate_size=16, num_experts=8,
                                         num_experts_per_tok=2, shared_expert_intermediate_size=16, mlp_only_layers=[1])),
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_hidden_layers=2, intermediate_size=32, moe_intermediate_size=16, head_dim=8,
                                         num_experts=8, num_experts_per_tok=2, norm_topk_prob=True)),
    "qwen3_next": ("Qwen3NextConfig", dict(num_hidden_layers=2, intermediate_size=32, moe_intermediate_size=16, head_dim=8,
                                           num_experts=8, num_experts_per_tok=2, shared_expert_intermediate_size=16,
                                           linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8,
                                           linear_value_head_dim=8, linear_conv_kernel_dim=4,
                                           layer_types=["linear_attention", "full_attention"])),
    "olmoe": ("OlmoeConfig", dict(num_hidden_layers=2, intermediate_size=16, num_experts=8, num_experts_per_tok=2)),
    "deepseek_v2": ("DeepseekV2Config", dict(num_hidden_layers=3, intermediate_size=48, moe_intermediate_size=16,
                                             num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1,
                                             num_experts_per_tok=2, first_k_dense_replace=1, n_group=2, topk_group=1,
                                             topk_method="group_limited_greedy", kv_lora_rank=16, q_lora_rank=None,
                                             qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8)),
    "deepseek_v3": ("DeepseekV3Config", dict(num_hidden_layers=3, intermediate_size=48, moe_intermediate_size=16,
                                             num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1,
                                             num_experts_per_tok=4, first_k_dense_replace=1, n_group=2, topk_group=2,
                                             kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
                                             v_head_dim=8, routed_scaling_factor=2.5)),
    "gpt_oss": ("GptOssConfig", dict(num_hidden_layers=2, intermediate_size=16, head_dim=8, num_local_experts=8,
                                     num_experts_per_tok=2, sliding_window=4,
                                     layer_types=["sliding_attention", "full_attention"])),
    "glm4_moe": ("Glm4MoeConfig", dict(num_hidden_layers=3, intermediate_size=48, moe_intermediate_size=16, head_dim=8,
                                       n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=4,
                                       first_k_dense_replace=1, n_group=1, topk_group=1)),
    "phimoe": ("PhimoeConfig", dict(num_hidden_layers=2, intermediate_size=16, num_local_experts=8, num_experts_per_tok=2)),
    "granitemoe": ("GraniteMoeConfig", dict(num_hidden_layers=2, intermediate_size=16, num_local_experts=8,
                                            num_experts_per_tok=2, residual_multiplier=0.5, embedding_multiplier=2.0,
                                            logits_scaling=2.0, attention_multiplier=0.2)),
    "ernie4_5_moe": ("Ernie4_5_MoeConfig", dict(num_hidden_layers=2, intermediate_size=48, moe_intermediate_size=16,
                                                moe_num_experts=8, moe_k=2, moe_num_shared_experts=1,
                                                moe_layer_start_index=0)),
    "hunyuan_v1_moe": ("HunYuanMoEV1Config", dict(num_hidden_layers=2, intermediate_size=16, head_dim=8, num_experts=8,
                                                  moe_topk=2)),
    "llama4_text": ("Llama4TextConfig", dict(num_hidden_layers=2, intermediate_size=16, intermediate_size_mlp=32,
                                             head_dim=8, num_local_experts=8, num_experts_per_tok=1,
                                             interleave_moe_layer_step=1, attention_chunk_size=16)),
    "dbrx": ("DbrxConfig", dict(d_model=32, n_heads=4, n_layers=2, max_seq_len=64,
                                attn_config={"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0}, ffn_config={"ffn_hidden_size": 16, "moe_num_experts": 8,
                                                                           "moe_top_k": 2})),
    "jetmoe": ("JetMoeConfig", dict(num_hidden_layers=2, kv_channels=8, intermediate_size=16, num_local_experts=8,
                                    num_experts_per_tok=2)),
}
ARCHITECTURES = tuple(CONFIGS)
# Configurations that once failed a verified run, built as the architectures above (issue 32: DeepSeek-V2's
# greedy top-k is unsorted, so the runtime's primary slot was not the token's heaviest expert)
VARIANTS = {
    "deepseek_v2_greedy": ("DeepseekV2Config", dict(num_hidden_layers=4, intermediate_size=48, moe_intermediate_size=16,
                                                    num_key_value_heads=4, n_routed_experts=16, n_shared_experts=2,
                                                    num_experts_per_tok=4, first_k_dense_replace=1, n_group=1,
                                                    topk_group=1, topk_method="greedy", norm_topk_prob=False,
                                                    kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
                                                    qk_nope_head_dim=8, v_head_dim=8)),
}
DROP_FOR = {"dbrx": ("hidden_size", "num_attention_heads", "num_key_value_heads", "max_position_embeddings")}


def build(arch: str, out: Path, seed: int = 0) -> Path:
    """Save a tiny seeded `arch` model (config.json + model.safetensors) into out/arch; returns the directory."""
    import torch
    import transformers

    cls_name, extra = CONFIGS[arch] if arch in CONFIGS else VARIANTS[arch]
    kwargs = {k: v for k, v in COMMON.items() if k not in DROP_FOR.get(arch, ())}
    config = getattr(transformers, cls_name)(**{**kwargs, **extra})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for module in model.modules():
            bias = getattr(module, "e_score_correction_bias", None)
            if isinstance(bias, torch.Tensor):
                bias.copy_(torch.rand(bias.shape) * 0.2)
    directory = Path(out) / arch
    model.save_pretrained(directory)
    return directory


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--arch", nargs="*", default=list(ARCHITECTURES), choices=ARCHITECTURES + tuple(VARIANTS))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    for arch in args.arch:
        print(build(arch, Path(args.out), args.seed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
