"""Issue 17, determinism of the lambda target: the profile cache does not depend on the working
directory, and the profile recorded in a plan reproduces the bundle without measuring again."""
import json

from click.testing import CliRunner

from moeplan.passes.analysis.profile.operators import default_cache_dir
from moeplan.passes.analysis.trace.format import save_trace
from synth_routing import synthesize_routed_tokens
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


def test_the_plan_records_its_profile_and_alone_reproduces_the_bundle(tmp_path, monkeypatch):
    model = small_model_dir(tmp_path)
    trace = tmp_path / "trace.npz"
    save_trace(synthesize_routed_tokens(tokens=3000, layers=3, experts=8, top_k=2, seq_len=64, seed=0), trace)
    first = _compile(model, trace, tmp_path / "a", "--cache-dir", str(tmp_path / "cache-a"))
    plan = json.loads(first["plan.json"])
    recorded = plan["inputs"]["profile"]
    assert recorded["model_hash"] == plan["inputs"]["profile_hash"] and recorded["rows"]
    # from another directory, with another (empty) default cache: the plan alone gives the same bytes
    (tmp_path / "other").mkdir()
    monkeypatch.chdir(tmp_path / "other")
    monkeypatch.setenv("MOEPLAN_CACHE_DIR", str(tmp_path / "cache-b"))
    result = CliRunner().invoke(main, ["codegen", str(tmp_path / "a" / "plan.json"), "--model", str(model),
                                       "--out", "b"])
    assert result.exit_code == 0, result.output
    out = tmp_path / "other" / "b"
    again = {p.relative_to(out).as_posix(): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}
    assert again == first
    assert not (tmp_path / "cache-b").exists()  # nothing was measured again
