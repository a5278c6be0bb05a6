"""`moeplan trace MODEL --data TEXT --out T.npz`: record the model's routing on a text file.

The CLI only gathers inputs and shows progress; `passes/analysis/trace/record.py` does the recording and
`passes/analysis/trace/format.py: save_trace` writes the file atomically (an error leaves no file behind).
"""
from __future__ import annotations

import contextlib
from pathlib import Path

import click

from moeplan.passes.analysis.trace.format import SPECULATION_SOURCES
from moeplan.core import cli_types as T
from moeplan.core import progress
from moeplan.core.errors import UserError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def read_text(path: Path) -> str:
    """The --data file as text; one-line errors for missing, unreadable, binary or empty files."""
    if not path.exists():
        raise UserError(f"data file '{path}' does not exist; give --data a text file to trace the model on")
    if not path.is_file():
        raise UserError(f"data path '{path}' is not a file; give --data a text file to trace the model on")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(f"data file '{path}' is not UTF-8 text (bad byte at offset {exc.start}); give a UTF-8 text file") from None
    except OSError as exc:
        raise UserError(f"cannot read data file '{path}' ({exc.strerror or exc}); check its permissions") from None
    if not text.strip():
        raise UserError(f"data file '{path}' is empty; give --data a file with some text in it")
    return text


def token_id_lines(text: str):
    """Sequences of token ids if the non-empty lines of --data are `ids: 1 2 3` lines, else None
    (text); a file mixing both is refused (text would read the ids literally)."""
    from moeplan.runtime.text_codec import parse_ids, prompt_lines

    lines = prompt_lines(text)
    try:
        ids = [parse_ids(line) for line in lines]
    except ValueError as exc:
        raise UserError(f"--data: {exc}") from None
    if all(i is None for i in ids):
        return None
    if any(i is None for i in ids):
        first = next(n for n, i in enumerate(ids) if i is None)
        raise UserError(f"--data mixes 'ids:' lines with text (non-empty line {first + 1}: {lines[first][:40]!r}); "
                        "give token ids on every line, or text only")
    return ids


def text_codec(model: str, vocab_size: int):
    """The bundle runtime's TextCodec for MODEL (runtime/text_codec.py): the directory's
    tokenizer.json, TinyMoE's bytes, or the stated byte fallback, so that a trace reads text as the
    bundle will. A directory whose tokenizer is not a tokenizer.json is refused: its bundle would
    serve that text as bytes, so a trace through another tokenizer would route other tokens."""
    from moeplan.runtime.text_codec import TextCodec

    directory = Path(model)
    if directory.is_dir() and not (directory / "tokenizer.json").is_file() and \
            any((directory / name).is_file() for name in TOKENIZER_FILES):
        raise UserError(f"'{model}' ships its tokenizer without a tokenizer.json, the one file bundles read; write it "
                        f"once with: python -c \"from transformers import AutoTokenizer; "
                        f"AutoTokenizer.from_pretrained('{model}').save_pretrained('{model}')\" "
                        "(or give --data as 'ids: ...' lines)")
    tokenizer = directory / "tokenizer.json" if directory.is_dir() else None
    return TextCodec(tokenizer, vocab_size, native_bytes=not _is_hf_directory(model))


@contextlib.contextmanager
def _tracing_progress(shown: bool):
    """Yields progress(done, total) for the tracing bar of `core/progress.py` (a terminal only), or None."""
    if not shown or not progress.enabled():
        yield None
        return
    with progress.step("tracing tokens") as advance:
        yield lambda done, total: advance(completed=done, total=total)


@click.command("record")
@click.argument("model")
@click.option("--data", "data", required=True, type=click.Path(path_type=Path),
              help="UTF-8 text file to run the model on.")
