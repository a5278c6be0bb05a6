"""The serving prediction's API (passes/cost/engine/prediction.py): a deployment, a workload and a routing in,
TPOT, TTFT, throughput and memory per GPU out; the step as a sum of its layers; the busiest rank of long steps."""
import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moeplan.core.errors import UserError
from moeplan.core.hardware import load_hardware
from moeplan.passes.analysis.trace.format import make_trace
from moeplan.passes.cost.engine import rank_rows
from moeplan.passes.cost.engine.deployment import Deployment
from moeplan.passes.cost.engine.model_shape import engine_model
from moeplan.passes.cost.engine.prediction import Routing, predict_serving
from moeplan.passes.cost.engine.pricing import Pricer
from moeplan.passes.cost.engine.step import decode_ops
from moeplan.runtime.ep.expert_table import ExpertTable

CONFIGS = Path(__file__).resolve().parents[1] / "examples" / "configs"
H100 = load_hardware("h100-sxm")


def model(name: str):
    return engine_model(json.loads((CONFIGS / name).read_text()), name)


def skewed_trace(layers: int, experts: int, top_k: int, tokens: int, seed: int = 0):
    """Tokens routed by a Zipf law over the experts: expert 0 is the hottest."""
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, experts + 1)
    ids = np.stack([np.stack([rng.choice(experts, top_k, replace=False, p=p / p.sum()) for _ in range(tokens)])
                    for _ in range(layers)], axis=1)
    return make_trace(ids.astype(np.int32), np.full(ids.shape, 1.0 / top_k, dtype=np.float32), num_experts=experts)


