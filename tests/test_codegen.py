"""A bundle is a function of (plan.json, weights): `moeplan codegen` regenerates every target byte for byte."""
import json

import pytest
from click.testing import CliRunner

from moeplan.passes.analysis.trace.format import save_trace
from synth_routing import synthesize_routed_tokens
from moeplan.planner.cli import main
from runtime_fixtures import small_model_dir

TARGET_FLAGS = {
    "torchrun": ["--nodes", "1", "--gpus-per-node", "2", "--policy", "eplb", "--redundant", "2"],
    "kubernetes": ["--nodes", "2", "--gpus-per-node", "1", "--policy", "contiguous", "--image", "registry/x:1",
                   "--cpu-only"],
    "lambda": ["--slo", "60", "--batch-tokens", "512", "--cache-dir", "CACHE"],
}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("codegen")
    model = small_model_dir(tmp)
    trace = synthesize_routed_tokens(tokens=3000, layers=3, experts=8, top_k=2, seq_len=64, seed=0)
    save_trace(trace, tmp / "trace.npz")
    return tmp, model


def cli(*args):
    result = CliRunner().invoke(main, [str(a) for a in args])
    assert result.exit_code == 0, result.output
    return result.output


def files(root):
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("target", ["torchrun", "kubernetes", "lambda"])
def test_plan_then_codegen_equals_compile_and_a_bundle_regenerates_from_its_plan(setup, tmp_path, target):
    tmp, model = setup
    common = [model, "--trace", tmp / "trace.npz", "--target", target, "--quiet",
              *[tmp / "cache" if flag == "CACHE" else flag for flag in TARGET_FLAGS[target]]]
    cli("compile", *common, "--out", tmp_path / "compiled")
    cli("plan", *common, "--out", tmp_path / "plan.json")
    cli("codegen", tmp_path / "plan.json", "--out", tmp_path / "from-plan")
    cli("codegen", tmp_path / "compiled" / "plan.json", "--out", tmp_path / "from-bundle")
    compiled = files(tmp_path / "compiled")
    assert compiled == files(tmp_path / "from-plan") == files(tmp_path / "from-bundle")
    plan = json.loads((tmp_path / "plan.json").read_text())
    bundled = json.loads(compiled["plan.json"])
    assert plan["target"] == bundled["target"] == target
    # the bundle's plan is the plan plus its layout; every decision is the plan's own
    for key in ("placement", "communication", "predicted", "topology", "deployment", "inputs"):
        assert plan[key] == bundled[key]


def test_codegen_refuses_other_weights_than_the_bundle_was_made_with(setup, tmp_path):
    tmp, model = setup
    cli("compile", model, "--trace", tmp / "trace.npz", "--gpus-per-node", "2", "--policy", "contiguous", "--quiet",
        "--out", tmp_path / "b")
    other = small_model_dir(tmp_path / "other", seed=1)
    result = CliRunner().invoke(main, ["codegen", str(tmp_path / "b" / "plan.json"), "--model", str(other),
                                       "--out", str(tmp_path / "c")])
    assert result.exit_code == 2 and "weights_sha256 differs" in result.output
    assert not (tmp_path / "c").exists()


def test_codegen_of_a_missing_or_foreign_file_is_one_line(tmp_path):
    (tmp_path / "x.json").write_text("{\"version\": 7}")
    for path in (tmp_path / "none.json", tmp_path / "x.json"):
        result = CliRunner().invoke(main, ["codegen", str(path), "--out", str(tmp_path / "o")])
        assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1
