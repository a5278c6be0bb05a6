"""`--json` stdout is one JSON document, also when HiGHS solves (issue 32: HiGHS printed its banner
on stdout). The real CLI in a fresh process each time: the banner is written by C code once per
process, so click's in-process runner (which captures Python's sys.stdout only) cannot see it."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from moeplan.passes.optimize.milp import quiet_highs

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "examples" / "tiny_moe"


def moeplan(*args, cwd=None) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "moeplan.planner.cli", *map(str, args)], capture_output=True,
                          text=True, cwd=cwd, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc


def one_json_document(stdout: str) -> dict:
    doc = json.loads(stdout)  # the whole of stdout, nothing before or after
    assert isinstance(doc, dict)
    return doc


@pytest.fixture(scope="module")
def tiny_trace(tmp_path_factory):
    out = tmp_path_factory.mktemp("trace") / "trace.npz"
    moeplan("trace", TINY, "--data", TINY / "corpus_heldout.txt", "--max-tokens", "768", "--out", out, "--quiet")
    return out


def test_quiet_highs_writes_nothing_on_the_file_descriptor():
    code = ("from moeplan.passes.optimize.milp import quiet_highs\n"
            "h = quiet_highs()\n"
            "import highspy\n"
            "h.passModel(highspy.HighsLp())\n"
            "h.run()\n"
            "print('done')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "done\n"


def test_quiet_highs_keeps_output_off():
    status, value = quiet_highs().getOptionValue("output_flag")
    assert value is False


def test_compile_json_stdout_is_json_with_the_ilp(tiny_trace, tmp_path):
    proc = moeplan("compile", TINY, "--trace", tiny_trace, "--target", "torchrun", "--nodes", "1",
                   "--gpus-per-node", "2", "--policy", "ilp", "--time-limit", "20", "--json", "--out", tmp_path / "b")
    doc = one_json_document(proc.stdout)
    assert doc["policy"] == "ilp" and doc["target"] == "torchrun"
    assert (tmp_path / "b" / "plan.json").is_file()


def test_plan_and_place_json_stdout_is_json_with_the_ilp(tiny_trace, tmp_path):
    plan = one_json_document(moeplan("plan", TINY, "--trace", tiny_trace, "--target", "torchrun", "--nodes", "1",
                                     "--gpus-per-node", "2", "--policy", "auto", "--json",
                                     "--out", tmp_path / "plan.json").stdout)
    assert json.loads((tmp_path / "plan.json").read_text())["target"] == "torchrun" and plan
    place = one_json_document(moeplan("place", "--trace", tiny_trace, "--nodes", "1", "--gpus-per-node", "2",
                                      "--policy", "ilp", "--json", "--out", tmp_path / "placement.json").stdout)
    assert place and (tmp_path / "placement.json").is_file()
