"""Hugging Face MoE models on the Lambda target, end to end through the CLI: trace, plan, compile,
cfn-lint, and `moeplan run --verify` (the bundle's state machine, every function in its own process,
local S3 and Lambda) against transformers' own forward.

Three representative architectures (the full sixteen: `benchmarks/architectures.py --targets lambda`):
qwen3_moe (fused experts module), deepseek_v3 (a dense first block, shared experts, grouped routing
with a score-correction bias), gpt_oss (clamped SwiGLU experts with biases, sliding attention), one
scatter-gather method each.
"""
import json
import shutil

import pytest
import yaml
from click.testing import CliRunner
from safetensors import safe_open

from moeplan.planner.cli import main
from moeplan.passes.importers.resolve import import_file
from runtime_fixtures import EXAMPLE

tiny = import_file(EXAMPLE.parent / "hf_tiny" / "architectures.py")
DATA = "Mixture-of-experts models route every token to a few experts.\nThe quick brown fox jumps over the lazy dog.\n"
CASES = {"qwen3_moe": "direct", "deepseek_v3": "s3", "gpt_oss": "pipelined_s3"}


def cli(*args):
    result = CliRunner().invoke(main, [str(a) for a in args])
    return result.exit_code, result.output


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("lambda_hf")


def traced(work, arch):
    model = work / "models" / arch
    if not model.exists():
        tiny.build(arch, work / "models")
        (work / "data.txt").write_text(DATA)
        code, out = cli("trace", model, "--data", work / "data.txt", "--out", work / f"{arch}.npz", "--quiet")
        assert code == 0, out
    return model, work / f"{arch}.npz"


def compiled(work, arch):
    model, trace = traced(work, arch)
    out = work / f"{arch}-lambda"
    if not out.exists():
        code, text = cli("compile", model, "--trace", trace, "--target", "lambda", "--slo", 30, "--methods", CASES[arch],
                         "--profile-budget", 1, "--cache-dir", work / "cache", "--out", out, "--quiet")
        assert code == 0, text
    return model, trace, out


def tensor_names(path):
    with safe_open(str(path), "pt") as fh:
        return set(fh.keys())


@pytest.mark.parametrize("arch", [a if a == "qwen3_moe" else pytest.param(a, marks=pytest.mark.slow) for a in sorted(CASES)])
def test_hf_lambda_bundle_verifies_against_transformers(work, arch):
    from cfnlint.api import lint_file

    _, _, out = compiled(work, arch)
    plan = json.loads((out / "plan.json").read_text())
    import transformers

    assert plan["model"]["architecture"] == "transformers"
    assert plan["model"]["library"]["transformers"] == transformers.__version__
    assert f"transformers=={transformers.__version__}" in (out / "functions" / "requirements.txt").read_text().splitlines()
    assert [str(m) for m in lint_file(out / "template.yaml")] == []
    assert set(plan["communication"]["methods"]) == {CASES[arch]}
    (work / "prompts.txt").write_text("hello experts\nids: 5 9 11 3 40 2\n")
    code, text = cli("run", out, "--verify", "--new-tokens", 3, "--prompts", work / "prompts.txt", "--json")
    assert code == 0, text
    report = json.loads(text.strip().splitlines()[-1])
    assert report["verified"] and report["tokens_match"] and report["max_abs_logit_diff"] <= 1e-4
    assert report["invocations_by_kind"]["expert"] >= len(plan["placement"]["layers"])
    assert report["max_payload_bytes"] <= report["payload_limit_bytes"]


@pytest.mark.parametrize("arch", ["deepseek_v3"])
def test_each_function_ships_only_its_own_tensors(work, arch):
    """Expert functions hold one expert's slices; dense functions no routed expert, and the
    function that opens a segment holds the MoE block's shared experts but not its attention."""
    _, _, out = compiled(work, arch)
    doc = yaml.safe_load((out / "template.yaml").read_text())
    dense_union = set()
    for lid, res in doc["Resources"].items():
        if res["Type"] != "AWS::Serverless::Function" or lid == "Front":  # the front holds no weights
            continue
        env = res["Properties"]["Environment"]["Variables"]
        spec, names = json.loads(env["MOEPLAN_SPEC"]), tensor_names(out / env["MOEPLAN_WEIGHTS"] / "weights.safetensors")
        if lid.startswith("Expert"):
            block = plan_block(out, spec["layer"])
            assert names and all(n.startswith(f"model.layers.{block}.mlp.experts.{spec['expert']}.") for n in names), names
            continue
        assert not any(".mlp.experts." in n for n in names)
        dense_union |= names
        for part in spec["segments"]:
            if part["start"]["at"] == "post":
                b = part["start"]["layer"]
                assert any(n.startswith(f"model.layers.{b}.mlp.shared_experts.") for n in names)
                covered = {p["start"].get("layer") for p in spec["segments"]} | {p["stop"].get("layer") for p in spec["segments"]}
                if all(p["stop"].get("layer") != b for p in spec["segments"]):  # not also routing block b
                    assert not any(n.startswith(f"model.layers.{b}.self_attn.") for n in names), covered
    assert "model.embed_tokens.weight" in dense_union and "lm_head.weight" in dense_union
    assert any(n.startswith("model.layers.0.mlp.gate_proj") for n in dense_union)  # the dense first block


