"""`moeplan compile --target sglang|trtllm` on full-size DeepSeek-V3 (config only, meta device):
the files follow the engines' documented formats and rules (docs/interop.md cites them)."""
import json
from pathlib import Path

import numpy as np
import pytest
import yaml
from click.testing import CliRunner

from moeplan.passes.analysis.trace.format import load_trace, loads_trace, save_trace
from moeplan.passes.analysis.trace.synth_planted import synthesize_trace
from moeplan.planner.cli import main

ROOT = Path(__file__).resolve().parents[1]
DEEPSEEK = ROOT / "examples" / "configs" / "deepseek-v3.json"
MOE_LAYERS = list(range(3, 61))  # first_k_dense_replace = 3 of 61 decoder layers
E, K = 256, 8


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    root = tmp_path_factory.mktemp("traces")
    routed = synthesize_trace(layers=58, experts=E, top_k=K, tokens=1500, affinity=0.6, zipf=0.9, seed=3)
    save_trace(routed, root / "routed.npz")
    rng = np.random.default_rng(0)
    save_trace(loads_trace(rng.zipf(1.6, size=(58, E)).clip(max=10_000), top_k=K), root / "loads.npz")
    return root


@pytest.fixture(scope="module")
def sglang_out(traces, tmp_path_factory):
    out = tmp_path_factory.mktemp("sg") / "bundle"
    result = run("compile", DEEPSEEK, "--trace", traces / "routed.npz", "--target", "sglang", "--nodes", 4,
                 "--gpus-per-node", 8, "--redundant", 32, "--kubernetes", "--out", out, "--json")
    assert result.exit_code == 0, result.output
    return out, json.loads(result.output.strip().splitlines()[-1])


def test_sglang_map_has_every_decoder_layer_and_matches_the_placement(sglang_out):
    out, summary = sglang_out
    assert summary["policy"] == "eplb" and summary["world_size"] == 32 and summary["objective"] == "balance"
    doc = json.loads((out / "init_expert_location.json").read_text())
    assert list(doc) == ["physical_to_logical_map"]  # SGLang passes every key to init_by_mapping
    p2l = np.array(doc["physical_to_logical_map"])
    assert p2l.shape == (61, E + 32)
    for layer in range(3):  # dense layers keep SGLang's trivial row
        assert p2l[layer].tolist() == [s % E for s in range(E + 32)]
    placement = json.loads((out / "placement.json").read_text())
    slots_per_gpu = (E + 32) // 32
    for l, layer in enumerate(MOE_LAYERS):
        assert sorted(set(p2l[layer])) == list(range(E))  # every logical expert has a slot
        for gpu, experts in enumerate(placement["layers"][l]["devices"]):
            assert sorted(set(p2l[layer, gpu * slots_per_gpu:(gpu + 1) * slots_per_gpu])) == experts
    plan = json.loads((out / "plan.json").read_text())
    assert plan["target"] == "sglang" and plan["model"]["moe_layer_indices"] == MOE_LAYERS
    assert plan["communication"]["mode"] == "standard" and "balance" in plan["communication"]["objective"]
    assert 1.0 <= summary["predicted"]["max_over_mean_load"] == plan["predicted"]["max_over_mean_load"]


def test_sglang_launch_script_passes_the_matching_flags(sglang_out):
    out, _ = sglang_out
    launch = (out / "launch.sh").read_text()
    for flag in ("--ep-size 32", "--tp-size 32", "--ep-num-redundant-experts 32", "--nnodes 4",
                 '--init-expert-location "$HERE/init_expert_location.json"', "--ep-dispatch-algorithm dynamic",
                 "-m sglang.launch_server"):
        assert flag in launch
    assert (out / "launch.sh").stat().st_mode & 0o111
    readme = (out / "README.md").read_text()
    assert "What this plan optimises" in readme and "home rank" in readme


