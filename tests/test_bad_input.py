"""Issue 17: every bad input found by the red-team pass ends in one `error:` line, exit code 2,
with nothing written: through the real CLI, one case per root cause."""
import io
import json
import zipfile

import numpy as np
import pytest
from click.testing import CliRunner

from moeplan.planner.cli import main
from runtime_fixtures import small_model_dir


def _cli(args):
    result = CliRunner().invoke(main, [str(a) for a in args])
    return result.exit_code, result.output


def _refused(args, *needles):
    code, output = _cli(args)
    assert code == 2, output
    assert output.startswith("error: ") and output.count("\n") == 1, output
    for needle in needles:
        assert needle in output, output
    return output


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return small_model_dir(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def good_trace(tmp_path_factory, model):
    root = tmp_path_factory.mktemp("trace")
    data = root / "data.txt"
    data.write_text("The quick brown fox jumps over the lazy dog. Once upon a time.\n")
    assert _cli(["trace", model, "--data", data, "--out", root / "t.npz", "--quiet"])[0] == 0
    return root / "t.npz"


def _npz(path, **arrays):
    np.savez(path, **arrays)
    return path


# ------------------------------------------------------------------------------ trace files

def test_int64_ids_beyond_int32_do_not_wrap(tmp_path, model):
    trace = _npz(tmp_path / "wrap.npz", experts=np.array([[[4294967299, 1]] * 3] * 4, dtype=np.int64))
    for args in (["trace", "stats", trace],
                 ["place", "--trace", trace, "--nodes", 1, "--gpus-per-node", 2, "--out", tmp_path / "p.json"],
                 ["compile", model, "--trace", trace, "--out", tmp_path / "b", "--quiet"]):
        _refused(args, "4294967299")
    assert not (tmp_path / "p.json").exists() and not (tmp_path / "b").exists()


def test_jsonl_ids_beyond_int32_and_json_integer_overflow_are_one_line(tmp_path):
    for i, experts in enumerate(["[4294967299]", "[" + "9" * 400 + "]"]):
        log = tmp_path / f"big{i}.jsonl"
        log.write_text(f'{{"problem_id": 0, "layer": 0, "token_idx": 0, "experts": {experts}}}\n')
        _refused(["trace", "import", log, "--out", tmp_path / "t.npz"])
    log = tmp_path / "tok.jsonl"
    log.write_text(f'{{"problem_id": 0, "layer": 0, "token_idx": {2**40}, "experts": [1]}}\n')
    _refused(["trace", "import", log, "--out", tmp_path / "t.npz"], "token_idx")
    assert not (tmp_path / "t.npz").exists()


def _lying_npz(path, shape):
    """An .npz whose experts header declares `shape` but holds 12 bytes of data."""
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": "<i4", "fortran_order": False, "shape": shape})
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("experts.npy", buf.getvalue() + b"\0" * 12)
    return path


@pytest.mark.parametrize("shape", [(10**9, 60, 8), (2**40, 1, 1), (1, 3, 2)])
def test_array_headers_are_checked_against_their_data_before_allocating(tmp_path, shape):
    _refused(["trace", "stats", _lying_npz(tmp_path / "lie.npz", shape)], "declares shape")


def test_arrays_larger_than_the_memory_budget_are_refused_before_reading(tmp_path):
    """A consistent archive (a zip of zeros inflates ~1000x) is refused by its declared size."""
    from moeplan.passes.analysis.trace.format import read_npz_arrays
    from moeplan.core.errors import UserError

    path = tmp_path / "zeros.npz"
    np.savez_compressed(path, experts=np.zeros((4000, 4, 2), np.int32))
    assert path.stat().st_size < 4000 * 4 * 2 * 4 // 20
    assert read_npz_arrays(path)["experts"].shape == (4000, 4, 2)
    with pytest.raises(UserError, match="unpacks to"):
        read_npz_arrays(path, budget=4000 * 4 * 2 * 4 - 1)


@pytest.mark.parametrize("make, needle", [
    (lambda p: (np.save(p.with_suffix(".npy"), np.zeros((3, 2, 1), int)), p.with_suffix(".npy").rename(p)), "not a readable .npz"),
    (lambda p: _npz(p, experts=np.zeros((3, 2, 1), int), version=np.array("one")), "'version'"),
    (lambda p: _npz(p, experts=np.zeros((3, 2, 1), int), version=np.float64(1.0)), "'version'"),
    (lambda p: _npz(p, experts=np.zeros((0, 2, 1), int)), "0 tokens"),
    (lambda p: _npz(p, experts=np.zeros((3, 2, 3), int), num_experts=np.int64(2)), "top-3"),
    (lambda p: _npz(p, experts=np.zeros((3, 2, 1), int), num_experts=np.int64(2**40)), "out of range"),
    (lambda p: _npz(p, experts=np.zeros((3, 2, 1), int), num_experts=np.int64(10**6)), "at most"),
    (lambda p: _npz(p, experts=np.zeros((3, 2, 1), np.uint64) + np.uint64(2**63 + 5)), "above"),
    (lambda p: _npz(p, experts=np.zeros((3, 2, 1), object)), "dtype"),
])
def test_malformed_trace_files_are_one_line(tmp_path, make, needle):
    path = tmp_path / "bad.npz"
    make(path)
    _refused(["trace", "stats", path], needle)


def test_trace_routing_differs_from_the_model_is_refused(tmp_path, model, good_trace):
    from moeplan.passes.analysis.trace.format import load_trace

    t = load_trace(good_trace)
    top3 = _npz(tmp_path / "top3.npz", experts=np.concatenate([t.experts, t.experts[:, :, :1]], axis=2))
    _refused(["compile", model, "--trace", top3, "--out", tmp_path / "b", "--quiet"], "top-3", "top-2")
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    big_tokens = _npz(tmp_path / "tok.npz", experts=t.experts, token_ids=np.full(t.num_tokens, vocab + 5))
    _refused(["compile", model, "--trace", big_tokens, "--out", tmp_path / "b", "--quiet"], "vocabulary")
    assert not (tmp_path / "b").exists()


# ---------------------------------------------------------------------------- numeric flags

PLACE = ["place", "--nodes", 1, "--gpus-per-node", 2, "--out", "p.json", "--trace"]


@pytest.mark.parametrize("flag, value", [
    ("--time-limit", "nan"), ("--time-limit", "0"), ("--time-limit", "-1"), ("--time-limit", "inf"),
    ("--balance", "nan"), ("--balance", "-inf"), ("--effort", "nan"), ("--effort", "0"), ("--nodes", "abc"),
    ("--nodes", "0"), ("--redundant", "-1"), ("--gpus-per-node", "99999999999999999999999"),
])
def test_place_numeric_flags(tmp_path, good_trace, flag, value):
    _refused([*PLACE, good_trace, flag, value], f"{flag} must")
    assert not (tmp_path / "p.json").exists()


@pytest.mark.parametrize("args", [
    ["--time-limit", "nan"], ["--target", "lambda", "--slo", "1", "--time-limit", "0"],
    ["--target", "lambda", "--slo", "1", "--time-limit", "-1"], ["--target", "kubernetes", "--image", ""],
    ["--target", "lambda", "--slo", "1", "--requests-per-second", "nan"], ["--target", "lambda", "--slo", "nan"],
    ["--balance", "inf"], ["--effort", "nan"],
])
def test_compile_numeric_and_text_flags(tmp_path, model, good_trace, args):
    _refused(["compile", model, "--trace", good_trace, "--out", tmp_path / "b", *args])
    assert not (tmp_path / "b").exists()


@pytest.mark.parametrize("args", [["--time-limit", "nan"], ["--time-limit", "0"], ["--time-limit", "-1"],
                                  ["--seed", "-1"], ["--slo", "inf"], ["--validation-fraction", "nan"]])
def test_plan_flags(tmp_path, model, good_trace, args):
    base = ["plan", model, "--trace", good_trace, "--target", "lambda", "--out", tmp_path / "plan.json"]
    _refused([*base, *([] if "--slo" in args else ["--slo", "1"]), *args])


@pytest.mark.parametrize("args", [["--zipf", "nan"], ["--zipf", "inf"], ["--seed", "-3"], ["--affinity", "1.5"],
                                  ["--tokens", "0"], ["--tokens", "10000000000000"]])
def test_synth_flags(tmp_path, args):
    _refused(["trace", "synth", "--layers", 2, "--experts", 4, "--out", tmp_path / "t.npz", *args])
    assert not (tmp_path / "t.npz").exists()


def test_run_timeout_and_export_opset(tmp_path, model):
    _refused(["run", tmp_path, "--timeout", "nan"], "--timeout must")
    _refused(["run", tmp_path, "--timeout", "inf"], "--timeout must")
    _refused(["export-onnx", model, "--out", tmp_path / "m.onnx", "--opset", "0"], "--opset must")
    assert not (tmp_path / "m.onnx").exists()


# ---------------------------------------------------------------------------- other inputs

def test_corrupt_config_in_compile_and_a_checkpointless_model(tmp_path, model, good_trace):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(model, bad)
    (bad / "config.json").write_text('{"num_layers": 3, ')
    _refused(["compile", bad, "--trace", good_trace, "--out", tmp_path / "b", "--quiet"], "not valid JSON")
    empty = tmp_path / "empty"
    shutil.copytree(model, empty)
    (empty / "model.safetensors").unlink()
    _refused(["compile", empty, "--trace", good_trace, "--out", tmp_path / "b", "--quiet"], "no checkpoint")
    assert not (tmp_path / "b").exists()


@pytest.mark.parametrize("target", ["torchrun", "lambda", "sglang"])  # kubernetes reads the model as torchrun does
def test_a_missing_model_is_reported_missing_for_every_target(tmp_path, good_trace, target):
    """Issue 40: not 'cannot compile ... for torchrun' (which reads as 'unsupported') but 'not found'."""
    extra = ["--slo", 3] if target == "lambda" else []
    code, output = _cli(["compile", tmp_path / "no-such-model", "--trace", good_trace, "--target", target, *extra,
                         "--out", tmp_path / "b", "--quiet"])
    assert code == 2 and output.startswith("error: ") and output.count("\n") == 1, output
    assert "no-such-model' not found: no such file or directory" in output and "cannot compile" not in output, output
    assert not (tmp_path / "b").exists()
    (tmp_path / "empty").mkdir()
    _refused(["compile", tmp_path / "empty", "--trace", good_trace, "--target", "torchrun", "--out", tmp_path / "b",
              "--quiet"], "has no config.json")


def test_binary_platform_and_prompts_files(tmp_path, model, good_trace):
    blob = tmp_path / "blob.bin"
    blob.write_bytes(bytes(range(256)) * 4)
    _refused(["plan", model, "--trace", good_trace, "--target", "lambda", "--slo", 1, "--platform", blob, "--out", tmp_path / "p.json", "--quiet"],
             "not UTF-8")
    from moeplan.planner.launch.torchrun_launch import read_prompts
    from moeplan.core.errors import UserError

    with pytest.raises(UserError, match="not UTF-8"):
        read_prompts(blob)


def test_huge_layer_count_in_a_config_fails_fast(tmp_path):
    d = tmp_path / "hf"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({
        "model_type": "mixtral", "num_hidden_layers": 10**9, "hidden_size": 64, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 4, "num_local_experts": 8, "num_experts_per_tok": 2,
        "vocab_size": 100}))
    _refused(["inspect", d], "num_hidden_layers")


def test_click_usage_errors_are_one_line():
    _refused(["place", "--nodes", "abc"], "--nodes must be a whole number")
    _refused(["compile"], "MODEL")
    _refused(["trace", "synth", "--no-such-flag"], "--no-such-flag")


def test_policy_auto_names_why_no_candidate_fits_and_its_advice_works(tmp_path, model, good_trace):
    """Issue 40: --policy auto said "found no placement policy that fits" where --policy eplb names the
    cause; now auto names it too (experts over devices), and the flags it suggests plan."""
    import re

    experts = json.loads((model / "config.json").read_text())["num_experts"]
    devices = next(d for d in range(3, 9) if experts % d)
    out = _refused(["plan", model, "--trace", good_trace, "--gpus-per-node", devices, "--policy", "auto",
                    "--out", tmp_path / "p.json", "--quiet"],
                   f"{experts} experts per layer do not divide evenly over {devices} devices")
    redundant = int(re.search(r"--redundant (\d+)", out).group(1))
    assert (experts + redundant) % devices == 0
    code, output = _cli(["plan", model, "--trace", good_trace, "--gpus-per-node", devices, "--policy", "eplb",
                         "--redundant", redundant, "--out", tmp_path / "p.json", "--quiet"])
    assert code == 0, output
