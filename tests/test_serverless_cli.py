"""`moeplan plan --target lambda` and `moeplan simulate`: outputs, determinism, one-line errors."""
import json

import pytest
from click.testing import CliRunner

from synth_routing import synthesize_routed_tokens
from moeplan.passes.analysis.trace.format import save_trace
from moeplan.planner.cli import main
from test_profile import small_model_dir


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serverless")
    model = small_model_dir(tmp)
    tr = synthesize_routed_tokens(tokens=4000, layers=2, experts=4, top_k=2, seq_len=64, seed=0)
    save_trace(tr, tmp / "trace.npz")
    held = synthesize_routed_tokens(tokens=2000, layers=2, experts=4, top_k=2, seq_len=64, seed=1)
    save_trace(held, tmp / "held.npz")
    base = ["plan", str(model), "--trace", str(tmp / "trace.npz"), "--target", "lambda", "--batch-tokens", "1000",
            "--profile-budget", "0", "--cache-dir", str(tmp / "cache")]
    return tmp, base


def run(args):
    result = CliRunner().invoke(main, args)
    return result.exit_code, result.output


def test_plan_then_simulate(setup):
    tmp, base = setup
    code, out = run(base + ["--slo", "30", "--out", str(tmp / "plan.json"), "--json"])
    assert code == 0, out
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["moe_cost_per_batch_usd"] > 0 and summary["latency_s"] <= 30
    assert set(summary["predictor_error"]) == {"ours", "lina", "marginal"}
    plan = json.loads((tmp / "plan.json").read_text())
    assert plan["target"] == "lambda" and plan["communication"]["serverless_version"] == 1
    layers = plan["placement"]["layers"]
    assert len(layers) == 2 and all(len(l["experts"]) == 4 for l in layers)
    assert all(x["memory_mb"] in plan["inputs"]["facts"]["platform"]["memory_options_mb"] for l in layers for x in l["experts"])
    # same inputs (profile cached) -> byte-identical plan
    code, _ = run(base + ["--slo", "30", "--out", str(tmp / "plan2.json"), "--quiet"])
    assert code == 0 and (tmp / "plan.json").read_bytes() == (tmp / "plan2.json").read_bytes()
    code, out = run(["simulate", str(tmp / "plan.json"), "--trace", str(tmp / "held.npz")])
    assert code == 0, out
    assert "cost per batch" in out and "throughput" in out and "direct" in out or "s3" in out
    code, out = run(["simulate", str(tmp / "plan.json"), "--trace", str(tmp / "held.npz"), "--json"])
    sim = json.loads(out.strip().splitlines()[-1])
    assert sim["batches"] == 2 and sim["moe_cost_per_batch_usd"] > 0 and sim["throughput_tokens_per_s"] > 0


def test_bo_iterations_are_reported(setup):
    tmp, base = setup
    code, out = run(base + ["--slo", "30", "--out", str(tmp / "bo.json"), "--bo-iterations", "2", "--bo-q", "8", "--json"])
    assert code == 0, out
    assert 1 <= json.loads(out.strip().splitlines()[-1])["bo_iterations"] <= 2
    bo = json.loads((tmp / "bo.json").read_text())["predicted"]["bo"]
    assert bo["best_cost"] <= bo["baseline_cost"] and len(bo["history"]) == bo["iterations"] + 1


@pytest.mark.parametrize("extra, words", [
    (["--slo", "0.001"], "SLO constraint cannot be met"),
    (["--slo", "-1"], "--slo must be a positive"),
    (["--slo", "30", "--methods", "carrier_pigeon"], "unknown method"),
    (["--slo", "30", "--batch-tokens", "0"], "--batch-tokens must be a positive"),
])
def test_plan_bad_input_is_one_line_exit_2(setup, extra, words):
    tmp, base = setup
    out_file = tmp / "never.json"
    code, out = run(base + extra + ["--out", str(out_file), "--quiet"])
    assert code == 2, out
    lines = [l for l in out.splitlines() if l.strip()]
    assert len(lines) == 1 and words in lines[0], out
    assert not out_file.exists()