def contiguous_table(layers: int, experts: int, world: int) -> ExpertTable:
    hosts = np.zeros((layers, experts, world), dtype=bool)
    for e in range(experts):
        hosts[:, e, e * world // experts] = True
    return ExpertTable(hosts, world)


def test_a_prediction_from_a_deployment_a_workload_and_balanced_routing():
    m, dep = model("qwen3-30b-a3b.json"), Deployment("sglang", "h100-sxm", 1, 8, 1, 8, 8)
    p = predict_serving(m, dep, "64x1024+128", use_measured=False)
    assert p.routing == "balanced" and p.workload == "64x1024+128" and p.running_requests == 64
    assert p.output_tokens_per_s == pytest.approx(64 / p.tpot_s)
    assert p.output_tokens_per_s_per_gpu == pytest.approx(p.output_tokens_per_s / 8)
    assert 0 < p.ttft_s <= p.prefill_s and p.fits and p.memory_per_gpu_bytes < H100.device_memory_bytes
    doc = p.to_json()
    assert {"tpot_s", "ttft_s", "output_tokens_per_s", "memory_per_gpu_bytes", "fits", "workload", "layout",
            "price_sources", "op_prices"} <= set(doc)
    assert doc["layout"]["attention_dp"] == 8 and [r["source"] for r in doc["price_sources"]] == ["roofline h100-sxm"]
    assert sum(r["seconds"] for r in doc["op_prices"]) == pytest.approx(sum(r["seconds"] for r in doc["price_sources"]))
    json.dumps(doc)  # plain data


def test_max_running_requests_caps_the_decode_batch():
    m = model("mixtral-8x7b.json")
    free = Deployment("sglang", "h100-sxm", 1, 8, 8, 1, 8)
    capped = Deployment("sglang", "h100-sxm", 1, 8, 8, 1, 8, max_running_requests=16)
    a, b = (predict_serving(m, d, "64x512+64", use_measured=False) for d in (free, capped))
    assert (a.running_requests, b.running_requests) == (64, 16)
    assert b.tpot_s < a.tpot_s and b.output_tokens_per_s < a.output_tokens_per_s


def test_a_skewed_trace_under_its_placement_paces_slower_than_balanced_and_replicas_help():
    m = model("mixtral-8x7b.json")
    trace = skewed_trace(m.num_moe_layers, 8, 2, 512)
    dep = Deployment("sglang", "h100-sxm", 1, 8, 8, 1, 8)
    plain = Routing.placed(trace, contiguous_table(m.num_moe_layers, 8, 8))
    hosts = contiguous_table(m.num_moe_layers, 8, 8).hosts.copy()
    hosts[:, 0, :] = True  # the hottest expert on every rank
    replicated = Routing.placed(trace, ExpertTable(hosts, 8))
    workload = "256x256+64"
    flat = predict_serving(m, dep, workload, use_measured=False)
    skewed = predict_serving(m, dep, workload, plain, use_measured=False)
    fixed = predict_serving(m, dep, workload, replicated, use_measured=False)
    assert skewed.routing == "trace" and skewed.max_over_mean_load > 1.5
    assert skewed.tpot_s > flat.tpot_s and fixed.tpot_s < skewed.tpot_s
    assert fixed.max_over_mean_load < skewed.max_over_mean_load


def test_a_placement_over_other_ranks_than_the_deployments_ep_is_refused():
    m = model("mixtral-8x7b.json")
    routing = Routing.placed(skewed_trace(m.num_moe_layers, 8, 2, 64), contiguous_table(m.num_moe_layers, 8, 4))
    with pytest.raises(UserError, match="over 4 ranks and the deployment runs EP 8"):
        predict_serving(m, Deployment("sglang", "h100-sxm", 1, 8, 8, 1, 8), "8x64+8", routing, use_measured=False)


def test_routing_from_a_placement_object_uses_its_expert_table():
    from moeplan.passes.optimize.placement.policies import PlacementRequest, plan_placement
    from moeplan.passes.optimize.placement.schema import Topology

    trace = skewed_trace(2, 8, 2, 256)
    placement = plan_placement(trace, PlacementRequest(Topology(1, 4), policy="eplb", redundant=4))
    routing = Routing.placed(trace, placement)
    assert routing.kind == "trace" and routing.ranks == 4
    assert routing.load(2, 64) == rank_rows.rank_load(trace, placement.expert_table(), 64)


@settings(max_examples=20, deadline=None)
@given(st.integers(1, 4), st.integers(2, 6))
def test_a_step_longer_than_the_trace_sees_the_whole_trace_scaled(times, seed):
    trace = skewed_trace(3, 8, 2, 200, seed)
    table = contiguous_table(3, 8, 4)
    whole = rank_rows.whole_trace_rows(trace, table)
    assert whole.sum() == 200 * 2 * 3  # every routed slot lands on one rank
    load = rank_rows.rank_load(trace, table, 200 * times)
    for layer, ((x, weight),) in enumerate(load.tokens):
        assert weight == 1.0 and x == round(whole[layer].max() * times * 4 / 2)
    assert load == rank_rows.rank_load(trace, table, 200 * times, whole=whole)


@pytest.mark.parametrize("name, dep", [
    ("mixtral-8x7b.json", Deployment("sglang", "h100-sxm", 1, 8, 8, 1, 8)),  # all-gather / all-reduce within a node
    ("deepseek-v3-fp8.json", Deployment("sglang", "h200-sxm", 2, 8, 1, 16, 16)),  # DeepEP across nodes, dense layers
])
def test_the_step_is_the_sum_of_its_layers(name, dep):
    """Half the MoE layers at one busiest-rank load and half at another price as the mean of the two uniform
    steps: every layer's ops are counted once, whatever the grouping of alike layers."""
    m = model(name)
    pricer = Pricer(dep, load_hardware(dep.hardware), use_measured=False)
    half = m.num_moe_layers // 2
    price = lambda loads: pricer.step(decode_ops(m, dep, 64, 512, loads)).seconds
    low, high = [((64, 1.0),)] * m.num_moe_layers, [((200, 1.0),)] * m.num_moe_layers
    mixed = low[:half] + high[half:]
    assert price(mixed) == pytest.approx((price(low) + price(high)) / 2)
    assert price(high) > price(low)


# --- the engine targets' plans -----------------------------------------------------------------

MIXTRAL = CONFIGS / "mixtral-8x7b.json"


def cli(*args):
    from click.testing import CliRunner

    from moeplan.planner.cli import main

    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.fixture(scope="module")
def mixtral_trace(tmp_path_factory):
    from moeplan.passes.analysis.trace.format import save_trace

    path = tmp_path_factory.mktemp("serving") / "mix.npz"
    save_trace(skewed_trace(32, 8, 2, 400, seed=1), path)
    return path


def test_an_engine_plan_carries_the_serving_prediction_and_prints_it(mixtral_trace, tmp_path):
    out = tmp_path / "plan.json"
    result = cli("plan", MIXTRAL, "--trace", mixtral_trace, "--target", "sglang", "--nodes", 1, "--gpus-per-node", 8,
                 "--redundant", 8, "--hardware", "a100-sxm", "--workload", "32x512+64", "--out", out)
    assert result.exit_code == 0, result.output
    assert "serving 32x512+64 on 8x a100-sxm (attention tp8, ep8): TPOT " in result.output
    assert "100% roofline a100-sxm" in result.output
    serving = json.loads(out.read_text())["predicted"]["serving"]
    assert serving["workload"] == "32x512+64" and serving["hardware"] == "a100-sxm" and serving["routing"] == "trace"
    assert serving["layout"]["moe_ep"] == 8 and serving["layout"]["redundant_experts"] == 8
    assert serving["tpot_s"] > 0 and serving["ttft_s"] > 0 and serving["fits"] is True
    assert serving["output_tokens_per_s"] == pytest.approx(32 / serving["tpot_s"], rel=1e-6)
    as_json = cli("plan", MIXTRAL, "--trace", mixtral_trace, "--target", "trtllm", "--nodes", 1, "--gpus-per-node", 8,
                  "--hardware", "a100-sxm", "--json", "--out", tmp_path / "t.json")
    assert as_json.exit_code == 0, as_json.output
    summary = json.loads(as_json.output.strip().splitlines()[-1])
    assert summary["predicted"]["serving"]["workload"] == "64x1024+128"  # --hardware alone: the default engine workload
    assert summary["predicted"]["serving"]["layout"]["engine"] == "trtllm"


def test_without_hardware_or_workload_an_engine_plan_predicts_balance_only(mixtral_trace, tmp_path):
    result = cli("plan", MIXTRAL, "--trace", mixtral_trace, "--target", "sglang", "--nodes", 1, "--gpus-per-node", 8,
                 "--redundant", 8, "--quiet", "--out", tmp_path / "p.json")
    assert result.exit_code == 0, result.output
    assert set(json.loads((tmp_path / "p.json").read_text())["predicted"]) == {"max_over_mean_load"}


@pytest.mark.parametrize("args, message", [
    (["--workload", "8x64+8"], "--workload on --target sglang prices the engine on a GPU: give --hardware too"),
    (["--hardware", "a100-sxm", "--workload", "8x64"], "--workload must look like REQUESTSxPROMPT+NEW"),
    (["--hardware", "no-such-gpu"], "unknown hardware 'no-such-gpu'"),
])
def test_bad_serving_options_fail_in_one_line_before_any_pass(mixtral_trace, tmp_path, args, message):
    result = cli("plan", MIXTRAL, "--trace", mixtral_trace, "--target", "sglang", "--nodes", 1, "--gpus-per-node", 8,
                 "--out", tmp_path / "p.json", *args)
    assert result.exit_code == 2 and result.output.startswith("error: ") and result.output.count("\n") == 1, result.output
    assert message in result.output and not (tmp_path / "p.json").exists()


def test_an_imbalanced_placement_without_replicas_warns_and_names_redundant(mixtral_trace, tmp_path):
    out = tmp_path / "p.json"
    result = cli("plan", MIXTRAL, "--trace", mixtral_trace, "--target", "sglang", "--nodes", 1, "--gpus-per-node", 4,
                 "--policy", "contiguous", "--out", out)
    assert result.exit_code == 0, result.output
    plan = json.loads(out.read_text())["predicted"]
    assert plan["max_over_mean_load"] > 1.5
    assert plan["warnings"] == [line for line in result.output.splitlines() if line.startswith("warning:")]
    assert "--redundant 4" in plan["warnings"][0]
    balanced = cli("plan", MIXTRAL, "--trace", mixtral_trace, "--target", "sglang", "--nodes", 1, "--gpus-per-node", 4,
                   "--redundant", 4, "--out", tmp_path / "q.json")
    assert balanced.exit_code == 0 and "warning:" not in balanced.output
    assert "warnings" not in json.loads((tmp_path / "q.json").read_text())["predicted"]


def test_diff_compares_serving_predictions_and_gates_on_tpot(mixtral_trace, tmp_path):
    for name, workload in (("a", "16x512+64"), ("b", "64x512+64")):
        result = cli("plan", MIXTRAL, "--trace", mixtral_trace, "--target", "sglang", "--nodes", 1, "--gpus-per-node", 8,
                     "--redundant", 8, "--hardware", "a100-sxm", "--workload", workload, "--quiet", "--out", tmp_path / f"{name}.json")
        assert result.exit_code == 0, result.output
    diff = cli("diff", tmp_path / "a.json", tmp_path / "b.json", "--json", "--fail-on", "tpot>+1%")
    assert diff.exit_code == 1, diff.output  # 4x the requests: a slower decode step
    doc = json.loads(diff.output)
    moved = {f["name"]: f for f in doc["headline"]}  # the aliases, each once (the paths they read are not listed again)
    assert moved["tpot"]["changed"] and moved["tpot"]["ratio"] > 1 and moved["throughput"]["ratio"] > 1
    assert {"name": "workload", "a": "16x512+64", "b": "64x512+64"} in doc["decisions"]
    text = cli("diff", tmp_path / "a.json", tmp_path / "b.json").output.splitlines()
    # compact (issue 40): what each side's figures are for first, then each serving figure once, under its alias
    assert "workload 16x512+64 on a100-sxm" in text[0] and "workload 64x512+64 on a100-sxm" in text[0], text[0]
    figure_rows = [line.split()[0] for line in text[text.index(next(x for x in text if x.startswith("figure "))) + 1:]]
    assert {"tpot", "ttft", "throughput", "memory_per_gpu"} <= set(figure_rows) and len(figure_rows) == len(set(figure_rows))
    assert not any("predicted.serving" in line for line in text), text


def test_the_report_names_the_serving_workload_and_says_does_not_fit_in_red(mixtral_trace, tmp_path):
    """Issue 40: a figure names the workload it is for; a deployment whose GPUs cannot hold it says so in red."""
    import html

    out = tmp_path / "plan.json"  # Mixtral-8x7B's 93 GB of bf16 weights on one 80 GB A100
    assert cli("plan", MIXTRAL, "--trace", mixtral_trace, "--target", "sglang", "--nodes", 1, "--gpus-per-node", 1,
               "--hardware", "a100-sxm", "--workload", "8x512+64", "--quiet", "--out", out).exit_code == 0
    assert json.loads(out.read_text())["predicted"]["serving"]["fits"] is False
    result = cli("report", out, "--out", tmp_path / "r.html")
    assert result.exit_code == 0, result.output
    page = html.unescape((tmp_path / "r.html").read_text())
    assert "Serving prediction for workload 8x512+64 on a100-sxm, routing from the planning trace" in page
    assert '<p class="note bad">Does not fit: ' in page and "workload 8x512+64" in page.split('<p class="note bad">')[1]
    assert "memory per GPU (does not fit in the GPU's memory)" in page


LAYOUT_KEYS = ("attention_tp", "attention_dp", "moe_ep", "moe_tp", "redundant_experts", "max_running_requests",
               "moe_a2a")


@pytest.mark.parametrize("target, args", [
    ("sglang", ["--attention", "dp"]),
    ("sglang", ["--attention", "tp", "--max-running-requests", 24]),
    ("vllm", ["--attention", "dp"]),
    ("trtllm", []),
])
def test_the_deployment_priced_is_the_plan_s_deployment_record(mixtral_trace, tmp_path, target, args):
    """The serving pass prices plan.json's `deployment` (what the bundle launches), not a layout of its own."""
    out = tmp_path / "p.json"
    result = cli("plan", MIXTRAL, "--trace", mixtral_trace, "--target", target, "--nodes", 2, "--gpus-per-node", 4,
                 "--redundant", 8, "--hardware", "a100-sxm", "--workload", "32x512+64", *args, "--quiet", "--out", out)
    assert result.exit_code == 0, result.output
    plan = json.loads(out.read_text())
    layout, deployment = plan["predicted"]["serving"]["layout"], plan["deployment"]
    assert {k: layout[k] for k in LAYOUT_KEYS} == {k: deployment[k] for k in LAYOUT_KEYS}
    assert deployment["hardware"] == layout["hardware"] == "a100-sxm" and layout["engine"] == target
    assert deployment["attention_dp"] == (1 if "tp" in args else 8)
    assert deployment["max_running_requests"] == (24 if 24 in args else 32)  # --workload's requests by default
    assert plan["predicted"]["serving"]["running_requests"] == deployment["max_running_requests"]


def test_attention_layout_changes_the_priced_step(mixtral_trace, tmp_path):
    tpot = {}
    for attention in ("tp", "dp"):
        out = tmp_path / f"{attention}.json"
        result = cli("plan", MIXTRAL, "--trace", mixtral_trace, "--target", "sglang", "--nodes", 1, "--gpus-per-node", 8,
                     "--redundant", 8, "--hardware", "a100-sxm", "--workload", "64x512+64", "--attention", attention,
                     "--quiet", "--out", out)
        assert result.exit_code == 0, result.output
        tpot[attention] = json.loads(out.read_text())["predicted"]["serving"]["tpot_s"]
    assert tpot["tp"] != tpot["dp"]


def test_vllm_without_its_eplb_is_told_to_turn_it_on_for_replicas(mixtral_trace, tmp_path):
    out = tmp_path / "p.json"
    result = cli("plan", MIXTRAL, "--trace", mixtral_trace, "--target", "vllm", "--nodes", 1, "--gpus-per-node", 4,
                 "--policy", "contiguous", "--out", out)
    assert result.exit_code == 0, result.output
    warning = json.loads(out.read_text())["predicted"]["warnings"][0]
    assert "--redundant 4" in warning and warning.endswith("(vllm: with --policy eplb)")


def test_a_deployment_prices_the_all_to_all_its_record_chose():
    """`Deployment.a2a` (the record's moe_a2a) overrides the node rule, and the step priced follows it."""
    m = model("qwen3-30b-a3b.json")
    ruled, chosen = Deployment("sglang", "h100-sxm", 1, 8, 1, 8, 8), Deployment("sglang", "h100-sxm", 1, 8, 1, 8, 8, a2a="deepep")
    assert ruled.moe_a2a == "allgather" and chosen.moe_a2a == chosen.layout()["moe_a2a"] == "deepep"
    a = predict_serving(m, ruled, "64x1024+128", use_measured=False)
    b = predict_serving(m, chosen, "64x1024+128", use_measured=False)
    assert a.tpot_s != b.tpot_s
    with pytest.raises(UserError, match="moe_a2a 'nvlink' is not one of allgather, deepep"):
        Deployment("sglang", "h100-sxm", 1, 8, 1, 8, 8, a2a="nvlink")


@pytest.mark.parametrize("target", ["sglang", "vllm", "trtllm"])
def test_the_bundle_readme_states_the_serving_prediction_of_its_deployment(mixtral_trace, tmp_path, target):
    out = tmp_path / "bundle"
    result = cli("compile", MIXTRAL, "--trace", mixtral_trace, "--target", target, "--nodes", 1, "--gpus-per-node", 4,
                 "--redundant", 4, "--hardware", "a100-sxm", "--workload", "16x256+32", "--out", out)
    assert result.exit_code == 0, result.output
    line = next(x for x in result.output.splitlines() if x.startswith("serving 16x256+32 on 4x a100-sxm"))
    readme = (out / "README.md").read_text()
    assert "## Predicted serving" in readme and line in readme.replace("\n", " ")
    plain = cli("compile", MIXTRAL, "--trace", mixtral_trace, "--target", target, "--nodes", 1, "--gpus-per-node", 4,
                "--redundant", 4, "--out", tmp_path / "plain")
    assert plain.exit_code == 0, plain.output
    assert "Predicted serving" not in (tmp_path / "plain" / "README.md").read_text()
