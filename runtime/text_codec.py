"""Prompts in, text out: the one reading of prompt text, for bundles and for `moeplan trace`.

A line that starts with `ids:` is token ids (space-separated), for any model. Otherwise text is
encoded with the model directory's `tokenizer.json` (the `tokenizers` library, no network), else
as UTF-8 bytes (ids 0-255: TinyMoE's own vocabulary; for other models a fallback that the run
states, since those ids mean nothing to the model's vocabulary).

Special tokens: text is encoded as a served prompt is, with the tokenizer's own post-processor
(`add_special_tokens=True`: a BOS for Llama- and Mixtral-style tokenizers, nothing for Qwen's),
as `tokenizer(text)` in transformers and the completion endpoints of serving engines encode a
prompt. `moeplan trace` encodes its --data through this same function, so a trace recorded from
a text routes exactly the tokens a bundle serves for that text (one encode call per text: a
prompt is one line of a prompts file; a trace's --data is one document, cut into --seq-len
windows after encoding). Text that contains a special token's literal (e.g. `<|endoftext|>`)
gets that token's id in both, as the tokenizer's added tokens are matched before the model's
pre-tokenizer runs.

Lines: a prompts file is split at "\\n", "\\r\\n" and "\\r" (what Python's text files call a
line), not at the other Unicode line boundaries `str.splitlines` knows (form feed, U+2028, ...),
which are kept inside the prompt; lines holding only whitespace are skipped.

This module ships inside bundles and imports nothing of moeplan; the planner imports it.
"""
from __future__ import annotations

from pathlib import Path

IDS_PREFIX = "ids:"
ADD_SPECIAL_TOKENS = True


def prompt_lines(text: str) -> list:
    """The prompts of a prompts file's text: one per line, whitespace-only lines skipped."""
    lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    return [line for line in lines if line.strip()]


def parse_ids(line: str):
    """The token ids of an `ids: 1 2 3` line; None for a line of text; ValueError when malformed."""
    if not line.startswith(IDS_PREFIX):
        return None
    try:
        return [int(t) for t in line[len(IDS_PREFIX):].split()]
    except ValueError:
        raise ValueError(f"prompt line {line[:40]!r}: after 'ids:' give space-separated integer token ids") from None


class TextCodec:
    """encode(line) -> checked ids, encode_text(text) -> ids, decode(ids) -> text; `source` says which."""

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
        """One prompt line: its ids if it is an `ids:` line, else its text encoded; checked."""
        ids = parse_ids(line)
        return self.checked(line, ids if ids is not None else self.encode_text(line))

    def encode_text(self, text: str, add_special_tokens: bool = ADD_SPECIAL_TOKENS) -> list:
        """Text only (never read as `ids:`: the serving front takes ids as ids), unchecked;
        `add_special_tokens` as the tokenizer's post-processor defines them (a chat template writes
        its own, so chat passes False)."""
        if self.tokenizer is not None:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        return list(text.encode("utf-8"))

    def checked(self, text: str, ids: list) -> list:
        """`ids` if they are a prompt the model can take (some, all in its vocabulary), else ValueError."""
        if not ids:
            raise ValueError(f"{text[:40]!r} encodes to no tokens")
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"{text[:40]!r} gives token ids {bad[:5]}, outside the model's vocabulary of {self.vocab_size}")
        return ids

    def decode(self, ids: list) -> str:
        if self.tokenizer is not None:
            return self.tokenizer.decode([int(i) for i in ids])
        return bytes(int(i) % 256 for i in ids).decode("utf-8", errors="replace")
