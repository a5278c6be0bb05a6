"""`moeplan place` end to end: write, evaluate, JSON output, and one-line errors with no file left."""
import json

import pytest
from click.testing import CliRunner

from moeplan.planner.cli import main


@pytest.fixture(scope="module")
def trace_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("place") / "t.npz"
    r = CliRunner().invoke(main, ["trace", "synth", "--layers", "4", "--experts", "16", "--k", "2", "--tokens", "2000",
                                  "--affinity", "0.7", "--zipf", "0.3", "--seed", "2", "--out", str(path)])
    assert r.exit_code == 0, r.output
    return path


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def test_place_ilp_then_evaluate_on_another_trace(trace_file, tmp_path):
    out = tmp_path / "placement.json"
    r = invoke("place", "--trace", trace_file, "--nodes", 2, "--gpus-per-node", 2, "--redundant", 4,
               "--time-limit", 20, "--out", out, "--json")
    assert r.exit_code == 0, r.output
    result = json.loads(r.output.strip().splitlines()[-1])
    doc = json.loads(out.read_text())
    assert doc["version"] == 1 and doc["policy"] == "ilp" and doc["topology"] == {"nodes": 2, "gpus_per_node": 2}
    assert len(doc["layers"]) == 4 and all(len(l["devices"]) == 4 for l in doc["layers"])
    for key in ("gpu_local_fraction", "node_local_fraction", "max_over_mean_load", "objective", "bound", "gap"):
        assert key in doc["metrics"]
    assert "solve_seconds" in result and "solve_seconds" not in doc["metrics"]

    other = tmp_path / "other.npz"
    assert invoke("trace", "synth", "--layers", 4, "--experts", 16, "--k", 2, "--tokens", 500, "--seed", 9,
                  "--out", other).exit_code == 0
    r = invoke("place", "--evaluate", out, "--trace", other, "--json")
    assert r.exit_code == 0, r.output
    scored = json.loads(r.output.strip().splitlines()[-1])
    assert 0 <= scored["gpu_local_fraction"] <= 1 and scored["policy"] == "ilp"


def test_timings_flag_records_solve_seconds(trace_file, tmp_path):
    out = tmp_path / "p.json"
    r = invoke("place", "--trace", trace_file, "--nodes", 1, "--gpus-per-node", 4, "--time-limit", 10,
               "--balance-base", "eplb", "--timings", "--out", out)
    assert r.exit_code == 0, r.output
    assert "solve_seconds" in json.loads(out.read_text())["metrics"]


@pytest.mark.parametrize("args, needle", [
    (["--nodes", 3, "--gpus-per-node", 1, "--policy", "contiguous"], "divisible"),
    (["--nodes", 2, "--gpus-per-node", 2, "--balance", 0.0], "infeasible at MoE layer"),
    (["--nodes", 3, "--gpus-per-node", 1], "do not divide evenly"),
])
def test_bad_requests_exit_2_with_one_line_and_no_file(trace_file, tmp_path, args, needle):
    out = tmp_path / "placement.json"
    r = invoke("place", "--trace", trace_file, *args, "--out", out)
    assert r.exit_code == 2, r.output
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0]
    assert not out.exists() and not list(tmp_path.iterdir())


def test_missing_trace_and_missing_placement_are_one_line_errors(tmp_path):
    r = invoke("place", "--trace", tmp_path / "nope.npz", "--nodes", 1, "--gpus-per-node", 2, "--out", tmp_path / "p.json")
    assert r.exit_code == 2 and "does not exist" in r.output and len(r.output.strip().splitlines()) == 1
    r = invoke("place", "--evaluate", tmp_path / "nope.json", "--trace", tmp_path / "t.npz")
    assert r.exit_code == 2 and "placement file" in r.output


def test_malformed_placement_is_rejected(trace_file, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"version": 1, "policy": "x", "topology": {"nodes": 1, "gpus_per_node": 2},
                               "layers": [{"layer": 0, "devices": [[0, 0], [1]]}]}))
    r = invoke("place", "--evaluate", bad, "--trace", trace_file)
    assert r.exit_code == 2 and "twice" in r.output