def test_run_says_that_engine_bundles_run_in_their_engine(sglang_out):
    out, _ = sglang_out
    result = run("run", out, "--verify")
    lines = result.output.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1
    assert "is a sglang bundle: engine bundles run in their engine" in lines[0] and "SGLang" in lines[0]


def test_sglang_kubernetes_manifests_validate(sglang_out):
    import kubernetes_validate

    from moeplan.backends.kubernetes.codegen import KUBERNETES_VERSION

    out, _ = sglang_out
    kinds = []
    for path in sorted((out / "kubernetes").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
            kinds.append(doc["kind"])
    assert sorted(kinds) == ["ConfigMap", "Service", "Service", "StatefulSet"]
    config = yaml.safe_load((out / "kubernetes" / "configmap.yaml").read_text())
    assert config["data"]["init_expert_location.json"] == (out / "init_expert_location.json").read_text()
    stateful = yaml.safe_load((out / "kubernetes" / "statefulset.yaml").read_text())
    assert stateful["spec"]["replicas"] == 4
    container = stateful["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "8"
    # the ConfigMap is what the pods run: mounted at /plan, where the container's command starts launch.sh
    volumes = {v["name"]: v for v in stateful["spec"]["template"]["spec"]["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert volumes[mounts["/plan"]]["configMap"]["name"] == config["metadata"]["name"]
    assert container["command"] == ["bash", "/plan/launch.sh"] and set(config["data"]) == {"launch.sh",
                                                                                            "init_expert_location.json"}
    # the README says what the manifests need of the cluster: the version, the claim's access mode, the security stance
    claim = volumes[mounts["/weights"]]["persistentVolumeClaim"]["claimName"]
    readme = (out / "README.md").read_text()
    assert "1.28 or later" in readme and f"PersistentVolumeClaim named `{claim}`" in readme
    assert "`ReadOnlyMany` or `ReadWriteMany`" in readme and "without a restricting\nsecurityContext" in readme
    assert "securityContext" not in json.dumps(stateful)  # as the README says


def test_trtllm_load_balancer_follows_moe_load_balancer_config_rules(traces, tmp_path):
    out = tmp_path / "trt"
    result = run("compile", DEEPSEEK, "--trace", traces / "routed.npz", "--target", "trtllm", "--nodes", 4,
                 "--gpus-per-node", 8, "--redundant", 32, "--out", out)
    assert result.exit_code == 0, result.output
    balancer = yaml.safe_load((out / "moe_load_balancer.yaml").read_text())
    ep_size, num_slots = 32, balancer["num_slots"]
    # TensorRT-LLM's rules (llm_args.py MoeLoadBalancerConfig.setup / get_layer_initial_global_assignments
    # and the MoE modules' asserts): slots divisible by the EP size, an entry per MoE layer's
    # decoder-layer index, each of length num_slots, naming every expert, num_slots >= experts.
    assert num_slots == E + 32 and num_slots % ep_size == 0 and num_slots >= E
    assert balancer["layer_updates_per_iter"] == 0
    assignments = balancer["initial_global_assignments"]
    assert sorted(assignments) == MOE_LAYERS
    for row in assignments.values():
        assert len(row) == num_slots and set(row) == set(range(E))
    options = yaml.safe_load((out / "extra_llm_api_options.yaml").read_text())
    assert options["moe_config"]["load_balancer"] == balancer and options["enable_attention_dp"] is True
    placement = json.loads((out / "placement.json").read_text())
    per_rank = num_slots // ep_size
    for l, layer in enumerate(MOE_LAYERS):
        for rank, experts in enumerate(placement["layers"][l]["devices"]):
            assert sorted(set(assignments[layer][rank * per_rank:(rank + 1) * per_rank])) == experts
    launch = (out / "launch.sh").read_text()
    assert "trtllm-serve" in launch and "--ep_size 32" in launch and "extra_llm_api_options.yaml" in launch


def test_loads_only_trace_plans_with_balance_policies_and_refuses_affinity(traces, tmp_path):
    out = tmp_path / "sg"
    result = run("compile", DEEPSEEK, "--trace", traces / "loads.npz", "--target", "sglang", "--nodes", 2,
                 "--gpus-per-node", 8, "--redundant", 16, "--out", out, "--json")
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output.strip().splitlines()[-1])
    naive = run("compile", DEEPSEEK, "--trace", traces / "loads.npz", "--target", "sglang", "--nodes", 2,
                "--gpus-per-node", 8, "--policy", "contiguous", "--out", tmp_path / "naive", "--json")
    assert naive.exit_code == 0, naive.output
    contiguous = json.loads(naive.output.strip().splitlines()[-1])["predicted"]["max_over_mean_load"]
    assert 1.0 <= summary["predicted"]["max_over_mean_load"] < 0.8 * contiguous  # eplb balances the skewed loads
    plan = json.loads((out / "plan.json").read_text())
    assert plan["inputs"]["trace_loads_only"] is True
    refused = run("compile", DEEPSEEK, "--trace", traces / "loads.npz", "--target", "trtllm", "--nodes", 2,
                  "--gpus-per-node", 8, "--policy", "ilp", "--quiet", "--out", tmp_path / "trt")
    assert refused.exit_code == 2 and refused.output.count("\n") == 1
    assert "needs per-token routing" in refused.output and "--policy eplb" in refused.output
    assert not (tmp_path / "trt").exists()


@pytest.mark.parametrize("target", ["trtllm", "sglang"])
def test_same_inputs_give_identical_files_and_codegen_rewrites_them_from_the_plan(traces, tmp_path, target):
    def files(out):
        return {p.relative_to(out).as_posix(): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}

    outs = []
    for name in ("a", "b"):
        result = run("compile", DEEPSEEK, "--trace", traces / "routed.npz", "--target", target, "--nodes", 1,
                     "--gpus-per-node", 8, "--redundant", 8, "--kubernetes" if target == "sglang" else "--quiet",
                     "--quiet", "--out", tmp_path / name)
        assert result.exit_code == 0, result.output
        outs.append(files(tmp_path / name))
    assert outs[0] == outs[1] and "manifest.json" in outs[0]
    again = run("codegen", tmp_path / "a" / "plan.json", "--out", tmp_path / "c")
    assert again.exit_code == 0, again.output
    assert files(tmp_path / "c") == outs[0]


@pytest.mark.parametrize("args, message", [
    (["--redundant", 3], "do not divide evenly"),
    (["--target", "trtllm", "--kubernetes"], "--kubernetes does not apply to --target trtllm; it applies to --target sglang"),
    (["--slo", "1", "--mode", "standard"], "--mode does not apply to --target sglang; it applies to --target torchrun, kubernetes"),
    (["--image", "x"], "--image applies to --target sglang with --kubernetes"),
])
def test_bad_engine_requests_fail_in_one_line(traces, tmp_path, args, message):
    argv = ["compile", DEEPSEEK, "--trace", traces / "routed.npz", "--nodes", 1, "--gpus-per-node", 8,
            "--quiet", "--out", tmp_path / "x"]
    if "--target" not in args:
        argv += ["--target", "sglang"]
    result = run(*argv, *args)
    assert result.exit_code == 2 and result.output.startswith("error: ") and result.output.count("\n") == 1, result.output
    assert message in result.output
    assert not (tmp_path / "x").exists()


def test_trace_from_another_model_is_refused(tmp_path):
    trace = tmp_path / "t.npz"
    save_trace(synthesize_trace(layers=4, experts=8, top_k=2, tokens=50, affinity=0.5, zipf=0.5, seed=0), trace)
    result = run("compile", DEEPSEEK, "--trace", trace, "--target", "sglang", "--quiet", "--out", tmp_path / "x")
    assert result.exit_code == 2 and "4 MoE layers but the model has 58" in result.output
    assert load_trace(trace).num_layers == 4
