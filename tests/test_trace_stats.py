"""`moeplan trace stats`: load, imbalance and affinity figures checked on hand-made traces."""
import json

import numpy as np
import pytest
from click.testing import CliRunner

from moeplan.passes.analysis.trace.format import make_trace, save_trace
from moeplan.passes.analysis.trace.stats import routing_stats, shuffled_affinity, uniform_affinity
from moeplan.planner.cli import main


def hand_trace():
    # 4 tokens, 3 layers, top-2, 4 experts; -1 = no second choice.
    experts = np.array([
        [[0, 1], [2, 3], [1, 0]],
        [[0, 2], [2, 1], [1, -1]],
        [[1, 0], [3, 0], [0, 2]],
        [[0, 3], [3, 2], [2, 1]],
    ])
    return make_trace(experts, num_experts=4, sequence=[0, 0, 1, 1], positions=[0, 1, 0, 1])


def test_loads_and_imbalance_by_hand():
    stats = routing_stats(hand_trace())
    assert [l.tokens_per_expert for l in stats.loads] == [[4, 2, 1, 1], [1, 1, 3, 3], [2, 3, 2, 0]]
    assert [l.idle_experts for l in stats.loads] == [0, 0, 1]
    # layer 0: 8 choices over 4 experts -> mean 2, max 4; layer 1: max 3 / mean 2; layer 2: 7 choices, max 3
    assert [l.max_over_mean for l in stats.loads] == pytest.approx([2.0, 1.5, 3 / 1.75])
    assert stats.mean_max_over_mean == pytest.approx((2.0 + 1.5 + 3 / 1.75) / 3)
    assert (stats.num_tokens, stats.num_layers, stats.top_k, stats.num_experts, stats.num_sequences) == (4, 3, 2, 4, 2)


def test_affinity_by_hand():
    stats = routing_stats(hand_trace())
    # top-1 per layer: l0 = [0, 0, 1, 0], l1 = [2, 2, 3, 3], l2 = [1, 1, 0, 2]
    # 0->1: from 0 go {2, 2, 3}: best 2 of 3; from 1 go {3}: 1 of 1 -> 3/4
    # 1->2: from 2 go {1, 1}: 2; from 3 go {0, 2}: 1 -> 3/4
    assert stats.affinity == pytest.approx([0.75, 0.75])
    assert stats.mean_affinity == pytest.approx(0.75)


def test_perfectly_chained_routing_beats_both_baselines():
    rng = np.random.default_rng(0)
    first = rng.integers(0, 8, size=2000)
    experts = np.stack([first, (first + 3) % 8, (first * 5) % 8], axis=1)[:, :, None]
    trace = make_trace(experts, num_experts=8)
    stats = routing_stats(trace)
    assert stats.affinity == [1.0, 1.0]
    # shuffling keeps per-layer loads but breaks the chain: close to 1/8 with 2000 tokens
    assert all(0.12 < s < 0.2 for s in stats.shuffled_affinity)
    assert 0.125 < stats.uniform_affinity < 0.2
    assert np.array_equal(trace.expert_loads().sum(axis=1), [2000, 2000, 2000])


def test_baselines_are_deterministic():
    trace = hand_trace()
    assert shuffled_affinity(trace).tolist() == shuffled_affinity(trace).tolist()
    assert uniform_affinity(500, 16) == uniform_affinity(500, 16)


def test_stats_cli_json_and_table(tmp_path):
    path = tmp_path / "t.npz"
    save_trace(hand_trace(), path)
    result = CliRunner().invoke(main, ["trace", "stats", str(path), "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["affinity"] == pytest.approx([0.75, 0.75])
    assert [l["tokens_per_expert"] for l in data["loads"]][0] == [4, 2, 1, 1]
    table = CliRunner().invoke(main, ["trace", "stats", str(path)])
    assert table.exit_code == 0
    assert "0 -> 1" in table.output and "0.750" in table.output and "2.00" in table.output


def _bad_npz(path, **arrays):
    with open(path, "wb") as fh:
        np.savez(fh, **arrays)
    return path


@pytest.mark.parametrize("arrays, message", [
    (dict(experts=np.zeros((4, 2), dtype=np.int32)), "'experts' must have 3 dimensions"),
    (dict(experts=np.zeros((4, 2, 2), dtype=np.float32)), "'experts' must hold integers"),
    (dict(experts=np.array([[[0, 9]]]), num_experts=np.int64(8)), "expert id 9"),
    (dict(experts=np.zeros((4, 2, 2), dtype=np.int32), weights=np.zeros((4, 2), np.float32)), "'weights' has shape"),
    (dict(experts=np.zeros((4, 2, 2), dtype=np.int32), sequence=np.zeros(3, np.int64)), "'sequence' has 3 entries"),
    (dict(weights=np.zeros((1, 1, 1), np.float32)), "no 'experts' array"),
])
def test_malformed_trace_fails_in_one_line(tmp_path, arrays, message):
    path = _bad_npz(tmp_path / "bad.npz", **arrays)
    result = CliRunner().invoke(main, ["trace", "stats", str(path)])
    assert result.exit_code == 2
    assert result.output.startswith("error: ") and result.output.count("\n") == 1
    assert message in result.output


def test_missing_or_garbage_trace_fails_in_one_line(tmp_path):
    result = CliRunner().invoke(main, ["trace", "stats", str(tmp_path / "none.npz")])
    assert result.exit_code == 2 and "does not exist" in result.output
    garbage = tmp_path / "garbage.npz"
    garbage.write_text("not a zip")
    result = CliRunner().invoke(main, ["trace", "stats", str(garbage)])
    assert result.exit_code == 2 and "not a readable .npz" in result.output


def test_real_process_prints_one_line_and_exits_2(tmp_path):
    """Through the installed console script, not CliRunner: exit code 2, one stderr line, no traceback."""
    import subprocess
    import sys
    from pathlib import Path

    path = _bad_npz(tmp_path / "bad.npz", experts=np.array([[[0, 9]]]), num_experts=np.int64(8))
    script = Path(sys.executable).with_name("moeplan")
    proc = subprocess.run([str(script), "trace", "stats", str(path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("error: ") and "expert id 9" in proc.stderr
