"""moeplan's Hugging Face example: a small Qwen3-MoE built from its transformers config, with its own
byte-level BPE tokenizer (tokenizer.json), trained briefly on TinyMoE's corpus.

It is a real transformers model directory (config.json, model.safetensors, tokenizer.json), so
every command takes it as it would take a downloaded Qwen3-MoE: `moeplan trace` reads text through
the tokenizer, `compile` ships tokenizer.json in the bundle, `run` takes text prompts.

    python examples/qwen3_moe/build.py --out examples/qwen3_moe [--steps 300] [--seed 0] [--if-missing]
"""
from __future__ import annotations

import argparse
from pathlib import Path

HERE = Path(__file__).resolve().parent
CORPUS = HERE.parent / "tiny_moe" / "corpus_train.txt"
VOCAB = 384


def train_tokenizer(text: str):
    """Byte-level BPE (GPT-2 style pre-tokenisation) with VOCAB ids, trained on `text`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(text.splitlines(), trainer=trainer)
    return tokenizer


def build_model(seed: int):
    import torch
    import transformers

    config = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True, max_position_embeddings=256, tie_word_embeddings=False, bos_token_id=0,
        eos_token_id=0, pad_token_id=0)
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def train(model, ids, steps: int, seed: int, seq: int = 64, batch: int = 8) -> float:
    """Next-token training on random windows of `ids`; returns the last loss."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    data = torch.tensor(ids, dtype=torch.int64)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    model.train()
    loss = None
    for _ in range(steps):
        starts = torch.randint(0, data.numel() - seq - 1, (batch,), generator=gen)
        x = torch.stack([data[s:s + seq] for s in starts.tolist()])
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    return float(loss)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(HERE))
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--if-missing", action="store_true", help="do nothing if the model is already there")
    args = ap.parse_args(argv)
    out = Path(args.out)
    if args.if_missing and (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file():
        return 0
    import torch

    torch.set_num_threads(1)  # same bytes on every machine
    text = CORPUS.read_text(encoding="utf-8")
    tokenizer = train_tokenizer(text)
    ids = tokenizer.encode(text).ids
    model = build_model(args.seed)
    loss = train(model, ids, args.steps, args.seed)
    model.save_pretrained(out)
    tokenizer.save(str(out / "tokenizer.json"))
    print(f"wrote {out}: Qwen3-MoE, {sum(p.numel() for p in model.parameters())} parameters, "
          f"{len(ids)} training tokens, final loss {loss:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
