"""`moeplan compile --target sglang --slo ...` end to end (issue 38 item 3): the real CLI searches the
deployment for a real config and its recorded trace, writes the chosen one (plan.json's deployment and
topology, launch.sh), shows the frontier and why in --json and the report, and refuses in one line."""
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from moeplan.planner.cli import main

ROOT = Path(__file__).resolve().parents[1]
MIXTRAL = ROOT / "examples" / "configs" / "mixtral-8x7b.json"
TRACE = ROOT / "examples" / "ci" / "mixtral-8x7b.trace.npz"
SEARCH = ("--target", "sglang", "--hardware", "h100-sxm", "--workload", "64x1024+64", "--max-gpus", "8")


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    out = tmp_path_factory.mktemp("slo") / "bundle"
    result = run("compile", MIXTRAL, "--trace", TRACE, *SEARCH, "--slo", "tpot=30ms,ttft=5s", "--out", out, "--json")
    assert result.exit_code == 0, result.output
    return out, json.loads(result.output.strip().splitlines()[-1])


def test_compile_writes_the_searched_deployment(compiled):
    out, summary = compiled
    plan = json.loads((out / "plan.json").read_text())
    search, serving, deployment = plan["predicted"]["slo_search"], plan["predicted"]["serving"], plan["deployment"]
    chosen = search["chosen"]
    assert deployment["chosen_by"] == "slo_search" and deployment["hardware"] == "h100-sxm"
    assert plan["topology"]["nodes"] * plan["topology"]["gpus_per_node"] == chosen["gpus"]
    assert {k: deployment[k] for k in ("attention_dp", "moe_ep", "redundant_experts", "max_running_requests")} == \
        {k: chosen[k] for k in ("attention_dp", "moe_ep", "redundant_experts", "max_running_requests")}
    assert plan["communication"]["redundant"] == chosen["redundant_experts"]
    # the plan's own serving prediction (the written placement) is the one the search chose by
    assert serving["tpot_s"] == chosen["tpot_s"] <= 0.030 and chosen["ttft_s"] <= 5 and serving["fits"]
    assert chosen["routing"] == "trace" and chosen["gpus"] >= 2  # Mixtral's BF16 weights need two H100s
    assert all(not p["meets_slo"] for p in search["screened"] + search["finalists"] if p["gpus"] < chosen["gpus"])
    assert f"--tp-size {chosen['gpus']}" in (out / "launch.sh").read_text()
    assert summary["predicted"]["slo_search"]["frontier"] and summary["deployment"]["chosen_by"] == "slo_search"


def test_the_report_shows_the_frontier_and_why(compiled, tmp_path):
    out, summary = compiled
    assert "is the fewest that meets tpot=30ms,ttft=5s" in summary["predicted"]["slo_search"]["why"]
    result = run("report", out / "plan.json", "--out", tmp_path / "r.html")
    assert result.exit_code == 0, result.output
    page = (tmp_path / "r.html").read_text()
    assert "Frontier: output tokens/s per GPU against TPOT" in page and "is the fewest that meets" in page


def test_nothing_meets_is_one_line_and_writes_nothing(tmp_path):
    result = run("compile", MIXTRAL, "--trace", TRACE, *SEARCH, "--slo", "tpot=1ms", "--out", tmp_path / "b")
    assert result.exit_code == 2
    assert "no deployment up to 8 h100-sxm GPUs meets --slo tpot=1ms" in result.output and "the best is" in result.output
    last = result.output.strip().splitlines()[-1]  # after the passes' progress lines
    assert last.startswith("error: slo_search: no deployment up to 8") and "Traceback" not in result.output
    assert not (tmp_path / "b").exists()


@pytest.mark.parametrize("args, words", [
    (("--target", "sglang", "--hardware", "h100-sxm", "--slo", "5"), "does not apply to --target sglang"),
    (("--target", "sglang", "--hardware", "h100-sxm", "--slo", "tpot=35ms", "--nodes", "2"), "drop --nodes"),
    (("--target", "sglang", "--slo", "tpot=35ms"), "give --hardware"),
    (("--target", "sglang", "--max-gpus", "16"), "--max-gpus bounds the SLO search"),
    (("--target", "sglang", "--slo", "tpot=fast"), "not a duration"),
    (("--target", "lambda", "--slo", "tpot=35ms"), "does not apply to --target lambda"),
])
def test_bad_slo_commands_are_one_line(tmp_path, args, words):
    result = run("plan", MIXTRAL, "--trace", TRACE, *args, "--out", tmp_path / "p.json")
    assert result.exit_code == 2, result.output
    assert words in result.output and "Traceback" not in result.output
    assert not (tmp_path / "p.json").exists()


def test_codegen_rewrites_the_searched_bundle_from_its_plan(compiled, tmp_path):
    out, _ = compiled
    assert run("codegen", out / "plan.json", "--out", tmp_path / "again", "--quiet").exit_code == 0
    assert (tmp_path / "again" / "launch.sh").read_text() == (out / "launch.sh").read_text()
