"""`moeplan compile --target lambda`: SAM template that lints, least-privilege IAM, determinism, injection."""
import json
import pytest
import yaml
from click.testing import CliRunner

from synth_routing import synthesize_routed_tokens
from moeplan.passes.analysis.trace.format import save_trace
from moeplan.planner.cli import main
from runtime_fixtures import small_model_dir

EVIL = 'evil"name\': {x: 1}\n- $(touch /tmp/pwned) `id`; --- #\t\\ & *a !Ref Bucket ${AWS::AccountId}'


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lambda")
    tr = synthesize_routed_tokens(tokens=3000, layers=3, experts=8, top_k=2, seq_len=64, seed=0)
    save_trace(tr, tmp / "trace.npz")
    return tmp


def compile_lambda(tmp, model, out, *extra):
    args = ["compile", str(model), "--trace", str(tmp / "trace.npz"), "--target", "lambda", "--slo", "60",
            "--batch-tokens", "512", "--cache-dir", str(tmp / "cache"), "--out", str(out), "--quiet", *extra]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    return yaml.safe_load((out / "template.yaml").read_text())


def cfn_lint(path) -> list:
    """cfn-lint's findings (errors, warnings and informational) for a template: [] when clean."""
    from pathlib import Path

    from cfnlint.api import lint_file

    return [str(m) for m in lint_file(Path(path))]


def test_template_lints_and_gives_each_function_only_its_own_weights(setup, tmp_path):
    model = small_model_dir(tmp_path)
    out = tmp_path / "b"
    doc = compile_lambda(setup, model, out, "--methods", "direct,s3")
    assert cfn_lint(out / "template.yaml") == []
    plan = json.loads((out / "plan.json").read_text())
    res = doc["Resources"]
    functions = {k: v for k, v in res.items() if v["Type"] == "AWS::Serverless::Function" and k != "Front"}
    # the front may only start synchronous executions of this state machine; no S3, no invoke
    front = res["Front"]["Properties"]
    assert front["Policies"] == [{"Version": "2012-10-17", "Statement": [
        {"Effect": "Allow", "Action": ["states:StartSyncExecution"], "Resource": {"Ref": "Pipeline"}}]}]
    assert front["FunctionUrlConfig"] == {"AuthType": "NONE", "InvokeMode": "BUFFERED"}
    assert res["Pipeline"]["Properties"]["Type"] == "EXPRESS"
    assert "runtime.lambda_.front.handler" in (out / "functions" / "front" / "Dockerfile").read_text()
    assert "torch" not in (out / "functions" / "requirements-front.txt").read_text()
    slices = plan["placement"]["dense_slices"]
    replicas = sum(x["replicas"] for l in plan["placement"]["layers"] for x in l["experts"])
    assert len(functions) == len(slices) + replicas == plan["topology"]["functions"]
    for lid, fn in functions.items():
        props = fn["Properties"]
        prefix = props["Environment"]["Variables"]["MOEPLAN_WEIGHTS"]
        assert (out / prefix / "weights.safetensors").is_file()
        statements = props["Policies"][0]["Statement"]
        def resources(action):
            return [r["Fn::Sub"] for s in statements if s["Action"] == [action]  # noqa: B023 (called within this iteration)
                    for r in (s["Resource"] if isinstance(s["Resource"], list) else [s["Resource"]])]

        reads, writes = resources("s3:GetObject"), resources("s3:PutObject")
        assert reads[0] == "${Bucket.Arn}/" + prefix + "*"
        # intermediates: each function only its own keys, never the whole prefix (issue 17)
        assert all(r.startswith("${Bucket.Arn}/intermediates/*/") and r != "${Bucket.Arn}/intermediates/*"
                   for r in reads[1:] + writes)
        spec = json.loads(props["Environment"]["Variables"]["MOEPLAN_SPEC"])
        if lid.startswith("Expert") and spec["method"] != "direct":
            own = f"${{Bucket.Arn}}/intermediates/*/layer-{spec['layer']:03d}/{spec['tag']}"
            assert reads[1:] == [own + ".in"] and writes == [own + ".out"]
        elif lid.startswith("Expert"):
            assert reads[1:] == [] and writes == []
        else:
            assert {p["write"] for p in spec["segments"]} <= {w.rsplit("/", 1)[1] for w in writes}
        assert all(a.startswith(("s3:GetObject", "s3:PutObject", "lambda:InvokeFunction")) for s in statements for a in s["Action"])
        for s in statements:
            if s["Action"] == ["lambda:InvokeFunction"]:  # only experts of a direct layer this slice routes
                spec = json.loads(props["Environment"]["Variables"]["MOEPLAN_SPEC"])
                direct = {p["scatter"]["layer"] for p in spec["segments"] if p.get("scatter", {}).get("method") == "direct"}
                targets = {r["Fn::GetAtt"][0] for r in s["Resource"]}
                assert direct and all(t.startswith("ExpertL") and int(t[7:10]) in direct for t in targets)
        if lid.startswith("Expert"):
            layer = int(lid[7:10])
            assert props["MemorySize"] == next(x["memory_mb"] for x in plan["placement"]["layers"][layer]["experts"]
                                               if x["expert"] == int(lid[11:15]))
        else:
            assert props["MemorySize"] == slices[int(lid[5:])]["memory_mb"]
    # the state machine visits the segments in order; S3 layers get a Parallel state, direct ones none
    states = res["Pipeline"]["Properties"]["Definition"]["States"]
    methods = plan["communication"]["methods"]
    assert sum(s["Type"] == "Parallel" for s in states.values()) == sum(m != "direct" for m in methods)
    for kind in ("dense", "expert"):
        assert f"runtime.lambda_.handlers.{kind}_handler" in (out / "functions" / kind / "Dockerfile").read_text()
    readme = (out / "README.md").read_text()
    assert "sam build && sam deploy" in readme and "per month" in readme


