"""`import moeplan`: `moeplan.plan`, `moeplan.compile`, `moeplan.codegen` over the CLI's target registry,
writing the same bytes as the commands."""

import pytest
from click.testing import CliRunner

import moeplan
from moeplan.passes.analysis.trace.format import save_trace
from moeplan.planner.cli import main
from moeplan.core.plan import Plan
from runtime_fixtures import SMALL, random_trace, small_model_dir


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("api")
    model = small_model_dir(root)
    save_trace(random_trace(300, SMALL["num_layers"], SMALL["num_experts"]), root / "t.npz")
    return model, root / "t.npz"


def files(root):
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def cli(*args):
    result = CliRunner().invoke(main, [str(a) for a in args])
    assert result.exit_code == 0, result.output
    return result.output


OPTIONS = {"gpus_per_node": 2, "policy": "eplb", "redundant": 2, "mode": "standard", "expert_cache": 10}
FLAGS = ["--gpus-per-node", 2, "--policy", "eplb", "--redundant", 2, "--mode", "standard", "--expert-cache", 10]


def test_compile_writes_the_bundle_the_command_writes(inputs, tmp_path):
    model, trace = inputs
    outcome = moeplan.compile(model, trace, tmp_path / "api", **OPTIONS)
    cli("compile", model, "--trace", trace, *FLAGS, "--out", tmp_path / "cli", "--quiet")
    assert files(tmp_path / "api") == files(tmp_path / "cli")
    assert isinstance(outcome.plan, Plan) and outcome.plan.target == "torchrun" and outcome.plan.world_size == 2
    assert outcome.summary["files"] == len(outcome.facts["manifest"]["files"]) == len(files(tmp_path / "api")) - 1
    assert [t["pass"] for t in outcome.timings][-1] == "codegen"
    assert "2 ranks" in outcome.describe()


def test_plan_returns_the_plan_and_writes_the_commands_bytes(inputs, tmp_path):
    model, trace = inputs
    in_memory = moeplan.plan(model, trace, **OPTIONS)
    written = moeplan.plan(model, trace, out=tmp_path / "api.json", **OPTIONS)
    cli("plan", model, "--trace", trace, *FLAGS, "--out", tmp_path / "cli.json", "--quiet")
    assert (tmp_path / "api.json").read_bytes() == (tmp_path / "cli.json").read_bytes() == in_memory.plan.to_json().encode()
    assert written.summary["expert_cache"]["capacity"] == [10, 10]
    moeplan.codegen(tmp_path / "api.json", tmp_path / "bundle")
    cli("codegen", tmp_path / "cli.json", "--out", tmp_path / "from-cli", "--quiet")
    assert files(tmp_path / "bundle") == files(tmp_path / "from-cli")


def test_other_targets_and_the_option_list(inputs, tmp_path):
    model, trace = inputs
    offload = moeplan.plan(model, trace, target="offload", expert_cache=20)
    assert offload.plan.target == "offload" and offload.summary["expert_cache"] == 20
    assert set(moeplan.targets()) == {"torchrun", "kubernetes", "lambda", "sglang", "vllm", "trtllm", "offload"}
    assert moeplan.options("lambda")["batch_tokens"] == 10240 and "slo" not in moeplan.options("torchrun")


def test_inputs_are_never_replaced_and_out_is_checked_first(inputs, tmp_path):
    model, trace = inputs
    before = trace.read_bytes()
    with pytest.raises(moeplan.UserError, match="is the input"):
        moeplan.compile(model, trace, trace, gpus_per_node=2)
    assert trace.read_bytes() == before
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(moeplan.UserError, match="is a file that is not a moeplan plan"):
        moeplan.plan(model, trace, out=tmp_path / "notes.txt", gpus_per_node=2)
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_describe_without_out_and_errors_in_keywords(inputs):
    """Issue 40: describe() of a plan kept in memory said 'wrote None'; errors named CLI flags."""
    model, trace = inputs
    outcome = moeplan.plan(model, trace, gpus_per_node=2, policy="eplb")
    assert outcome.summary["out"] is None
    assert outcome.describe().startswith("torchrun plan (not written): 2 ranks") and "None" not in outcome.describe()
    cases = [(dict(target="lambda", gpus_per_node=2), "gpus_per_node= does not apply to target='lambda'"),
             (dict(gpus_per_node=0), "gpus_per_node must be a positive integer"),
             (dict(gpus_per_node=2, slo=3), "slo= does not apply to target='torchrun'; it applies to target 'lambda'"),
             (dict(gpus_per_node=3, policy="auto"), "give policy='eplb' (or ilp) with redundant=")]
    for options, needle in cases:
        with pytest.raises(moeplan.UserError) as info:
            moeplan.plan(model, trace, **options)
        assert needle in str(info.value), str(info.value)
        assert "--" not in str(info.value), str(info.value)
    assert moeplan.keyword_text("record one with 'moeplan trace M --data T --out t.npz'; or pass --held-out-balance") \
        == "record one with 'moeplan trace M --data T --out t.npz'; or pass held_out_balance=True"
