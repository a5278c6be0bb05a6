"""One reading of prompt text (issue 32): `runtime/text_codec.py` for bundles, `moeplan run`'s
prompt check and `moeplan trace`. Property tests for the parser; the special-token rule checked on a
tokenizer with a BOS post-processor (a trace from a text routes the tokens a bundle serves for it)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from moeplan.runtime.text_codec import TextCodec, parse_ids, prompt_lines
from moeplan.planner.launch.torchrun_launch import read_prompts
from moeplan.passes.analysis.trace.format import load_trace
from moeplan.passes.analysis.trace.record import encode_text as record_bytes
from moeplan.planner.cli import main
from moeplan.planner.commands.trace_record import text_codec, token_id_lines
from moeplan.core.errors import UserError

ROOT = Path(__file__).resolve().parents[1]
QWEN = ROOT / "examples" / "qwen3_moe"
BREAKS = ("\n", "\r\n", "\r")
# one prompt: any text without the three line breaks of a text file (nor NUL: run refuses binary
# files), not only whitespace
PROMPT = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\n\r\x00"), min_size=1,
                 max_size=40).filter(lambda s: s.strip())
BLANK = st.text(st.sampled_from(" \t"), max_size=3)


@given(st.lists(st.tuples(PROMPT, st.sampled_from(BREAKS), st.lists(st.tuples(BLANK, st.sampled_from(BREAKS)), max_size=2)),
                max_size=8), st.booleans())
def test_prompt_lines_gives_back_the_prompts_whatever_the_line_breaks(rows, final_break):
    text = ""
    for prompt, brk, blanks in rows:
        text += prompt + brk + "".join(b + k for b, k in blanks)
    if not final_break and text.endswith(("\n", "\r")):
        text = text.rstrip("\r\n")
    assert prompt_lines(text) == [p for p, _, _ in rows]


@given(st.sampled_from(["\x0b", "\x0c", "\x1c", "\x85", "\u2028", "\u2029"]), PROMPT, PROMPT)
def test_other_unicode_line_boundaries_stay_inside_a_prompt(sep, a, b):
    assert prompt_lines(a + sep + b + "\n") == [a + sep + b]


@settings(max_examples=40)
@given(st.lists(st.tuples(PROMPT, st.sampled_from(BREAKS)), min_size=1, max_size=6))
def test_run_reads_a_prompts_file_as_the_runtime_does(tmp_path_factory, rows):
    path = tmp_path_factory.mktemp("prompts") / "p.txt"
    text = "".join(p + b for p, b in rows)
    path.write_bytes(text.encode("utf-8"))
    # the runtime (serve.py) reads prompt_lines(Path.read_text(encoding="utf-8")); run checks the same
    assert read_prompts(path) == prompt_lines(path.read_text(encoding="utf-8")) == [p for p, _ in rows]


@given(st.lists(st.integers(0, 10**9), max_size=12), st.sampled_from([" ", "  ", "\t"]))
def test_ids_lines_round_trip(ids, sep):
    assert parse_ids("ids:" + sep + sep.join(map(str, ids))) == ids


@given(PROMPT.filter(lambda s: not s.startswith("ids:")))
def test_text_is_never_read_as_ids(line):
    assert parse_ids(line) is None


@given(st.text(st.characters(blacklist_categories=("Cs",), whitelist_categories=("L", "P")), min_size=1, max_size=8)
       .filter(lambda s: s.strip() and not s.strip().lstrip("+-").isdigit()))
def test_malformed_ids_lines_are_refused(junk):
    with pytest.raises(ValueError, match="after 'ids:'"):
        parse_ids(f"ids: 3 {junk} 4")


@given(st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=60))
def test_byte_text_is_utf8_in_trace_and_runtime(text):
    codec = TextCodec(None, 256, native_bytes=True)
    assert codec.encode_text(text) == list(text.encode("utf-8")) == record_bytes(text, 256).tolist()


def test_trace_refuses_a_file_mixing_ids_and_text():
    assert token_id_lines("ids: 1 2\n\nids: 3\n") == [[1, 2], [3]]
    assert token_id_lines("hello\nworld\n") is None
    with pytest.raises(UserError, match="mixes 'ids:' lines with text"):
        token_id_lines("ids: 1 2\nhello\n")


# --- the special-token rule, on a tokenizer that adds a BOS ------------------------------------------

def with_bos(directory: Path, bos: str = "<|endoftext|>") -> int:
    """Give the model directory's tokenizer.json a BOS post-processor (as Llama's has); its id."""
    from tokenizers import Tokenizer
    from tokenizers.processors import TemplateProcessing

    tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
    bos_id = tok.token_to_id(bos)
    tok.post_processor = TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)])
    tok.save(str(directory / "tokenizer.json"))
    return bos_id


@pytest.fixture(scope="module")
def bos_model(tmp_path_factory):
    directory = tmp_path_factory.mktemp("bos") / "qwen3_moe"
    shutil.copytree(QWEN, directory)
    return directory, with_bos(directory)


def runtime_codec(directory: Path) -> TextCodec:
    """What a bundle's rank builds (runtime/bundle_io.py) for a Hugging Face model."""
    vocab = json.loads((directory / "config.json").read_text())["vocab_size"]
    return TextCodec(directory / "tokenizer.json", vocab)


@settings(max_examples=60, deadline=None)
@given(line=PROMPT.filter(lambda s: not s.startswith("ids:")))
def test_trace_encodes_text_as_the_bundle_serves_it(bos_model, line):
    directory, bos_id = bos_model
    served = runtime_codec(directory).encode(line)
    traced = text_codec(str(directory), json.loads((directory / "config.json").read_text())["vocab_size"]).encode_text(line)
    assert traced == served and served[0] == bos_id


def test_a_trace_of_one_line_routes_the_served_tokens(bos_model, tmp_path):
    directory, bos_id = bos_model
    line = "Mixture of experts route tokens <|endoftext|> between layers"
    (tmp_path / "one.txt").write_text(line, encoding="utf-8")
    result = CliRunner().invoke(main, ["trace", str(directory), "--data", str(tmp_path / "one.txt"),
                                       "--out", str(tmp_path / "t.npz"), "--quiet"])
    assert result.exit_code == 0, result.output
    trace = load_trace(tmp_path / "t.npz")
    served = runtime_codec(directory).encode(line)
    assert trace.token_ids.tolist() == served
    assert served[0] == bos_id and served.count(bos_id) == 2  # the BOS, and the literal special token


def test_a_tokenizer_bundles_cannot_read_is_refused_by_trace(tmp_path):
    directory = tmp_path / "model"
    shutil.copytree(QWEN, directory)
    (directory / "tokenizer.json").rename(directory / "tokenizer.model")
    (tmp_path / "t.txt").write_text("hello\n")
    result = CliRunner().invoke(main, ["trace", str(directory), "--data", str(tmp_path / "t.txt"),
                                       "--out", str(tmp_path / "t.npz"), "--quiet"])
    assert result.exit_code == 2 and "without a tokenizer.json" in result.output
    assert not (tmp_path / "t.npz").exists()


def test_the_example_qwen_tokenizer_adds_nothing_so_its_traces_are_unchanged():
    codec = runtime_codec(QWEN)
    text = "The quick brown fox"
    assert codec.encode_text(text) == codec.tokenizer.encode(text, add_special_tokens=False).ids
    assert np.asarray(codec.encode_text(text)).min() >= 0
