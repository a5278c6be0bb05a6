"""`moeplan run DIR --verify` on Lambda bundles: the state machine, handlers in their own processes, local S3."""
import json

import pytest
from click.testing import CliRunner

from moeplan.planner.launch.lambda_cloud import CloudError, LocalCloud
from synth_routing import synthesize_routed_tokens
from moeplan.passes.analysis.trace.format import save_trace
from moeplan.planner.cli import main
from runtime_fixtures import small_model_dir


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lambda_verify")
    save_trace(synthesize_routed_tokens(tokens=3000, layers=3, experts=8, top_k=2, seq_len=64, seed=0), tmp / "trace.npz")
    model = small_model_dir(tmp)
    (tmp / "prompts.txt").write_text("hello world\nmoe!\n")
    return tmp, model


def bundle(setup, methods):
    tmp, model = setup
    out = tmp / methods.replace(",", "_")
    if not out.exists():
        result = CliRunner().invoke(main, ["compile", str(model), "--trace", str(tmp / "trace.npz"), "--target", "lambda",
                                           "--slo", "60", "--batch-tokens", "512", "--methods", methods,
                                           "--cache-dir", str(tmp / "cache"), "--out", str(out), "--quiet"])
        assert result.exit_code == 0, result.output
    return out


VERIFIED = {}


def verified(setup, methods: str, n: int) -> dict:
    """`run --verify --json`'s report on the bundle of `methods` (`n` new tokens), run once per module."""
    if (methods, n) not in VERIFIED:
        tmp, _ = setup
        result = CliRunner().invoke(main, ["run", str(bundle(setup, methods)), "--verify", "--new-tokens", str(n),
                                           "--prompts", str(tmp / "prompts.txt"), "--json"])
        assert result.exit_code == 0, result.output
        VERIFIED[methods, n] = json.loads(result.output.strip().splitlines()[-1])
    return VERIFIED[methods, n]


@pytest.mark.parametrize("methods, n", [("direct", 2), pytest.param("s3", 3, marks=pytest.mark.slow), ("pipelined_s3", 1)])
def test_each_scatter_gather_method_verifies_against_the_source_model(setup, methods, n):
    out = bundle(setup, methods)
    assert set(json.loads((out / "plan.json").read_text())["communication"]["methods"]) == {methods}
    report = verified(setup, methods, n)
    assert report["verified"] and report["tokens_match"] and report["max_abs_logit_diff"] <= 1e-4
    plan = json.loads((out / "plan.json").read_text())
    slices = len(plan["placement"]["dense_slices"])
    assert report["invocations_by_kind"]["dense"] == n * sum(len(s["segments"]) for s in plan["placement"]["dense_slices"])
    assert report["invocations_by_kind"]["expert"] >= n * 3  # at least one replica per layer and request
    assert report["billed_gb_s"] > 0 and report["max_payload_bytes"] <= report["payload_limit_bytes"]
    sb = report["storage_bytes"]
    assert sb["functions_get"] > 0 and sb["functions_put"] > 0 and slices >= 1
    if methods == "direct":
        assert report["payload_bytes"] > sb["functions_put"] / 10  # expert rows travel in payloads
    else:
        assert report["state_transitions"] > n * slices


def test_the_payload_limit_is_enforced(setup):
    out = bundle(setup, "direct")
    cloud = LocalCloud(out, payload_limit=1000)
    try:
        with pytest.raises(CloudError, match="payload limit"):
            cloud.invoke("Dense00", {"request": "x", "segment": 0, "pad": "y" * 2000})
    finally:
        cloud.close()


def test_a_tampered_lambda_bundle_is_refused_in_one_line(setup, tmp_path):
    import shutil

    out = tmp_path / "b"
    shutil.copytree(bundle(setup, "s3"), out)
    (out / "template.yaml").write_text((out / "template.yaml").read_text() + "\n# edited\n")
    result = CliRunner().invoke(main, ["run", str(out), "--verify"])
    assert result.exit_code == 2 and "template.yaml" in result.output and "sha256" in result.output


def test_a_function_touching_keys_outside_its_iam_policy_fails_the_run(setup, tmp_path):
    import shutil

    from moeplan.runtime.lambda_.state import initial_state

    out = tmp_path / "b"
    shutil.copytree(bundle(setup, "s3"), out)
    text = (out / "template.yaml").read_text()
    assert text.count("${Bucket.Arn}/weights/dense/slice-00/*") == 1
    (out / "template.yaml").write_text(text.replace("${Bucket.Arn}/weights/dense/slice-00/*", "${Bucket.Arn}/weights/dense/slice-99/*"))
    cloud = LocalCloud(out, payload_limit=6 * 2**20)
    try:
        cloud.upload_weights()
        state = initial_state("r", [[104, 105], [33]], {"max_tokens": 2, "temperature": 0.0})
        with pytest.raises(CloudError, match="IAM policy does not allow"):
            cloud.invoke("Dense00", {"state": state, "segment": 0})
    finally:
        cloud.close()


