"""Tiny random-weight transformers MoE models whose K/V row is smaller than their hidden state.

Coherent mode sends, per block, the smaller of the hidden state and what the library's KV cache
stores (`runtime/ep/context_exchange.py`). These models make that difference visible:
* `gqa`: Qwen3-MoE, hidden 64, 8 query heads and 1 KV head of 8: K + V = 16 elements (4x smaller);
* `mla`: DeepSeek-V3 with multi-head latent attention, hidden 64, kv_lora_rank 16 + rotated key 8
  = 24 elements (the cache holds the latent, not per-head K/V).
(examples/qwen3_moe, 4 heads and 2 KV heads of 16, has K + V = 64 = its hidden size: a tie, so
it keeps the hidden state.) Built with a fixed seed and `save_pretrained` next to
examples/qwen3_moe's tokenizer, so every build is byte-identical; nothing is downloaded.

    python examples/hf_tiny/kv_rows.py --out build/kv_rows [--name gqa mla] [--layers 4]
"""
from __future__ import annotations

import argparse
import shutil
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SHARED = dict(vocab_size=384, hidden_size=64, max_position_embeddings=256, tie_word_embeddings=False,
              bos_token_id=0, eos_token_id=0, pad_token_id=0, num_experts_per_tok=2, intermediate_size=128,
              moe_intermediate_size=64)
# name -> (transformers config class, keyword arguments beyond SHARED)
MODELS = {
    "gqa": ("Qwen3MoeConfig", dict(num_attention_heads=8, num_key_value_heads=1, head_dim=8, num_experts=8,
                                   norm_topk_prob=True)),
    "mla": ("DeepseekV3Config", dict(num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=0,
                                     first_k_dense_replace=0, n_group=1, topk_group=1, kv_lora_rank=16, q_lora_rank=None,
                                     qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, routed_scaling_factor=1.0)),
}


def config(name: str, layers: int = 4):
    """The transformers config object of `MODELS[name]` with `layers` decoder blocks."""
    import transformers

    cls_name, extra = MODELS[name]
    return getattr(transformers, cls_name)(**SHARED, **extra, num_hidden_layers=layers)


def build(name: str, out: Path, layers: int = 4, seed: int = 0) -> Path:
    """Save the seeded model (config.json, model.safetensors, tokenizer.json) in out/name; returns the directory."""
    import torch
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config(name, layers), dtype=torch.float32)
    directory = Path(out) / name
    model.save_pretrained(directory)
    shutil.copy(REPO / "examples" / "qwen3_moe" / "tokenizer.json", directory / "tokenizer.json")
    return directory


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--name", nargs="*", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--layers", type=int, default=4)
    args = ap.parse_args(argv)
    for name in args.name:
        print(build(name, Path(args.out), args.layers))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
