"""examples/ci: the GitHub Actions workflow passes actionlint, the GitLab job passes GitLab's CI
schema (check-jsonschema's vendored copy), and the step they run (moeplan-ci.sh) compiles the
committed plan byte for byte, writes the report, and fails on a plan worse than the base."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CI = ROOT / "examples" / "ci"
BIN = Path(sys.executable).parent


def test_github_workflow_passes_actionlint():
    result = subprocess.run([str(BIN / "actionlint"), "-no-color", str(CI / "github-actions.yml")], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_gitlab_job_passes_gitlab_s_ci_schema():
    result = subprocess.run([str(BIN / "check-jsonschema"), "--builtin-schema", "vendor.gitlab-ci", str(CI / "gitlab-ci.yml")],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_linters_reject_broken_files(tmp_path):
    """The checks can fail: a misspelt key is caught by each."""
    bad = tmp_path / "bad.yml"
    bad.write_text((CI / "github-actions.yml").read_text().replace("runs-on:", "runs_on:"))
    assert subprocess.run([str(BIN / "actionlint"), "-no-color", str(bad)], capture_output=True).returncode != 0
    bad.write_text((CI / "gitlab-ci.yml").read_text().replace("script:\n", "scripts:\n"))
    assert subprocess.run([str(BIN / "check-jsonschema"), "--builtin-schema", "vendor.gitlab-ci", str(bad)],
                          capture_output=True).returncode != 0


def _git(repo: Path, *args):
    subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True)


@pytest.mark.slow
def test_the_ci_step_reproduces_the_committed_plan_and_fails_on_a_regression(tmp_path):
    """Run moeplan-ci.sh against a base branch whose committed plan is better than what the step
    compiles (max/mean load lowered by 5%): the job must fail, after writing the bundle, its report,
    and a plan.json identical to the committed examples/ci/plan.json."""
    repo = tmp_path / "repo"
    (repo / "deploy").mkdir(parents=True)
    committed = json.loads((CI / "plan.json").read_text())
    committed["predicted"]["max_over_mean_load"] *= 0.95
    (repo / "deploy" / "plan.json").write_text(json.dumps(committed, indent=2, sort_keys=True) + "\n")
    _git(repo, "init", "-q", "-b", "main")
    _git(repo, "-c", "user.name=ci", "-c", "user.email=ci@example.invalid", "add", ".")
    _git(repo, "-c", "user.name=ci", "-c", "user.email=ci@example.invalid", "commit", "-q", "-m", "base plan")
    out = tmp_path / "out"
    env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", MOEPLAN_OUT=str(out),
               MOEPLAN_PLAN="deploy/plan.json", MOEPLAN_MODEL=str(ROOT / "examples/configs/mixtral-8x7b.json"),
               MOEPLAN_TRACE=str(CI / "mixtral-8x7b.trace.npz"))
    result = subprocess.run(["bash", str(CI / "moeplan-ci.sh"), "main"], cwd=repo, env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "max_over_mean_load>+2%: A" in result.stdout and "CROSSED" in result.stdout
    new = json.loads((out / "bundle" / "plan.json").read_text())
    new["inputs"]["model"] = "examples/configs/mixtral-8x7b.json"  # the spec as given (here an absolute path)
    assert json.dumps(new, indent=2, sort_keys=True) + "\n" == (CI / "plan.json").read_text()
    assert (out / "bundle" / "report.html").read_text().startswith("<!DOCTYPE html>")
    shutil.rmtree(out)