def test_infeasible_slo_names_the_closest_feasible_value(setup):
    tmp, base = setup
    code, out = run(base + ["--slo", "0.001", "--out", str(tmp / "never.json")])
    assert code == 2 and "closest feasible: --slo " in out


def test_simulate_bad_input_is_one_line_exit_2(setup, tmp_path):
    tmp, _ = setup
    code, out = run(["simulate", str(tmp_path / "missing.json"), "--trace", str(tmp / "held.npz")])
    assert code == 2 and "does not exist" in out and len(out.strip().splitlines()) == 1
    other = tmp_path / "torchrun.json"
    other.write_text(json.dumps({"version": 1, "target": "torchrun", "model": {}, "topology": {}, "placement": {},
                                 "communication": {}, "predicted": {}}))
    code, out = run(["simulate", str(other), "--trace", str(tmp / "held.npz")])
    assert code == 2 and "takes lambda plans" in out and "offload plans" in out and len(out.strip().splitlines()) == 1


@pytest.mark.parametrize("edit, words", [
    (lambda d: d["placement"]["layers"][0]["experts"][0].update(replicas=0), "0 replicas"),
    (lambda d: d["placement"]["layers"][0]["experts"][0].update(memory_mb=-5), "-5 MB"),
    (lambda d: d["placement"]["layers"][0]["experts"][0].update(replicas=float("inf")), "malformed"),
    (lambda d: d["communication"].update(batch_tokens=0), "batch_tokens"),
])
def test_simulate_refuses_a_hand_edited_plan_in_one_line(setup, tmp_path, edit, words):
    """Issue 17: a plan edited to 0 replicas divided by zero in simulate."""
    tmp, base = setup
    good = tmp_path / "plan.json"
    code, out = run(base + ["--slo", "30", "--out", str(good), "--quiet"])
    assert code == 0, out
    doc = json.loads(good.read_text())
    edit(doc)
    edited = tmp_path / "edited.json"
    edited.write_text(json.dumps(doc))
    code, out = run(["simulate", str(edited), "--trace", str(tmp / "held.npz")])
    assert code == 2 and out.startswith("error: ") and len(out.strip().splitlines()) == 1 and words in out, out


def test_a_generation_request_is_priced_and_reusing_kv_is_cheaper_than_recomputing(setup):
    """`simulate --prompt-tokens P --new-tokens N`: the plan's request cost model (the figures a served
    Lambda bundle states per response); more tokens cost more, and from two tokens on, the bundle's
    K/V reuse costs less than one full forward per token."""
    tmp, base = setup
    if not (tmp / "plan.json").exists():
        assert run(base + ["--slo", "30", "--out", str(tmp / "plan.json")])[0] == 0
    figures = {}
    for n in (1, 8, 64):
        code, out = run(["simulate", str(tmp / "plan.json"), "--prompt-tokens", "32", "--new-tokens", str(n), "--json"])
        assert code == 0, out
        figures[n] = json.loads(out.strip().splitlines()[-1])
    assert figures[1]["predicted_cost_usd"] == pytest.approx(figures[1]["recompute"]["predicted_cost_usd"])
    assert figures[1]["billed_gb_s"] < figures[8]["billed_gb_s"] < figures[64]["billed_gb_s"]
    for n in (8, 64):
        assert figures[n]["predicted_cost_usd"] < figures[n]["recompute"]["predicted_cost_usd"]
        assert figures[n]["request_charges_usd"] > 0 and figures[n]["latency_s"] > figures[1]["latency_s"]
    code, out = run(["simulate", str(tmp / "plan.json"), "--new-tokens", "4"])
    assert code == 2 and out.count("\n") == 1 and "--prompt-tokens" in out