@click.option("--out", "out", required=True, type=click.Path(path_type=Path), help="Trace file to write (.npz).")
@click.option("--max-tokens", type=T.POSITIVE_INT, default=None, help="Trace at most this many tokens (default: all).")
@click.option("--batch", type=T.POSITIVE_INT, default=8, show_default=True, help="Sequences per forward pass.")
@click.option("--seq-len", type=T.POSITIVE_INT, default=None,
              help="Tokens per sequence (default: the model's maximum positions, at most 128).")
@click.option("--speculate", type=T.POSITIVE_INT, default=None,
              help="Also record, at each MoE layer l, the experts the routers of layers l+1..l+D pick from "
                   "layer l's hidden state (torch models; docs/offload.md).")
@click.option("--speculate-from", type=click.Choice(SPECULATION_SOURCES), default=SPECULATION_SOURCES[0],
              show_default=True, help="Which hidden state of layer l feeds the later routers (with --speculate).")
@click.option("--one-per-line", is_flag=True,
              help="Each non-empty line of --data is one prompt, traced as its own sequence from position 0 (cut at "
                   "--seq-len), as a service sees separate requests. Default: the file is one text, cut into "
                   "windows of --seq-len tokens.")
@click.option("--quiet", is_flag=True, help="No progress bar and no summary line.")
def record(model, data, out, max_tokens, batch, seq_len, speculate, speculate_from, one_per_line, quiet):
    """Record MODEL's routing on the text in --data into a trace file (.npz).

    The text is read as one document and cut into windows of --seq-len tokens (a corpus like the
    traffic you serve: tokens at every position a served context reaches); with --one-per-line each
    non-empty line is a prompt of its own. Lines of 'ids: 1 2 3' are token ids, one sequence each.
    """
    from moeplan.passes.analysis.trace.record import model_limits, record_trace
    from moeplan.passes.analysis.trace.format import save_trace
    from moeplan.passes.importers import load_model

    text = read_text(data)
    loaded = load_model(model)
    ids = token_id_lines(text)
    codec = None
    if ids is None:
        vocab_size, _, _ = model_limits(loaded)
        codec = text_codec(model, vocab_size if vocab_size else 1 << 62)
    byte_fallback = codec is not None and codec.source.startswith("byte fallback")
    if ids is None and one_per_line:  # each prompt its own sequence, encoded as the bundle's runtime encodes it
        from moeplan.runtime.text_codec import prompt_lines

        ids = [_encoder(codec)(line) for line in prompt_lines(text)]
    with _tracing_progress(not quiet) as update:
        trace = record_trace(loaded, text if ids is None else ids, max_tokens=max_tokens, batch=batch, seq_len=seq_len,
                             tokenizer=None if codec is None else _encoder(codec), progress=update,
                             speculate=speculate or 0, speculate_from=speculate_from)
    save_trace(trace, out)
    if not quiet:
        sequences = int(trace.sequence.max()) + 1 if trace.sequence is not None and trace.num_tokens else 0
        click.echo(f"wrote {out}: {trace.num_tokens} tokens x {trace.num_layers} MoE layers in {sequences} sequence(s), "
                   f"top-{trace.top_k} of {trace.num_experts} experts"
                   + (f", speculation {speculate} layers ahead from the {speculate_from}" if speculate else "")
                   + ("" if trace.attention_ids is not None else " (no attention ids: the model exposes no attention probabilities)"))
        if byte_fallback:
            click.echo("note: no tokenizer.json in the model directory; the text was traced as UTF-8 bytes (ids 0-255)")


def _encoder(codec):
    """codec.encode_text with its complaints as one-line user errors."""
    def encode(text: str) -> list:
        try:
            return codec.checked(text, codec.encode_text(text))
        except ValueError as exc:
            raise UserError(f"--data: {exc}") from None
    return encode


def _is_hf_directory(model: str) -> bool:
    """A Hugging Face model directory (its text has no native byte vocabulary, unlike TinyMoE's)."""
    import json

    config = Path(model) / "config.json"
    try:
        return config.is_file() and "moeplan_loader" not in json.loads(config.read_text())
    except ValueError:
        return False
