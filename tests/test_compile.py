"""`moeplan compile`: the pass pipeline, the plan it records, determinism and atomic output."""
import json

import pytest
from click.testing import CliRunner

from moeplan.passes.analysis.trace.format import save_trace
from moeplan.passes.optimize.placement.metrics import score_placement
from moeplan.passes.optimize.placement.schema import placement_from_dict
from moeplan.planner.cli import main as cli_main  # the CLI as users run it: every command guarded (--force)
from moeplan.planner.commands.compile import compile_cmd
import moeplan
from moeplan.core.errors import UserError
from moeplan.core.pass_manager import Pass, PassManager
from runtime_fixtures import SMALL, random_trace, small_model_dir


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("compile")
    model_dir = small_model_dir(root)
    trace = random_trace(400, SMALL["num_layers"], SMALL["num_experts"])
    save_trace(trace, root / "trace.npz")
    return model_dir, root / "trace.npz", trace


def _files(root):
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_compile_writes_a_bundle_whose_plan_records_the_placement_and_its_prediction(tmp_path, inputs):
    model_dir, trace_path, trace = inputs
    result = CliRunner().invoke(compile_cmd, [str(model_dir), "--trace", str(trace_path), "--nodes", "1",
                                              "--gpus-per-node", "2", "--policy", "ilp", "--time-limit", "5",
                                              "--out", str(tmp_path / "b"), "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output.strip().splitlines()[-1])
    assert [p["pass"] for p in summary["passes"]] == ["runtime", "import", "trace", "affinity", "placement", "cost", "expert_cache", "plan", "codegen"]
    plan = json.loads((tmp_path / "b" / "plan.json").read_text())
    assert plan["version"] == 1 and plan["target"] == "torchrun" and plan["topology"] == {"nodes": 1, "gpus_per_node": 2}
    placement = placement_from_dict(json.loads((tmp_path / "b" / "placement.json").read_text()))
    score = score_placement(trace, placement.hosts(), placement.topology)
    assert plan["predicted"]["gpu_local_fraction"] == pytest.approx(score.gpu_local_fraction, abs=1e-6)
    assert summary["predicted"]["gpu_local_fraction"] == pytest.approx(score.gpu_local_fraction, abs=1e-6)
    assert plan["shards"] == ["shards/rank-00000.safetensors", "shards/rank-00001.safetensors"]


def test_compiling_twice_gives_identical_bytes(tmp_path, inputs):
    model_dir, trace_path, _ = inputs
    for name in ("a", "b"):
        moeplan.compile(model_dir, trace_path, tmp_path / name, gpus_per_node=2, policy="eplb", redundant=2, time_limit=5.0)
    assert _files(tmp_path / "a") == _files(tmp_path / "b")


def test_a_bad_trace_leaves_the_previous_bundle_untouched(tmp_path, inputs):
    model_dir, _, _ = inputs
    wrong = random_trace(50, SMALL["num_layers"] + 1, SMALL["num_experts"])
    save_trace(wrong, tmp_path / "wrong.npz")
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("previous")
    result = CliRunner().invoke(cli_main, ["compile", str(model_dir), "--trace", str(tmp_path / "wrong.npz"),
                                              "--gpus-per-node", "2", "--policy", "contiguous", "--out", str(out), "--quiet",
                                              "--force"])  # without --force, a non-bundle --out is refused up front
    assert result.exit_code == 2
    assert "MoE layers" in result.output + str(result.exception)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.")]


def test_a_model_the_runtime_cannot_run_is_refused_in_one_line(tmp_path, inputs):
    _, trace_path, _ = inputs
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(UserError, match="no MoE block this runtime recognises"):
        moeplan.compile(tmp_path / "model", trace_path, tmp_path / "o", gpus_per_node=2, policy="contiguous")


def test_pass_manager_orders_passes_by_what_they_read_and_times_every_pass():
    calls = []

    def step(name, value):
        def run(facts):
            calls.append(name)
            return value(facts)
        return run

    passes = [Pass("triple", ("y",), ("z",), step("triple", lambda f: {"z": f["y"] * 3})),
              Pass("double", ("x",), ("y",), step("double", lambda f: {"y": f["x"] * 2}))]
    manager = PassManager(passes, quiet=True)
    assert manager.run({"x": 3})["z"] == 18
    assert calls == ["double", "triple"]
    assert [t["pass"] for t in manager.timings()] == ["double", "triple"]


def test_pass_manager_runs_only_what_a_wanted_fact_needs():
    passes = [Pass("a", ("x",), ("y",), lambda f: {"y": 1}), Pass("b", ("x",), ("w",), lambda f: {"w": 2}),
              Pass("c", ("y",), ("z",), lambda f: {"z": 3})]
    manager = PassManager(passes, quiet=True)
    facts = manager.run({"x": 0}, want=("z",))
    assert "w" not in facts and facts["z"] == 3
    assert [t["pass"] for t in manager.timings()] == ["a", "c"]


def test_pass_manager_names_the_failing_pass_and_checks_preconditions_first():
    ran = []

    def refuse(facts):
        raise UserError("the trace has 3 MoE layers but the model has 2")

    manager = PassManager([Pass("placement", ("x",), ("y",), lambda f: ran.append(1) or {"y": 1}, check=refuse)], quiet=True)
    with pytest.raises(UserError, match="^placement: the trace has 3 MoE layers"):
        manager.run({"x": 0})
    assert ran == []


def test_pass_manager_checks_declared_facts():
    with pytest.raises(RuntimeError, match="reads \\['missing'\\]"):
        PassManager([Pass("p", ("missing",), ("y",), lambda f: {"y": 1})], quiet=True).run({})
    with pytest.raises(RuntimeError, match="declared"):
        PassManager([Pass("p", (), ("y",), lambda f: {"z": 1})], quiet=True).run({})
