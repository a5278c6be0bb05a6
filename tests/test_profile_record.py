"""Issue 17, determinism of the lambda target: the profile cache does not depend on the working
directory, and the profile recorded in a plan reproduces the bundle without measuring again."""
import json
import os

from click.testing import CliRunner

from moeplan.passes.analysis.profile.operators import default_cache_dir
from moeplan.passes.analysis.trace.format import save_trace
from moeplan.passes.analysis.trace.synth_routing import synthesize_routed_tokens
from moeplan.planner.cli import main
from runtime_fixtures import small_model_dir


def _compile(model, trace, out, *extra):
    args = ["compile", str(model), "--trace", str(trace), "--target", "lambda", "--slo", "60", "--batch-tokens", "512",
            "--out", str(out), "--quiet", *extra]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    return {p.relative_to(out).as_posix(): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


def test_default_cache_dir_is_absolute_and_the_same_from_any_directory(tmp_path, monkeypatch):
    monkeypatch.delenv("MOEPLAN_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", "relative-cache")
    first = default_cache_dir()
    monkeypatch.chdir(tmp_path)
    assert default_cache_dir().is_absolute() and first.is_absolute()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    a = default_cache_dir()
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert default_cache_dir() == a == tmp_path / "xdg" / "moeplan" / "profiles"


def test_the_plan_records_its_profile_and_reproduces_the_bundle_from_it(tmp_path):
    model = small_model_dir(tmp_path)
    trace = tmp_path / "trace.npz"
    save_trace(synthesize_routed_tokens(tokens=3000, layers=3, experts=8, top_k=2, seq_len=64, seed=0), trace)
    first = _compile(model, trace, tmp_path / "a", "--cache-dir", str(tmp_path / "cache-a"))
    plan = json.loads(first["plan.json"])
    recorded = plan["inputs"]["profile"]
    assert recorded["model_hash"] == plan["inputs"]["profile_hash"] and recorded["rows"]
    # another directory, an empty cache: reusing the plan's profile gives the same bytes ...
    os.makedirs(tmp_path / "other")
    again = _compile(model, trace, tmp_path / "other" / "b", "--cache-dir", str(tmp_path / "cache-b"),
                     "--profile-from", str(tmp_path / "a" / "plan.json"))
    assert again == first
    assert not (tmp_path / "cache-b").exists()  # ... without measuring (nothing was cached)
    # a profile recorded for another model is refused in one line
    other = small_model_dir(tmp_path / "m2", hidden_size=48)
    result = CliRunner().invoke(main, ["compile", str(other), "--trace", str(trace), "--target", "lambda", "--slo", "60",
                                       "--out", str(tmp_path / "c"), "--profile-from", str(tmp_path / "a")])
    assert result.exit_code == 2 and "another model" in result.output and result.output.count("\n") == 1, result.output