def test_a_plan_slower_than_the_http_entry_waits_is_refused_in_one_line(setup):
    """An API Gateway HTTP API waits 30 s for its integration: a plan whose one-token request is
    predicted to take longer cannot serve anything behind it."""
    tmp, base = setup
    slow = tmp / "slow_start.yaml"
    slow.write_text("warm_start_s: 20\n")
    code, out = run(base + ["--slo", "600", "--platform", str(slow), "--http-entry", "http-api",
                            "--out", str(tmp / "slow.json"), "--quiet"])
    assert code == 2 and out.count("\n") == 1 and "30 s" in out and "function-url" in out, out
    assert not (tmp / "slow.json").exists()
    code, out = run(base + ["--slo", "600", "--platform", str(slow), "--out", str(tmp / "slow.json"),
                            "--prompt-tokens", "1", "--new-tokens", "1"])
    assert code == 0, out  # the Function URL entry waits for the EXPRESS execution's 5 minutes


def test_the_plan_prices_the_api_call_the_user_names_as_simulate_does(setup):
    """--prompt-tokens / --new-tokens name the API call whose cost the plan states with every charge
    (Lambda duration and requests, S3 requests, the EXPRESS execution), the same figure `simulate`
    prices for that call; without them the call is 32 prompt + 8 new tokens."""
    tmp, base = setup
    code, out = run(base + ["--slo", "30", "--prompt-tokens", "5", "--new-tokens", "3", "--requests-per-second", "0.5",
                            "--out", str(tmp / "call.json"), "--json"])
    assert code == 0, out
    summary = json.loads(out.strip().splitlines()[-1])
    call = json.loads((tmp / "call.json").read_text())["predicted"]["api_call"]
    assert summary["api_call"] == call and (call["prompt_tokens"], call["new_tokens"]) == (5, 3)
    code, sim = run(["simulate", str(tmp / "call.json"), "--prompt-tokens", "5", "--new-tokens", "3", "--json"])
    sim = json.loads(sim.strip().splitlines()[-1])
    assert call["usd"]["total"] == pytest.approx(sim["predicted_cost_usd"], rel=1e-7)
    assert call["usd"] == pytest.approx(sim["detail"]["usd"], rel=1e-7) and call["usd"]["s3_requests"] > 0
    assert call["monthly_usd"] == pytest.approx(call["usd"]["total"] * 0.5 * 2_592_000, rel=1e-7)
    # the batch the sizing minimises is not an API call, and is named as a batch
    assert summary["cost_per_batch_usd"] == json.loads((tmp / "call.json").read_text())["predicted"]["cost_per_request_usd"]
    code, out = run(base + ["--slo", "30", "--out", str(tmp / "default_call.json")])
    assert code == 0, out
    default = json.loads((tmp / "default_call.json").read_text())["predicted"]["api_call"]
    assert (default["prompt_tokens"], default["new_tokens"]) == (32, 8)
    assert f"predicted ${default['usd']['total']:.8f} per API call of 32 prompt + 8 new tokens" in out
    assert "sized for batches of 1000 tokens" in out


@pytest.mark.parametrize("extra, words", [
    (["--prompt-tokens", "0"], "--prompt-tokens and --new-tokens name the API call"),
    (["--new-tokens", "0"], "--new-tokens"),
])
def test_a_bad_api_call_is_one_line_exit_2(setup, extra, words):
    tmp, base = setup
    code, out = run(base + ["--slo", "30", "--out", str(tmp / "never.json"), "--quiet"] + extra)
    assert code == 2 and out.count("\n") == 1 and words in out, out
    assert not (tmp / "never.json").exists()


def test_an_api_call_longer_than_the_http_entry_waits_is_refused_in_one_line(setup):
    tmp, base = setup
    slow = tmp / "slower_start.yaml"
    slow.write_text("warm_start_s: 1\n")
    code, out = run(base + ["--slo", "600", "--platform", str(slow), "--http-entry", "http-api", "--new-tokens", "200",
                            "--out", str(tmp / "long_call.json"), "--quiet"])
    assert code == 2 and out.count("\n") == 1 and "200 new tokens" in out and "--new-tokens" in out, out
    assert not (tmp / "long_call.json").exists()