def test_unlisted_files_and_outside_model_sources_are_refused_before_any_code_runs(setup, tmp_path):
    """Issue 17: the Lambda runner checks that the manifest covers every file, like `moeplan run`."""
    import shutil

    from moeplan.backends.common.manifest import write_manifest

    out = tmp_path / "b"
    shutil.copytree(bundle(setup, "s3"), out)
    (out / "functions" / "runtime" / "sitecustomize.py").write_text("raise SystemExit('ran')\n")
    result = CliRunner().invoke(main, ["run", str(out), "--verify"])
    assert result.exit_code == 2 and "sitecustomize.py" in result.output and "not listed" in result.output
    (out / "functions" / "runtime" / "sitecustomize.py").unlink()
    evil = tmp_path / "evil.py"
    evil.write_text("raise SystemExit('ran')\n")
    plan = json.loads((out / "plan.json").read_text())
    plan["model"]["source"] = str(evil)
    (out / "plan.json").write_text(json.dumps(plan, indent=2, sort_keys=True) + "\n")
    write_manifest(out)
    result = CliRunner().invoke(main, ["run", str(out), "--verify"])
    assert result.exit_code == 2 and "not a file listed" in result.output, result.output


def test_an_expert_cannot_read_another_experts_intermediates(setup, tmp_path):
    """Issue 17: IAM scopes intermediates/ per function; the local cloud enforces the template's policy."""
    import shutil

    import torch
    import yaml

    from moeplan.runtime.lambda_ import wire as ops

    out = tmp_path / "b"
    shutil.copytree(bundle(setup, "s3"), out)
    doc = yaml.safe_load((out / "template.yaml").read_text())
    experts = {k: json.loads(v["Properties"]["Environment"]["Variables"]["MOEPLAN_SPEC"])
               for k, v in doc["Resources"].items() if k.startswith("Expert")}
    (first, spec), (_, other) = sorted(experts.items())[:2]
    text = (out / "template.yaml").read_text()
    own = f"layer-{spec['layer']:03d}/{spec['tag']}.in"
    assert text.count(own) == 1
    # the function now runs with the other expert's key in its spec, but keeps its own policy
    doc["Resources"][first]["Properties"]["Environment"]["Variables"]["MOEPLAN_SPEC"] = json.dumps(
        dict(spec, tag=other["tag"], layer=other["layer"]))
    (out / "template.yaml").write_text(yaml.safe_dump(doc))
    cloud = LocalCloud(out, payload_limit=6 * 2**20)
    try:
        cloud.upload_weights()
        hidden = json.loads((out / "model" / "config.json").read_text())["hidden_size"]
        cloud.put(f"intermediates/r/t00000/layer-{other['layer']:03d}/{other['tag']}.in",
                  ops.to_bytes({"rows": torch.zeros(1, hidden), "w": torch.ones(1)}))
        with pytest.raises(CloudError, match="IAM policy does not allow"):
            cloud.invoke(first, {"request": "r", "step": 0})
    finally:
        cloud.close()


def test_decoding_is_correct_when_no_container_keeps_the_kv(setup, tmp_path):
    """Lambda's containers are not guaranteed warm: with no memory for K/V (budget 0), every step of
    every dense part rebuilds its K/V from the deltas in its own earlier state files, and the
    generation still equals the source model's; reading them is what it costs. Run with the text
    report, which names the texts, the executions, the storage read and the verdict."""
    import re
    import shutil

    import yaml

    from moeplan.backends.common.manifest import write_manifest

    tmp, _ = setup
    warm = verified(setup, "s3", 3)
    out = tmp_path / "b"
    shutil.copytree(bundle(setup, "s3"), out)
    doc = yaml.safe_load((out / "template.yaml").read_text())
    for lid, res in doc["Resources"].items():
        if lid.startswith("Dense"):
            env = res["Properties"]["Environment"]["Variables"]
            env["MOEPLAN_SPEC"] = json.dumps(dict(json.loads(env["MOEPLAN_SPEC"]), kv_budget_bytes=0))
    (out / "template.yaml").write_text(yaml.safe_dump(doc))
    write_manifest(out)
    cold = CliRunner().invoke(main, ["run", str(out), "--verify", "--new-tokens", "3", "--prompts", str(tmp / "prompts.txt")])
    assert cold.exit_code == 0, cold.output
    lines = cold.output.rstrip("\n").splitlines()
    assert lines[:len(warm["texts"])] == [f"  [{i}] {t!r}" for i, t in enumerate(warm["texts"])]
    assert "3 token(s) per prompt in 1 execution(s)" in cold.output
    assert lines[-1].startswith("verify PASS") and "tokens identical" in lines[-1]
    assert int(re.search(r"functions get (\d+)", cold.output).group(1)) > warm["storage_bytes"]["functions_get"]
