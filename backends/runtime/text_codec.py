"""Prompts in, text out: the model directory's tokenizer, a stated byte fallback, or token ids.

A prompt line that starts with `ids:` is token ids (space-separated), for any model. Otherwise
the text is encoded with `model/tokenizer.json` when the bundle ships one (the `tokenizers`
library, no network), else as UTF-8 bytes (ids 0-255, TinyMoE's own vocabulary; for other
models a fallback that the run states, since those ids mean nothing to the model's vocabulary).
"""
from __future__ import annotations

from pathlib import Path

IDS_PREFIX = "ids:"


class TextCodec:
    """encode(line) -> ids, decode(ids) -> text, `source` says which."""

    def __init__(self, tokenizer_file: Path | None, vocab_size: int, native_bytes: bool = False):
        self.vocab_size = int(vocab_size)
        self.tokenizer = None
        if tokenizer_file is not None and Path(tokenizer_file).is_file():
            from tokenizers import Tokenizer

            self.tokenizer = Tokenizer.from_file(str(tokenizer_file))
            self.source = "tokenizer.json"
        elif native_bytes:
            self.source = "bytes (the model's own vocabulary)"
        else:
            self.source = "byte fallback: no tokenizer.json in the model directory, prompts are UTF-8 bytes (ids 0-255)"

    def encode(self, line: str) -> list:
        if line.startswith(IDS_PREFIX):
            try:
                ids = [int(t) for t in line[len(IDS_PREFIX):].split()]
            except ValueError:
                raise ValueError(f"prompt line {line[:40]!r}: after 'ids:' give space-separated integer token ids") from None
        else:
            ids = self.encode_text(line)
        if not ids:
            raise ValueError(f"prompt line {line[:40]!r} encodes to no tokens")
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the model's vocabulary of {self.vocab_size}")
        return ids

    def encode_text(self, text: str, add_special_tokens: bool = True) -> list:
        """Text only (no `ids:` lines: the serving front takes ids as ids); `add_special_tokens` as
        the tokenizer's post-processor defines them (a chat template writes its own, so chat passes False)."""
        if self.tokenizer is not None:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        return list(text.encode("utf-8"))

    def decode(self, ids: list) -> str:
        if self.tokenizer is not None:
            return self.tokenizer.decode([int(i) for i in ids])
        return bytes(int(i) % 256 for i in ids).decode("utf-8", errors="replace")