def test_compiling_twice_gives_identical_bytes(setup, tmp_path):
    model = small_model_dir(tmp_path)
    compile_lambda(setup, model, tmp_path / "a")
    compile_lambda(setup, model, tmp_path / "b")
    read = lambda root: {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}
    assert read(tmp_path / "a") == read(tmp_path / "b")


def test_a_model_name_with_yaml_and_shell_metacharacters_yields_a_safe_valid_template(setup, tmp_path):
    model = small_model_dir(tmp_path, name=EVIL)
    out = tmp_path / "b"
    doc = compile_lambda(setup, model, out)
    assert cfn_lint(out / "template.yaml") == []
    assert doc["Description"].startswith("moeplan Lambda deployment of evil_name") and "${" not in doc["Description"]
    assert json.loads((out / "plan.json").read_text())["model"]["name"] == EVIL
    assert set(doc) == {"AWSTemplateFormatVersion", "Transform", "Description", "Parameters", "Resources", "Outputs"}
    assert all(k in ("Bucket", "Pipeline", "Front") or k.startswith(("Dense", "Expert")) for k in doc["Resources"])
    assert json.loads((out / "functions" / "front.json").read_text())["model_name"] == EVIL  # served by its exact name


@pytest.mark.parametrize("extra, words", [(["--slo", "0"], "--slo"), ([], "needs --slo")])
def test_bad_lambda_input_is_one_line_exit_2(setup, tmp_path, extra, words):
    model = small_model_dir(tmp_path)
    args = ["compile", str(model), "--trace", str(setup / "trace.npz"), "--target", "lambda", "--batch-tokens", "512",
            "--cache-dir", str(setup / "cache"), "--out", str(tmp_path / "o"), *extra]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2 and words in result.output and len(result.output.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()


def test_the_http_api_entry_lints_and_waits_at_most_its_30_s(setup, tmp_path):
    model = small_model_dir(tmp_path)
    out = tmp_path / "b"
    doc = compile_lambda(setup, model, out, "--http-entry", "http-api")
    assert cfn_lint(out / "template.yaml") == []
    front = doc["Resources"]["Front"]["Properties"]
    api = front["Events"]["Api"]["Properties"]
    assert api["TimeoutInMillis"] == 30000 and api["PayloadFormatVersion"] == "2.0" and front["Timeout"] == 30
    assert "FunctionUrlConfig" not in front and "ServerlessHttpApi" in doc["Outputs"]["ApiUrl"]["Value"]["Fn::Sub"]
    settings = json.loads((out / "functions" / "front.json").read_text())
    assert settings["time_limit_s"] == 30 and settings["max_context"] >= 2
    plan = json.loads((out / "plan.json").read_text())
    assert plan["deployment"]["http_entry"] == "http-api" and plan["predicted"]["request_cost"]["http_request_price"] > 0
