"""What the front knows of the model it serves, read from the bundle: tokenizer, chat format, EOS ids.

The engine needs none of this (it sees token ids); the front needs it to turn text into ids and
back. Read from the bundle's own files (plan.json and model/), never from the engine, so the front
can be built and tested on a model directory alone.
* tokenizer: `model/tokenizer.json` (the `tokenizers` library), else UTF-8 bytes (runtime/text_codec.py);
* chat format: chat_prompt.py (the model's template, or the stated fallback);
* end-of-sequence ids: `eos_token_id` of `model/generation_config.json`, else of the (text) config;
  TinyMoE's byte vocabulary has none, so it stops on `max_tokens` and stop strings only.
"""
from __future__ import annotations

import json
from pathlib import Path

from ..text_codec import TextCodec
from .chat_prompt import FALLBACK, ChatFormat


class ServedModel:
    """name, codec (encode_text / decode), vocab_size, eos_token_ids, chat (ChatFormat)."""

    def __init__(self, name: str, codec: TextCodec, eos_token_ids: tuple, chat: ChatFormat):
        self.name, self.codec, self.chat = name, codec, chat
        self.vocab_size = codec.vocab_size
        self.eos_token_ids = tuple(sorted({int(i) for i in eos_token_ids}))

    @classmethod
    def from_model_dir(cls, model_dir: Path, name: str) -> ServedModel:
        """From a bundle's `model/` (config.json, and tokenizer and generation files where shipped)."""
        model_dir = Path(model_dir)
        config = json.loads((model_dir / "config.json").read_text())
        if config.get("model_type") == "tiny_moe":
            return cls(name, TextCodec(None, int(config["vocab_size"]), native_bytes=True), (), ChatFormat(None, {}, FALLBACK))
        text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
        codec = TextCodec(model_dir / "tokenizer.json", int(text["vocab_size"]))
        generation = model_dir / "generation_config.json"
        eos = json.loads(generation.read_text()).get("eos_token_id") if generation.is_file() else None
        if eos is None:
            eos = text.get("eos_token_id", config.get("eos_token_id"))
        eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        return cls(name, codec, tuple(e for e in eos if 0 <= int(e) < codec.vocab_size),
                   ChatFormat.from_model_dir(model_dir))

    def describe(self) -> dict:
        """For /v1/models: how text becomes tokens here."""
        return {"tokenizer": self.codec.source, "chat_template": self.chat.source,
                "eos_token_ids": list(self.eos_token_ids)}

