"""The cost of an API call a Lambda plan states (compile's summary, the README, plan.json's
`predicted.api_call`, the answer's X-Moeplan-* headers) against what the local cloud recorded for
that very call: the bundle's own front function answering `/v1/completions` through its state
machine, every function in its own process, S3 through moto (planner/launch/lambda_cloud.py).

The counts AWS bills a fee for (Lambda invocations, S3 PUTs and GETs, EXPRESS executions) must be
equal, hence the request charges too, priced by the one billing rule (runtime/lambda_/charges.py)
on both sides. The call has a one-token prompt: every forward step then has one token, which picks
exactly top_k experts, and the cost model's expected invocations (sum over experts of k x share)
are exactly top_k per MoE layer, whatever the routing; a longer prompt's first step invokes as
many experts as its tokens happen to pick, which only an expectation can predict. Durations are
the handlers' measured seconds on this machine against the profile's prediction, so they are not
compared (no timed assertion); both are billed by the same rule. The call runs twice with the same
greedy prompt and only the second is counted: the first loads every function's weights it needs
(the model prices warm containers, as a deployment kept warm runs)."""
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from moeplan.passes.analysis.trace.format import save_trace
from moeplan.planner.cli import main
from moeplan.planner.launch.lambda_cloud import LocalCloud
from moeplan.planner.launch.lambda_serve import FRONT, function_url_event
from moeplan.runtime.lambda_.charges import request_charges_usd
from runtime_fixtures import EXAMPLE
from synth_routing import synthesize_routed_tokens

PROMPT, NEW_TOKENS = "T", 5  # one byte: one token of TinyMoE's byte vocabulary


@pytest.fixture(scope="module")
def bundles(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lambda_api_call")
    save_trace(synthesize_routed_tokens(tokens=2000, layers=6, experts=16, top_k=2, seq_len=64, seed=0), tmp / "trace.npz")
    out = {}
    for methods in ("s3", "direct"):
        result = CliRunner().invoke(main, [
            "compile", str(EXAMPLE), "--trace", str(tmp / "trace.npz"), "--target", "lambda", "--slo", "60",
            "--batch-tokens", "512", "--methods", methods, "--profile-budget", "1", "--cache-dir", str(tmp / "cache"),
            "--prompt-tokens", "1", "--new-tokens", str(NEW_TOKENS), "--requests-per-second", "2",
            "--out", str(tmp / methods)])
        assert result.exit_code == 0, result.output
        out[methods] = (tmp / methods, result.output)
    return out


def call_front(cloud: LocalCloud) -> dict:
    body = json.dumps({"model": "tiny_moe", "prompt": PROMPT, "max_tokens": NEW_TOKENS, "temperature": 0}).encode()
    answer = cloud.invoke(FRONT, function_url_event("POST", "/v1/completions", {"content-type": "application/json"},
                                                    body, "127.0.0.1"))
    assert answer["statusCode"] == 200, answer
    return answer["headers"]


def recorded_call(bundle: Path) -> tuple:
    """(the answer's headers, what the local cloud recorded for the second of two identical calls)."""
    plan = json.loads((bundle / "plan.json").read_text())
    prices = plan["inputs"]["facts"]["platform"]
    cloud = LocalCloud(bundle, int(prices["payload_limit_bytes"]), parameters={"ApiKey": ""})
    try:
        cloud.upload_weights()
        call_front(cloud)  # warms every function this greedy call touches
        with cloud.lock:
            cloud.invocations.clear()
            cloud.executions.clear()
        headers = call_front(cloud)
        return headers, cloud.bill(prices), plan
    finally:
        cloud.close()


@pytest.mark.parametrize("methods", [pytest.param("s3", marks=pytest.mark.slow), "direct"])
def test_the_stated_cost_of_a_call_counts_what_the_local_cloud_recorded(bundles, methods):
    bundle, output = bundles[methods]
    headers, recorded, plan = recorded_call(bundle)
    stated = plan["predicted"]["api_call"]
    assert (stated["prompt_tokens"], stated["new_tokens"]) == (1, NEW_TOKENS)
    assert int(headers["x-moeplan-prompt-tokens"]) == 1 and int(headers["x-moeplan-forward-steps"]) == NEW_TOKENS

    # every request AWS charges a fee for, as the plan (and so the README and the headers) counts it
    assert recorded["executions"] == stated["executions"] == 1
    assert recorded["lambda_invocations"] == pytest.approx(stated["lambda_invocations"], abs=1e-6)
    assert recorded["s3_puts"] == pytest.approx(stated["s3_puts"], abs=1e-6)
    assert recorded["s3_gets"] == pytest.approx(stated["s3_gets"], abs=1e-6)
    if methods == "s3":  # expert rows in and out through S3: top_k replicas per layer per step, each 2 PUTs + 2 GETs
        assert recorded["s3_puts"] >= 2 * 2 * 6 * NEW_TOKENS
    prices = plan["inputs"]["facts"]["platform"]
    for key in ("lambda_requests", "s3_requests"):
        assert recorded["usd"][key] == pytest.approx(stated["usd"][key], rel=1e-9)
    fees = request_charges_usd(recorded["usd"], recorded["executions"], prices)
    assert float(headers["x-moeplan-request-charges-usd"]) == pytest.approx(fees, rel=1e-9)

    # the headers state what the plan states for the same call, by charge too
    assert float(headers["x-moeplan-predicted-cost-usd"]) == pytest.approx(stated["usd"]["total"], rel=1e-7)
    breakdown = dict(part.split("=") for part in headers["x-moeplan-cost-breakdown-usd"].split("; "))
    assert set(breakdown) == {"lambda_duration", "lambda_requests", "s3_requests", "express", "http"}
    for key, value in breakdown.items():
        assert float(value) == pytest.approx(stated["usd"][key], rel=1e-7, abs=1e-15)
    assert recorded["lambda_gb_s"] > 0 and recorded["usd"]["lambda_duration"] > 0  # measured, billed by the same rule

    # compile's summary and the README state that call and its month, S3 requests and Step Functions in
    total = stated["usd"]["total"]
    assert f"predicted ${total:.8f} per API call of 1 prompt + {NEW_TOKENS} new tokens" in output
    assert f"S3 requests ${stated['usd']['s3_requests']:.8f}" in output and "Step Functions $" in output
    readme = (bundle / "README.md").read_text()
    assert f"One API call of 1 prompt + {NEW_TOKENS} new tokens" in readme and f"**${total:.8f}**" in readme
    assert f"| S3 requests ({stated['s3_puts']:.1f} PUTs, {stated['s3_gets']:.1f} GETs" in readme
    monthly = total * 2 * 30 * 24 * 3600
    assert stated["monthly_usd"] == pytest.approx(monthly, rel=1e-7)
    assert f"At 2.0 such call(s) per second (2,592,000 s per month): **${monthly:.2f} per month**" in readme
