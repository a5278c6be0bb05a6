"""Engine pricing (passes/cost/engine): the model's shape from real configs, the step as the engine runs it,
measured and roofline prices with their sources, the busiest rank under a placement, serving and memory."""
import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moeplan.runtime.ep.expert_table import ExpertTable
from moeplan.core.errors import UserError
from moeplan.core.hardware import load_hardware
from moeplan.passes.analysis.trace.format import make_trace
from moeplan.passes.cost.engine import measured, rank_rows, serving
from moeplan.passes.cost.engine import ops as O
from moeplan.passes.cost.engine.deployment import Deployment
from moeplan.passes.cost.engine.memory import kv_bytes, memory_per_gpu, weight_bytes
from moeplan.passes.cost.engine.model_shape import engine_model
from moeplan.passes.cost.engine.pricing import Pricer
from moeplan.passes.cost.engine.step import decode_ops

CONFIGS = Path(__file__).resolve().parents[1] / "examples" / "configs"
H100 = load_hardware("h100-sxm")
HAS_DB = measured.installed_version() == measured.PINNED
needs_db = pytest.mark.skipif(not HAS_DB, reason="aiconfigurator-core 0.12.0 (moeplan[gpu]) is not installed")


def model(name: str):
    return engine_model(json.loads((CONFIGS / name).read_text()), name)


def roofline_pricer(dep):
    return Pricer(dep, load_hardware(dep.hardware), use_measured=False)


def step_seconds(m, dep, batch, context, pricer=None):
    pricer = pricer or roofline_pricer(dep)
    return pricer.step(decode_ops(m, dep, batch, context, list(rank_rows.balanced(m.num_moe_layers, batch).tokens))).seconds


def test_engine_shape_of_every_example_config_matches_the_imported_model():
    from moeplan.passes.importers.resolve import load_model

    names = sorted(p.name for p in CONFIGS.glob("*.json"))
    assert len(names) == 17
    for name in names:
        shape, ir = model(name), load_model(CONFIGS / name).ir
        stage = ir.moe_stages[0]
        assert shape.num_moe_layers == len(ir.moe_stages), name
        assert (shape.num_experts, shape.top_k) == (stage.num_experts, stage.top_k), name
        # expert weights from the config's widths: the IR counts the real parameters (gpt-oss adds biases)
        assert shape.expert_params == pytest.approx(stage.expert_params, rel=1e-3), name
        if stage.shared_expert_params > 0.01 * stage.expert_params:
            assert shape.shared_params == pytest.approx(stage.shared_expert_params, rel=1e-3), name


def test_checkpoint_precision_and_layer_kinds_follow_the_config():
    v3 = model("deepseek-v3-fp8.json")
    assert (v3.attention_quant, v3.moe_quant, v3.dense_quant) == ("fp8_block",) * 3
    assert v3.moe_layers[:4] == (False, False, False, True) and v3.num_dense_layers == 3
    assert v3.mla is not None and v3.mla.cached_elements == 576
    oss = model("gpt-oss-20b.json")
    assert (oss.attention_quant, oss.moe_quant) == ("bfloat16", "mxfp4")  # self_attn is in modules_to_not_convert
    assert set(oss.windows) == {0, 128}
    nxt = model("qwen3-next-80b-a3b.json")
    assert nxt.attention_kinds.count("linear") == 36 and nxt.linear is not None
    assert model("qwen3-30b-a3b.json").moe_quant == "bfloat16"


def test_fp8_checkpoint_is_priced_at_fp8_and_weighs_one_byte_per_weight():
    dep = Deployment("sglang", "h100-sxm", 1, 8, 8, 1, 8)
    bf16, fp8 = model("deepseek-v3.json"), model("deepseek-v3-fp8.json")
    assert weight_bytes(fp8, dep) / weight_bytes(bf16, dep) == pytest.approx(0.5, abs=0.02)
    gemm = O.Gemm("g", 4096, 7168, 7168, "bfloat16")
    pricer = roofline_pricer(dep)
    assert pricer.unit(replace(gemm, quant="fp8_block"))[0] < 0.6 * pricer.unit(gemm)[0]  # compute bound: the FP8 peak
    assert step_seconds(fp8, dep, 16, 1024) < step_seconds(bf16, dep, 16, 1024)


def test_a100_has_no_fp8_peak_so_fp8_computes_at_bf16():
    dep = Deployment("sglang", "a100-sxm", 1, 8, 8, 1, 8)
    pricer = roofline_pricer(dep)
    gemm = O.Gemm("g", 8192, 8192, 8192, "bfloat16")
    assert pricer.unit(replace(gemm, quant="fp8"))[0] == pytest.approx(pricer.unit(gemm)[0], rel=0.01)