def plan_block(out, moe):
    plan = json.loads((out / "plan.json").read_text())
    moe_stages = [s for s in plan["model"]["ir"]["stages"] if s["type"] == "moe"]
    return int(moe_stages[moe]["source"].split(".")[2])


def test_a_plan_for_an_hf_model_codegens_to_the_compiled_bundle(work):
    model, trace, out = compiled(work, "qwen3_moe")
    code, text = cli("plan", model, "--trace", trace, "--target", "lambda", "--slo", 30, "--methods", "direct",
                     "--profile-budget", 1, "--cache-dir", work / "cache", "--out", work / "q.json", "--quiet")
    assert code == 0, text
    code, text = cli("codegen", work / "q.json", "--out", work / "from-plan")
    assert code == 0, text
    for rel in ("template.yaml", "statemachine.json", "weights/dense/slice-00/weights.safetensors", "manifest.json"):
        assert (work / "from-plan" / rel).read_bytes() == (out / rel).read_bytes(), rel


def test_a_model_too_big_for_any_function_is_one_line_exit_2(work, tmp_path):
    model, trace = traced(work, "qwen3_moe")
    platform = tmp_path / "small.yaml"
    platform.write_text("memory_options_mb: [128]\nruntime_memory_mb: 200\n")
    code, text = cli("compile", model, "--trace", trace, "--target", "lambda", "--slo", 30, "--platform", platform,
                     "--profile-budget", 1, "--cache-dir", work / "cache", "--out", tmp_path / "b", "--quiet")
    assert code == 2 and text.startswith("error:") and len(text.strip().splitlines()) == 1, text
    assert "MB" in text and not (tmp_path / "b").exists()


def test_a_plan_cutting_inside_a_decoder_block_is_refused_in_one_line(work, tmp_path):
    _, _, out = compiled(work, "qwen3_moe")
    plan = json.loads((out / "plan.json").read_text())
    slices = plan["placement"]["dense_slices"]
    units = [u for s in slices for u in s["units"]]
    cut = units.index("model.layers.0.self_attn") + 1  # between the attention and its block's norm
    seg = plan["placement"]["unit_segments"]
    plan["placement"]["dense_slices"] = [
        dict(slices[0], slice=0, units=units[:cut], segments=sorted({seg[u] for u in units[:cut]})),
        dict(slices[0], slice=1, units=units[cut:], segments=sorted({seg[u] for u in units[cut:]}))]
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    code, text = cli("codegen", tmp_path / "plan.json", "--out", tmp_path / "b")
    assert code == 2 and text.startswith("error:") and len(text.strip().splitlines()) == 1, text
    assert "decoder block 0" in text and not (tmp_path / "b").exists()


def test_a_model_the_runtime_cannot_cut_is_one_line_exit_2(tmp_path):
    """A moeplan model whose blocks have no attention module the runtime knows cannot be cut into functions."""
    from runtime_fixtures import small_model_dir

    src = tmp_path / "renamed"
    directory = small_model_dir(tmp_path)
    shutil.copytree(directory, src)
    text = (src / "model.py").read_text().replace("self.attn(", "self.mixer(").replace("self.attn = ", "self.mixer = ")
    (src / "model.py").write_text(text)
    import safetensors.torch as st

    state = st.load_file(str(src / "model.safetensors"))
    st.save_file({k.replace(".attn.", ".mixer."): v for k, v in state.items()}, str(src / "model.safetensors"))
    from moeplan.passes.analysis.trace.format import save_trace
    from synth_routing import synthesize_routed_tokens

    save_trace(synthesize_routed_tokens(tokens=500, layers=3, experts=8, top_k=2, seq_len=32, seed=0), tmp_path / "t.npz")
    code, text = cli("compile", src, "--trace", tmp_path / "t.npz", "--target", "lambda", "--slo", 30,
                     "--profile-budget", 1, "--cache-dir", tmp_path / "cache", "--out", tmp_path / "b", "--quiet")
    assert code == 2 and text.startswith("error:") and len(text.strip().splitlines()) == 1, text
    assert "attention module" in text and not (tmp_path / "b").exists()


def test_a_bundle_pinned_to_another_transformers_is_refused_in_one_line(work, tmp_path):
    from moeplan.backends.common.manifest import write_manifest

    _, _, out = compiled(work, "qwen3_moe")
    copy = tmp_path / "b"
    shutil.copytree(out, copy)
    plan = json.loads((copy / "plan.json").read_text())
    plan["model"]["library"]["transformers"] = "0.0.1"
    (copy / "plan.json").write_text(json.dumps(plan, indent=2, sort_keys=True) + "\n")
    write_manifest(copy)
    code, text = cli("run", copy, "--verify", "--new-tokens", 1)
    assert code == 2 and text.startswith("error:") and len(text.strip().splitlines()) == 1, text
    assert "transformers 0.0.1" in text
