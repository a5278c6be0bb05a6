"""Issue 17 fuzz suite: malformed traces, JSONL logs, placements, configs and plans through the CLI.

Each case must exit 0 with valid output or exit 2 with one `error:` line, never a traceback and
never a changed input (`fuzz_cases.run_case`). The examples are derandomized so CI sees the same
cases every run and stays well under a minute; `benchmarks/fuzz.py` runs the same generators with
fresh seeds and many more examples, and prints the counts.
"""
import json
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from click.testing import CliRunner

import fuzz_cases as F
from moeplan.passes.analysis.trace.format import save_trace
from synth_routing import synthesize_routed_tokens
from moeplan.planner.cli import main

def ci(max_examples):
    return settings(CI_BASE, max_examples=max_examples)


CI_BASE = settings(derandomize=True, deadline=None, database=None, print_blob=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example])


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A good trace (with token ids), a placement and a lambda plan made from it, to mutate."""
    root = tmp_path_factory.mktemp("fuzz")
    trace = root / "trace.npz"
    save_trace(synthesize_routed_tokens(tokens=2000, layers=2, experts=8, top_k=2, seq_len=64, seed=0), trace)
    model = root / "hf"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(F.HF_CONFIG))
    runner = CliRunner()
    placement = root / "placement.json"
    assert runner.invoke(main, ["place", "--trace", str(trace), "--nodes", "1", "--gpus-per-node", "2",
                                "--policy", "eplb", "--redundant", "2", "--out", str(placement), "--json"]).exit_code == 0
    plan = root / "plan.json"
    result = runner.invoke(main, ["plan", str(model), "--trace", str(trace), "--target", "lambda", "--slo", "30", "--batch-tokens", "1000",
                                  "--profile-budget", "0", "--cache-dir", str(root / "cache"), "--out", str(plan), "--quiet"])
    assert result.exit_code == 0, result.output
    return {"trace": trace, "placement": json.loads(placement.read_text()), "plan": json.loads(plan.read_text())}


@ci(80)
@given(data=F.trace_file_bytes(), command=st.sampled_from(["stats", "contiguous", "eplb"]))
def test_fuzz_trace_files(data, command):
    with tempfile.TemporaryDirectory() as work:
        F.trace_case(Path(work), data, command)


@ci(80)
@given(data=F.routing_log_bytes(), num_experts=st.sampled_from([None, None, 1, 8, 2**40]))
def test_fuzz_routing_logs(data, num_experts):
    with tempfile.TemporaryDirectory() as work:
        F.jsonl_case(Path(work), data, num_experts)


@ci(40)
@given(data=st.data())
def test_fuzz_placements(corpus, data):
    doc = data.draw(F.mutated_json(corpus["placement"]))
    with tempfile.TemporaryDirectory() as work:
        F.placement_case(Path(work), doc, corpus["trace"])


@ci(40)
@given(data=st.data())
def test_fuzz_lambda_plans(corpus, data):
    doc = data.draw(F.mutated_json(corpus["plan"]))
    with tempfile.TemporaryDirectory() as work:
        F.plan_case(Path(work), doc, corpus["trace"])


@ci(30)
@given(data=F.config_bytes())
def test_fuzz_model_configs(data):
    with tempfile.TemporaryDirectory() as work:
        F.config_case(Path(work), data)