def test_a_decode_step_at_long_context_is_slower_than_at_short_context():
    m, dep = model("qwen3-30b-a3b.json"), Deployment("sglang", "h100-sxm", 1, 1, 1, 1, 1)
    assert step_seconds(m, dep, 16, 1024) > step_seconds(m, dep, 16, 1)


@settings(max_examples=15, deadline=None)
@given(st.integers(1, 256), st.integers(0, 60000), st.integers(1, 30000))
def test_decode_step_grows_with_context(batch, context, more):
    m, dep = model("mixtral-8x7b.json"), Deployment("sglang", "h100-sxm", 1, 2, 2, 1, 2)
    assert step_seconds(m, dep, batch, context + more) >= step_seconds(m, dep, batch, context)


@settings(max_examples=15, deadline=None)
@given(st.integers(1, 512), st.integers(1, 8192), st.integers(1, 512), st.integers(1, 4096))
def test_memory_grows_with_requests_and_context(requests, context, more_requests, more_context):
    m, dep = model("deepseek-v3-fp8.json"), Deployment("sglang", "h200-sxm", 1, 8, 1, 8, 8, kv_cache_dtype="fp8")
    device = load_hardware("h200-sxm").device_memory_bytes
    base = memory_per_gpu(m, dep, device, requests, context)["memory_per_gpu_bytes"]
    assert memory_per_gpu(m, dep, device, requests + more_requests, context)["memory_per_gpu_bytes"] >= base
    assert memory_per_gpu(m, dep, device, requests, context + more_context)["memory_per_gpu_bytes"] > base


def test_kv_of_mla_is_the_latent_and_gqa_splits_its_kv_heads_over_tp():
    v3, qwen = model("deepseek-v3-fp8.json"), model("qwen3-30b-a3b.json")
    tp8 = Deployment("sglang", "h100-sxm", 1, 8, 8, 1, 8)
    assert kv_bytes(v3, replace(tp8, kv_cache_dtype="fp8"), 1, 1000) == 61 * 1000 * 576
    # 4 KV heads over 8 ranks: each rank keeps one (replicated), K and V of 128 in bf16 per layer
    assert kv_bytes(qwen, tp8, 2, 100) == 48 * 2 * 100 * 2 * 128 * 2


def test_bad_deployments_and_workloads_are_refused_in_one_line():
    with pytest.raises(UserError, match="attention tp 2 x dp 2 must equal the 8 GPUs"):
        Deployment("sglang", "h100-sxm", 1, 8, 2, 2, 8)
    with pytest.raises(UserError, match="multiple of the EP size"):
        Deployment("sglang", "h100-sxm", 1, 8, 8, 1, 8, redundant_experts=3)
    with pytest.raises(UserError, match="REQUESTSxPROMPT\\+NEW"):
        serving.parse_workload("16x1024")


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 4096), st.integers(1, 100000), st.integers(1, 100000))
def test_workload_text_reads_back(r, p, g):
    w = serving.parse_workload(f"{r}x{p}+{g}")
    assert (w.requests, w.prompt, w.new_tokens) == (r, p, g) and serving.parse_workload(str(w)) == w


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 64), st.integers(1, 5000), st.integers(1, 9000))
def test_prefill_chunks_cover_every_prompt_once(requests, prompt, chunk):
    chunks = serving.prefill_chunks(requests, prompt, chunk)
    assert sum(n * t for pieces, _ in chunks for n, t, _ in pieces) == requests * prompt
    assert sum(f for _, f in chunks) == requests
    assert all(sum(n * t for n, t, _ in pieces) <= chunk for pieces, _ in chunks)


def test_tpot_quadrature_matches_aiconfigurators_stride():
    assert serving.decode_points(1024, 128) == [(1024, 32), (1056, 32), (1088, 32), (1120, 31)]
    assert serving.decode_points(10, 1) == []


# --- the busiest rank under a placement -------------------------------------------------------

def _trace(experts: np.ndarray, num_experts: int):
    return make_trace(experts.astype(np.int32), np.full(experts.shape, 1.0 / experts.shape[2], dtype=np.float32),
                      num_experts=num_experts)


def _one_per_rank(layers: int, experts: int, world: int) -> np.ndarray:
    hosts = np.zeros((layers, experts, world), dtype=bool)
    for e in range(experts):
        hosts[:, e, e % world] = True
    return hosts


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(1, 64), st.sampled_from([2, 4, 8]), st.integers(1, 2))
def test_the_busiest_rank_never_paces_faster_than_balanced(seed, batch, world, top_k):
    rng = np.random.default_rng(seed)
    experts = np.stack([rng.choice(8, size=top_k, replace=False) for _ in range(200 * 2)]).reshape(200, 2, top_k)
    load = rank_rows.rank_load(_trace(experts, 8), ExpertTable(_one_per_rank(2, 8, world), world), batch)
    for layer in load.tokens:
        assert abs(sum(w for _, w in layer) - 1) < 1e-9
        # rows sum to B x K over W ranks, so the busiest holds at least the mean: x >= B (up to rounding)
        assert all(x >= batch * (1 - 0.5 / batch) for x, _ in layer)
    assert load.max_over_mean >= 1.0


