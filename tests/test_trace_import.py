"""JSONL routing-log import: round trip through `moeplan trace import`, and every malformed record rejected in one line."""
import json

import numpy as np
import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from moeplan.passes.analysis.trace.format import load_trace
from moeplan.passes.analysis.trace.vllm_jsonl import parse_routing_log
from moeplan.planner.cli import main
from moeplan.core.errors import UserError


def log_records(experts, weights, problems, layers=None):
    """Records for a trace [T, L, K]; token t belongs to problems[t]; position = rank within its problem."""
    T, L, _ = experts.shape
    layers = list(range(L)) if layers is None else layers
    seen: dict = {}
    records = []
    for t in range(T):
        position = seen.get(problems[t], 0)
        seen[problems[t]] = position + 1
        for l in range(L):
            records.append({"problem_id": problems[t], "layer": layers[l], "token_idx": position,
                            "experts": [int(e) for e in experts[t, l]],
                            "gating_probs": [float(w) for w in weights[t, l]]})
    return records


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_import_round_trip_orders_tokens_by_problem_then_position(tmp_path):
    # Two interleaved problems, records shuffled, layers numbered 3 and 7 (dense layers before them).
    rng = np.random.default_rng(1)
    experts = np.array([[[1, 2], [3, 0]], [[5, 4], [2, 1]], [[0, 7], [6, 5]], [[3, 3], [1, 2]]])
    weights = np.array([[[0.6, 0.4], [0.9, 0.1]], [[0.3, 0.7], [0.5, 0.5]],
                        [[0.8, 0.2], [0.2, 0.8]], [[0.5, 0.5], [0.6, 0.4]]])
    problems = ["b", "a", "b", "a"]
    records = log_records(experts, weights, problems, layers=[3, 7])
    shuffled = [records[i] for i in rng.permutation(len(records))]
    log = write_jsonl(tmp_path / "routing.jsonl", shuffled)
    first_seen = list(dict.fromkeys(r["problem_id"] for r in shuffled))

    result = CliRunner().invoke(main, ["trace", "import", str(log), "--out", str(tmp_path / "t.npz"), "--num-experts", "8"])
    assert result.exit_code == 0, result.output
    trace = load_trace(tmp_path / "t.npz")

    assert trace.num_experts == 8 and trace.experts.shape == (4, 2, 2)
    seq_of = {p: first_seen.index(p) for p in problems}
    order = sorted(range(4), key=lambda t: (seq_of[problems[t]], problems[:t].count(problems[t])))
    assert trace.sequence.tolist() == [seq_of[problems[t]] for t in order]
    assert trace.positions.tolist() == [problems[:t].count(problems[t]) for t in order]
    for row, t in enumerate(order):
        for l in range(2):
            heavy_first = np.argsort(-weights[t, l], kind="stable")
            assert trace.experts[row, l].tolist() == experts[t, l][heavy_first].tolist()
            np.testing.assert_allclose(trace.weights[row, l], weights[t, l][heavy_first], rtol=1e-6)


def test_import_without_gating_probs_uses_equal_weights_in_logged_order():
    lines = [json.dumps({"problem_id": 0, "layer": l, "token_idx": 0, "experts": [4, 1]}) for l in range(2)]
    trace = parse_routing_log(lines)
    assert trace.experts.tolist() == [[[4, 1], [4, 1]]]
    assert np.all(trace.weights == 0.5)
    assert trace.num_experts == 5


BAD_LINES = [
    ("{not json", "line 2: not valid JSON"),
    ("[1, 2]", "line 2: expected a JSON object"),
    ('{"problem_id": 0, "layer": 1, "token_idx": 0}', "line 2: record has no 'experts'"),
    ('{"problem_id": 0, "layer": -1, "token_idx": 0, "experts": [1, 2]}', "'layer' must be a non-negative integer"),
    ('{"problem_id": 0, "layer": 1, "token_idx": 1.5, "experts": [1, 2]}', "'token_idx' must be a non-negative integer"),
    ('{"problem_id": [0], "layer": 1, "token_idx": 0, "experts": [1, 2]}', "'problem_id' must be a string or an integer"),
    ('{"problem_id": 0, "layer": 1, "token_idx": 0, "experts": [1, "x"]}', "'experts' must be a non-empty list"),
    ('{"problem_id": 0, "layer": 1, "token_idx": 0, "experts": [1, 2, 3]}', "'experts' has 3 entries but earlier records have 2"),
    ('{"problem_id": 0, "layer": 1, "token_idx": 0, "experts": [1, -2]}', "id below -1"),
    ('{"problem_id": 0, "layer": 1, "token_idx": 0, "experts": [1, 2], "gating_probs": [0.5]}', "'gating_probs' has 1 entries"),
    ('{"problem_id": 0, "layer": 1, "token_idx": 0, "experts": [1, 2], "gating_probs": [0.5, NaN]}', "finite numbers"),
    ('{"problem_id": 0, "layer": 0, "token_idx": 0, "experts": [1, 2], "gating_probs": [0.5, 0.5]}', "line 2: second record for problem 0 token 0 layer 0 (the first is on line 1)"),
]


@pytest.mark.parametrize("bad_line, message", BAD_LINES)
def test_malformed_record_fails_with_its_line_number_and_leaves_no_file(tmp_path, bad_line, message):
    good = '{"problem_id": 0, "layer": 0, "token_idx": 0, "experts": [1, 2], "gating_probs": [0.7, 0.3]}'
    log = tmp_path / "bad.jsonl"
    log.write_text(good + "\n" + bad_line + "\n")
    out = tmp_path / "t.npz"
    result = CliRunner().invoke(main, ["trace", "import", str(log), "--out", str(out)])
    assert result.exit_code == 2
    assert result.output.count("\n") == 1 and result.output.startswith("error: ")
    assert message in result.output and str(log) in result.output
    assert "Traceback" not in result.output
    assert not out.exists() and list(tmp_path.iterdir()) == [log]


