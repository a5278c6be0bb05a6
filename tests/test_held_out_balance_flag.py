"""`--held-out-balance`: --balance bounds the expected held-out max load, not the planning trace's.

The flag lowers each layer's planning cap by the rise EPLB's packing shows across blocks of the
trace (ilp.staged_placement), so the placement planned with it is at least as balanced on the
planning trace; it is recorded in the placement's metrics and left out of plans made without it.
"""
import json

from click.testing import CliRunner

from moeplan.planner.cli import main


def _place(tmp_path, *extra) -> dict:
    out = tmp_path / f"placement{''.join(extra)}.json"
    result = CliRunner().invoke(main, ["place", "--trace", str(tmp_path / "t.npz"), "--nodes", "1", "--gpus-per-node", "8",
                                       "--redundant", "8", "--out", str(out), *extra])
    assert result.exit_code == 0, result.output
    return json.loads(out.read_text())


def test_held_out_balance_plans_under_tighter_caps_and_is_recorded(tmp_path):
    result = CliRunner().invoke(main, ["trace", "synth", "--layers", "4", "--experts", "32", "--k", "2", "--tokens", "6000",
                                       "--seed", "1", "--out", str(tmp_path / "t.npz")])
    assert result.exit_code == 0, result.output
    plain, held_out = _place(tmp_path), _place(tmp_path, "--held-out-balance")
    assert "held_out_balance" not in plain["metrics"] and held_out["metrics"]["held_out_balance"] is True
    assert plain["layers"] != held_out["layers"]
    assert held_out["metrics"]["max_over_mean_load"] < plain["metrics"]["max_over_mean_load"] <= 1.1 + 1e-9
    assert held_out["metrics"]["stopped_by"] == plain["metrics"]["stopped_by"] == "work"
