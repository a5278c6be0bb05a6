"""The target registry (planner/pipeline/targets.py) and its flag table (planner/pipeline/flags.py):
one definition of every target and flag, behind `compile`, `plan` and the Python API."""
import json
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

import moeplan
from moeplan.planner.cli import main
from moeplan.planner.pipeline import flags as F
from moeplan.planner.pipeline.targets import DEFAULT_TARGET, TARGETS

ROOT = Path(__file__).resolve().parents[1]
COMMAND_LEVEL = {"model", "trace_path", "target", "out", "as_json", "quiet", "force", "help", "with_report"}


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def command(name: str) -> click.Command:
    return main.commands[name]


def test_compile_and_plan_take_exactly_the_flag_tables_options():
    for name, compile_only in (("compile", True), ("plan", False)):
        params = {p.name for p in command(name).params} - COMMAND_LEVEL
        assert params == {f.name for f in F.FLAGS if compile_only or not f.compile_only}, name
    for flag in F.FLAGS:
        assert flag.targets and set(flag.targets) <= set(TARGETS), flag.name
        assert flag.group in dict(F.GROUPS), flag.name
    # the click option spells the flag as the table does, with the table's default
    by_name = {p.name: p for p in command("compile").params}
    for flag in F.FLAGS:
        assert flag.option in by_name[flag.name].opts and by_name[flag.name].default == flag.default, flag.name


def test_one_default_target_for_plan_compile_and_the_api():
    assert DEFAULT_TARGET == "torchrun"
    for name in ("plan", "compile"):
        target = next(p for p in command(name).params if p.name == "target")
        assert target.default == DEFAULT_TARGET
    assert set(next(p for p in command("plan").params if p.name == "target").type.choices) == set(TARGETS)


INAPPLICABLE = [(target, flag) for target in TARGETS for flag in F.FLAGS if target not in flag.targets]


def _cli_value(flag):
    if flag.is_flag:
        return []
    sample = {"policy": "eplb", "balance_base": "eplb", "solver": "gurobi", "mode": "standard", "eviction": "lru",
              "prefetch": "none", "weights": "reference", "size_for": "max", "methods": "s3", "gpu_memory": "1GiB",
              "host_memory": "1GiB", "hardware": "cpu-gloo", "workload": "1x1+1", "image": "x", "storage_class": "x",
              "platform": "p.yaml", "bo_storage": "sqlite:///x.db", "cache_dir": "cache", "sign_key": "k.pem",
              "validation_fraction": "0.5", "http_entry": "http-api", "weights_from": "volume",
              "node_selector": "pool=gpu", "tolerations": "gpu:NoSchedule", "image_pull_secrets": "regcred"}
    choices = getattr(flag.type, "choices", None)  # a choice flag added later needs no entry above
    return [sample.get(flag.name, str(choices[0]) if choices else "3")]


@pytest.mark.parametrize("target, flag", INAPPLICABLE, ids=[f"{t}-{f.name}" for t, f in INAPPLICABLE])
def test_a_flag_given_for_a_target_it_does_not_apply_to_is_refused_in_one_line(tmp_path, target, flag):
    command_name = "compile" if flag.compile_only else "plan"
    args = [command_name, "model", "--trace", "t.npz", "--target", target, flag.option, *_cli_value(flag),
            "--out", tmp_path / ("out" if command_name == "compile" else "plan.json")]
    result = run(*args)
    lines = result.output.strip().splitlines()
    if command_name == "compile" and not TARGETS[target].bundles:  # compile offers bundle targets only
        assert result.exit_code == 2 and len(lines) == 1 and "'offload' is not one of" in lines[0]
        return
    assert result.exit_code == 2, result.output
    assert lines == [f"error: {flag.option} does not apply to --target {target}; it applies to --target "
                     f"{', '.join(flag.targets)}: drop it or choose one of those targets"]
    assert not any(tmp_path.iterdir())


def test_the_api_refuses_the_same_flags_in_its_own_keywords(tmp_path):
    """The command's refusals, each naming the API's keyword where the command names its flag (issue 40)."""
    with pytest.raises(moeplan.UserError, match="slo= does not apply to target='torchrun'; it applies to target 'lambda'"):
        moeplan.plan("model", "t.npz", slo=3)
    with pytest.raises(moeplan.UserError, match="^nodes must be a positive integer"):
        moeplan.plan("model", "t.npz", nodes=0)
    with pytest.raises(moeplan.UserError, match="unknown option 'gpus'"):
        moeplan.plan("model", "t.npz", gpus=2)
    with pytest.raises(moeplan.UserError, match="unknown option 'sign_key'"):  # as `plan --sign-key`: compile only
        moeplan.plan("model", "t.npz", sign_key="k.pem")
    with pytest.raises(moeplan.UserError, match="target='offload' plans only"):
        moeplan.compile("model", "t.npz", tmp_path / "b", target="offload", expert_cache=3)


def test_compile_help_lists_options_by_target_with_examples():
    result = run("compile", "--help")
    assert result.exit_code == 0
    text = result.output
    for title, serves in F.GROUPS:
        assert f"{title} ({serves}):" in text
    assert "Examples:" in text and "moeplan compile examples/tiny_moe --trace t.npz" in text
    # --slo sits in the Lambda section, --nodes in the placement one
    assert text.index("Lambda (") < text.index("--slo") and text.index("Topology and placement (") < text.index("--nodes")


def test_top_level_help_lines_are_whole_sentences():
    for args in (["--help"], ["trace", "--help"]):
        result = CliRunner().invoke(main, args, terminal_width=60)
        listing = result.output.split("Commands:")[1]
        assert result.exit_code == 0 and "..." not in listing, listing


def test_plan_takes_a_config_file_alone(tmp_path):
    """The README's promise: a Hugging Face config.json alone plans at full size (here Mixtral-8x7B)."""
    result = run("trace", "synth", "--layers", 32, "--experts", 8, "--k", 2, "--tokens", 300, "--affinity", 0.5,
                 "--zipf", 0.5, "--seed", 0, "--out", tmp_path / "t.npz")
    assert result.exit_code == 0, result.output
    result = run("plan", ROOT / "examples" / "configs" / "mixtral-8x7b.json", "--trace", tmp_path / "t.npz",
                 "--gpus-per-node", 4, "--policy", "eplb", "--mode", "standard", "--out", tmp_path / "plan.json", "--json")
    assert result.exit_code == 0, result.output
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["target"] == "torchrun" and plan["model"]["architecture"] == "transformers"
    assert plan["model"]["num_experts"] == 8 and plan["model"]["moe_layers"] == 32
    assert json.loads(result.output.strip().splitlines()[-1])["world_size"] == 4
    # compiling it is refused in one line: a bundle ships weights
    result = run("compile", ROOT / "examples" / "configs" / "mixtral-8x7b.json", "--trace", tmp_path / "t.npz",
                 "--policy", "eplb", "--mode", "standard", "--out", tmp_path / "b", "--quiet")
    assert result.exit_code == 2 and "has no weights to ship" in result.output.strip().splitlines()[-1]