@pytest.mark.parametrize("content, args, message", [
    ("", [], "holds no routing records"),
    ('{"problem_id": 0, "layer": 0, "token_idx": 0, "experts": [9]}\n', ["--num-experts", "8"], "expert id 9"),
    ('{"problem_id": 0, "layer": 0, "token_idx": 0, "experts": [1]}\n'
     '{"problem_id": 0, "layer": 1, "token_idx": 0, "experts": [1]}\n'
     '{"problem_id": 0, "layer": 0, "token_idx": 1, "experts": [1]}\n', [], "token 1 has no record for layer 1"),
    ('{"problem_id": 0, "layer": 0, "token_idx": 0, "experts": [1]}\n', ["--num-experts", "0"], "--num-experts must be a positive integer"),
])
def test_inconsistent_logs_fail_in_one_line(tmp_path, content, args, message):
    log = tmp_path / "log.jsonl"
    log.write_text(content)
    result = CliRunner().invoke(main, ["trace", "import", str(log), "--out", str(tmp_path / "t.npz"), *args])
    assert result.exit_code == 2 and message in result.output
    assert result.output.count("\n") == 1
    assert not (tmp_path / "t.npz").exists()


def test_missing_and_binary_logs_fail_in_one_line(tmp_path):
    out = tmp_path / "t.npz"
    result = CliRunner().invoke(main, ["trace", "import", str(tmp_path / "nope.jsonl"), "--out", str(out)])
    assert result.exit_code == 2 and "does not exist" in result.output
    binary = tmp_path / "bin.jsonl"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    result = CliRunner().invoke(main, ["trace", "import", str(binary), "--out", str(out)])
    assert result.exit_code == 2 and "not UTF-8" in result.output
    assert not out.exists()


# ---- properties -----------------------------------------------------------------------------

@st.composite
def routing_logs(draw):
    """A random valid trace and its log records in random order."""
    T = draw(st.integers(1, 12))
    L = draw(st.integers(1, 4))
    K = draw(st.integers(1, 3))
    E = draw(st.integers(K, 9))
    experts = np.array([[draw(st.lists(st.integers(0, E - 1), min_size=K, max_size=K, unique=True))
                         for _ in range(L)] for _ in range(T)])
    weights = np.array(draw(st.lists(st.floats(0.0625, 1.0, width=32), min_size=T * L * K, max_size=T * L * K)),
                       dtype=np.float64).reshape(T, L, K)
    problems = draw(st.lists(st.sampled_from(["x", "y", 3, 11]), min_size=T, max_size=T))
    records = log_records(experts, weights, problems)
    order = draw(st.permutations(range(len(records))))
    return experts, weights, problems, E, [records[i] for i in order]


@settings(max_examples=60, deadline=None)
@given(routing_logs())
def test_parsed_log_reproduces_every_record(case):
    experts, weights, problems, E, records = case
    trace = parse_routing_log([json.dumps(r) for r in records], num_experts=E)
    assert trace.num_tokens == len(problems) and trace.num_experts == E
    first_seen = list(dict.fromkeys(r["problem_id"] for r in records))
    by_key = {(first_seen.index(r["problem_id"]), r["token_idx"], r["layer"]): r for r in records}
    keys = list(zip(trace.sequence.tolist(), trace.positions.tolist()))
    assert keys == sorted(keys)  # problem order, then position
    for row, (seq, pos) in enumerate(keys):
        for l in range(trace.num_layers):
            record = by_key[(seq, pos, l)]
            # heaviest first, and the same (expert, weight) pairs as logged
            assert np.all(np.diff(trace.weights[row, l]) <= 0)
            logged = sorted(zip(record["experts"], np.float32(record["gating_probs"]).tolist()))
            assert sorted(zip(trace.experts[row, l].tolist(), trace.weights[row, l].tolist())) == logged


@settings(max_examples=80, deadline=None)
@given(routing_logs(), st.data())
def test_corrupted_log_fails_only_with_user_error(case, data):
    """Dropping, duplicating or mangling a record gives a UserError (never another exception)."""
    *_, records = case
    lines = [json.dumps(r) for r in records]
    i = data.draw(st.integers(0, len(lines) - 1))
    edit = data.draw(st.sampled_from(["drop", "duplicate", "truncate", "mangle_key", "mangle_value"]))
    if edit == "drop" and len(lines) > 1:
        # dropping a record leaves its token incomplete unless the token has only one layer left
        lines.pop(i)
    elif edit == "duplicate":
        lines.insert(i, lines[i])
    elif edit == "truncate":
        lines[i] = lines[i][: data.draw(st.integers(1, len(lines[i]) - 1))]
    elif edit == "mangle_key":
        key = data.draw(st.sampled_from(["problem_id", "layer", "token_idx", "experts"]))
        record = dict(records[i])
        del record[key]
        lines[i] = json.dumps(record)
    else:
        key = data.draw(st.sampled_from(["layer", "token_idx", "experts", "gating_probs"]))
        record = dict(records[i])
        # (gating_probs: None would only mean "not logged", valid if the log has one record)
        bad = ["x", -5, 1.5, [], [True]] + ([] if key == "gating_probs" else [None])
        record[key] = data.draw(st.sampled_from(bad))
        lines[i] = json.dumps(record)
    try:
        parse_routing_log(lines)
    except UserError as exc:
        assert "\n" not in str(exc)
    else:
        # only a drop of a whole token's single record can still be a valid log
        assert edit == "drop"
