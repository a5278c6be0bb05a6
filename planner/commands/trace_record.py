"""`moeplan trace MODEL --data TEXT --out T.npz`: record the model's routing on a text file.

The CLI only gathers inputs and shows progress; `passes/analysis/trace/record.py` does the recording and
`passes/analysis/trace/format.py: save_trace` writes the file atomically (an error leaves no file behind).
"""
from __future__ import annotations

import contextlib
from pathlib import Path

import click

from moeplan.passes.analysis.trace.format import SPECULATION_SOURCES
from moeplan.planner import cli_types as T
from moeplan.planner import progress
from moeplan.planner.errors import UserError

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


IDS_PREFIX = "ids:"


def token_id_lines(text: str):
    """Sequences of token ids if every non-empty line of --data reads 'ids: 1 2 3', else None (text)."""
    lines = [l for l in text.splitlines() if l.strip()]
    if not lines or not all(l.startswith(IDS_PREFIX) for l in lines):
        return None
    try:
        return [[int(t) for t in l[len(IDS_PREFIX):].split()] for l in lines]
    except ValueError:
        raise UserError("--data lines starting with 'ids:' must hold space-separated integer token ids") from None


def hf_tokenizer(model: str):
    """The model directory's tokenizer if it ships one, else None (byte-level ids). tokenizer.json
    is read with the `tokenizers` library, as bundles read it (no network, same ids)."""
    directory = Path(model)
    if not directory.is_dir() or not any((directory / name).is_file() for name in TOKENIZER_FILES):
        return None
    if (directory / "tokenizer.json").is_file():
        from tokenizers import Tokenizer

        fast = Tokenizer.from_file(str(directory / "tokenizer.json"))
        return lambda text: fast.encode(text, add_special_tokens=False).ids
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise UserError(f"'{model}' ships a tokenizer but transformers is not installed; pip install 'moeplan[hf]'") from None
    tokenizer = AutoTokenizer.from_pretrained(str(directory))
    return lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]


@contextlib.contextmanager
def _tracing_progress(shown: bool):
    """Yields progress(done, total) for the tracing bar of `planner/progress.py` (a terminal only), or None."""
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
@click.option("--quiet", is_flag=True, help="No progress bar and no summary line.")
def record(model, data, out, max_tokens, batch, seq_len, speculate, speculate_from, quiet):
    """Record MODEL's routing on the text in --data into a trace file (.npz)."""
    from moeplan.passes.analysis.trace.record import record_trace
    from moeplan.passes.analysis.trace.format import save_trace
    from moeplan.planner.importers import load_model

    text = read_text(data)
    loaded = load_model(model)
    tokenizer = hf_tokenizer(model)
    ids = token_id_lines(text)
    byte_fallback = ids is None and tokenizer is None and _is_hf_directory(model)
    with _tracing_progress(not quiet) as update:
        trace = record_trace(loaded, text if ids is None else ids, max_tokens=max_tokens, batch=batch, seq_len=seq_len,
                             tokenizer=tokenizer, progress=update, speculate=speculate or 0,
                             speculate_from=speculate_from)
    save_trace(trace, out)
    if not quiet:
        click.echo(f"wrote {out}: {trace.num_tokens} tokens x {trace.num_layers} MoE layers, "
                   f"top-{trace.top_k} of {trace.num_experts} experts"
                   + (f", speculation {speculate} layers ahead from the {speculate_from}" if speculate else "")
                   + ("" if trace.attention_ids is not None else " (no attention ids: the model exposes no attention probabilities)"))
        if byte_fallback:
            click.echo("note: no tokenizer.json in the model directory; the text was traced as UTF-8 bytes (ids 0-255)")


def _is_hf_directory(model: str) -> bool:
    """A Hugging Face model directory (its text has no native byte vocabulary, unlike TinyMoE's)."""
    import json

    config = Path(model) / "config.json"
    try:
        return config.is_file() and "moeplan_loader" not in json.loads(config.read_text())
    except ValueError:
        return False