def test_a_hot_expert_slows_the_step_and_its_replicas_bring_it_back():
    m = model("mixtral-8x7b.json")  # 8 experts, top-2
    world, batch, layers = 8, 2048, m.num_moe_layers  # enough rows per rank that compute, not the weight read, sets the pace
    rng = np.random.default_rng(0)
    hot = np.stack([np.stack([np.zeros(400, int), rng.integers(1, 8, 400)], axis=1)] * layers, axis=1)  # expert 0 in every token
    trace = _trace(hot, 8)
    plain = ExpertTable(_one_per_rank(layers, 8, world), world)
    replicated = _one_per_rank(layers, 8, world)
    replicated[:, 0, :] = True  # the hot expert on every rank: each token uses its own rank's copy
    dep = Deployment("sglang", "h100-sxm", 1, world, world, 1, world)
    pricer = roofline_pricer(dep)
    price = lambda load: pricer.step(decode_ops(m, dep, batch, 1024, list(load.tokens))).seconds
    balanced = price(rank_rows.balanced(layers, batch))
    skewed = rank_rows.rank_load(trace, plain, batch)
    fixed = rank_rows.rank_load(trace, ExpertTable(replicated, world), batch)
    assert skewed.max_over_mean > 3 and fixed.max_over_mean < 1.5
    assert price(skewed) > 1.2 * balanced
    assert price(fixed) < 0.9 * price(skewed)


def test_a_loads_only_trace_gives_each_rank_its_experts_share():
    from moeplan.passes.analysis.trace.format import loads_trace

    loads = np.array([[700, 100, 100, 100]] * 2)
    trace = loads_trace(loads, top_k=1, num_experts=4)
    load = rank_rows.rank_load(trace, ExpertTable(_one_per_rank(2, 4, 4), 4), 100)
    assert load.tokens[0] == ((280, 1.0),)  # 70 rows of 100 on rank 0: x = 70 x 4 / 1
    assert load.max_over_mean == pytest.approx(2.8)


# --- prices and their sources -----------------------------------------------------------------

def test_without_the_database_every_price_is_the_rooflines():
    m, dep = model("qwen3-30b-a3b.json"), Deployment("sglang", "a100-sxm", 1, 1, 1, 1, 1)
    price = Pricer(dep, load_hardware("a100-sxm")).step(decode_ops(m, dep, 8, 512, list(rank_rows.balanced(48, 8).tokens)))
    assert set(price.sources()) == {"roofline a100-sxm"}
    assert price.seconds == pytest.approx(sum(r["seconds"] for r in price.table()))


@needs_db
def test_measured_prices_name_their_database_and_the_grid_edge():
    dep = Deployment("sglang", "h100-sxm", 1, 1, 1, 1, 1)
    pricer = Pricer(dep, H100)
    inside, source = pricer.unit(O.Gemm("qkv", 64, 5120, 2048, "bfloat16"))
    assert source == "aiconfigurator-core 0.12.0 sglang 0.5.14 h100_sxm (measured)"
    assert inside == pytest.approx(0.0105e-3, rel=0.1)  # the table's row (aic_api.md: m=64 0.0105 ms)
    beyond, source = pricer.unit(O.Gemm("logits", 64, 151936, 2048, "bfloat16"))  # n beyond the 65536 grid
    assert source.endswith("efficiency at its grid edge") and beyond > inside
    unmeasured, source = pricer.unit(O.FusedMoe("moe", 64, 3000, 1000, 8, 100, 1, 1, "bfloat16", "balanced"))
    assert source == "roofline h100-sxm" and unmeasured > 0


@needs_db
def test_measured_decode_step_grows_with_context_and_matches_aiconfigurators_ops():
    m, dep = model("qwen3-30b-a3b.json"), Deployment("sglang", "h100-sxm", 1, 1, 1, 1, 1)
    pricer = Pricer(dep, H100)
    short, long = step_seconds(m, dep, 16, 1, pricer), step_seconds(m, dep, 16, 1024, pricer)
    assert long > short
    # AIConfigurator 0.12.0 prices this step's attention at 0.7808 ms over 48 layers (aic_api.md, ops_qwen3)
    ops = decode_ops(m, dep, 16, 1024, list(rank_rows.balanced(48, 16).tokens))
    parts = {r["op"]: r for r in pricer.step(ops).table()}
    assert parts["attention"]["seconds"] == pytest.approx(0.7808e-3, rel=0.02)
    assert parts["attention"]["source"].endswith("(measured)")
