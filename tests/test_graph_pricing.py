"""The torchrun cost model's pricing of decode steps captured as CUDA graphs (passes/cost/runtime_ops.py): which
deployments capture them, what an op costs captured and eager, and the prices against the steps measured on an
H200 (benchmarks/gpu/results/, docs/gpu_checks.md), the 48-block cells held out of the fit."""
import dataclasses
import json
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from moeplan.core.hardware import load_hardware
from moeplan.passes.cost.context import gathered_wire_bytes, priced_shape
from moeplan.passes.cost.cost_model import STANDARD, Workload, predict, routing_from_trace
from moeplan.passes.cost.runtime_ops import decode_graphs_possible, runtime_profile, step_profile
from moeplan.passes.importers import load_model

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "examples" / "configs"


def _loaded(name: str):
    return load_model(str(CONFIGS / name))


@pytest.mark.parametrize("config, profile, captured", [
    ("qwen3-30b-a3b.json", "h100-sxm", True),
    ("qwen3-30b-a3b.json", "h200-sxm", True),
    ("qwen3-30b-a3b.json", "cpu-gloo", False),        # a CPU rank compiles its steps; no graph figures
    ("qwen3-30b-a3b.json", "a100-sxm", False),        # no graph figures measured there
    ("deepseek-v3.json", "h100-sxm", True),           # MLA: its latents in spare-column layers (growable_cache.py)
    ("deepseek-v2-lite.json", "h200-sxm", True),
    ("deepseek-v3-fp8.json", "h100-sxm", False),      # FP8 experts
    ("gpt-oss-20b.json", "h100-sxm", False),          # sliding-window layers
])
def test_which_models_capture_their_decode_steps_where(config, profile, captured):
    loaded = _loaded(config)
    assert decode_graphs_possible(loaded.module, loaded.ir, load_hardware(profile)) is captured


@given(st.integers(1, 512))
def test_an_eager_op_costs_its_dispatch_or_its_kernel_whichever_is_longer(rows):
    h100 = runtime_profile(load_hardware("h100-sxm"))
    eager, graph = step_profile(h100, rows, False), step_profile(h100, rows, True)
    device = h100.graph_op_overhead_s + h100.graph_op_row_s * rows
    assert eager.op_overhead_s == pytest.approx(max(h100.runtime_op_overhead_s, device))
    assert device <= graph.op_overhead_s <= h100.graph_op_overhead_s + h100.graph_op_row_s * 1.5 * rows  # a bucket
    cpu = runtime_profile(load_hardware("cpu-gloo"))
    assert step_profile(cpu, rows, True) is cpu  # no graph figures: unchanged


def _predicted(loaded, profile, sequences: int, gpus: int, graphs: bool, new_tokens: int = 3, service: bool = True,
               prompt: int = 256):
    shape = priced_shape(loaded.ir, loaded.module, profile, graphs=graphs)
    experts, layers, k = int(loaded.ir.moe_stages[0].num_experts), len(shape.moe_blocks), shape.top_k
    workload = Workload((prompt,) * sequences, new_tokens)
    tokens = sum(len(s) for s in workload.steps())
    routes = (np.random.default_rng(0).integers(0, experts, (tokens, layers, 1)) + np.arange(k) * (experts // k)) % experts
    hosts = np.zeros((layers, experts, gpus), dtype=bool)
    hosts[:, np.arange(experts), np.arange(experts) * gpus // experts] = True
    pred = predict(hosts, gpus, shape, STANDARD, workload, routing_from_trace(routes, workload), profile, service)
    return pred, shape, workload


def _decode_step(loaded, profile, sequences: int, gpus: int, graphs: bool, service: bool = True) -> float:
    pred, _, workload = _predicted(loaded, profile, sequences, gpus, graphs, service=service)
    return pred.summary(workload.prompt_tokens)["seconds_per_decode_step"]


def test_a_services_gpu_ranks_are_priced_captured_alone_and_several_and_a_static_run_eager():
    loaded, h100 = _loaded("qwen3-30b-a3b.json"), load_hardware("h100-sxm")
    for gpus in (1, 2):
        steps = {g: _decode_step(loaded, h100, 4, gpus, g) for g in (False, True)}
        assert steps[True] < steps[False] / 3, gpus  # batch 4: the eager step is the host's dispatch
        assert _decode_step(loaded, h100, 4, gpus, True, service=False) == steps[False]  # `moeplan run`: eager
    cpu = load_hardware("cpu-gloo")
    assert _decode_step(loaded, cpu, 4, 1, True) == _decode_step(loaded, cpu, 4, 1, False)


def test_captured_steps_of_several_ranks_exchange_the_gathered_rows():
    """Two H100s, 4 sequences (2 a rank): each decode step's MoE block sends the other rank its bucket of 2 rows,
    hidden state + gate weights + ids out, the hidden state back, at bfloat16 (the checkpoint's, which the GPU
    holds; gathered_moe.py `wire_dtype`), with no row counts; the prefill of
    128-token prompts (2 x 128 = 256 left-padded rows on each rank, 512 received) gathers too, eager (worker.py's
    `_prefill_rows`); of 129-token prompts (516 rows received, above GATHERED_PREFILL_ROWS) it exchanges by dynamic
    gating."""
    loaded, h100 = _loaded("qwen3-30b-a3b.json"), load_hardware("h100-sxm")
    whole, shape, _ = _predicted(loaded, h100, 4, 2, True, new_tokens=3, prompt=128)
    prefill, _, _ = _predicted(loaded, h100, 4, 2, True, new_tokens=1, prompt=128)
    decode_steps, moe = 2, shape.moe_blocks
    assert shape.wire_bytes == 2 and gathered_wire_bytes(loaded.ir, load_hardware("cpu-gloo")) == 4  # fp32 CPU
    for phase, row_bytes in (("dispatch", 2 * (shape.hidden + 2 * shape.top_k)), ("combine", 2 * shape.hidden)):
        got = sum(whole.layers[b][phase]["bytes"] - prefill.layers[b][phase]["bytes"] for b in moe)
        assert got == decode_steps * len(moe) * 2 * 2 * row_bytes, phase  # 2 ranks send 2 rows each
        assert sum(whole.layers[b][phase]["control_bytes"] - prefill.layers[b][phase]["control_bytes"] for b in moe) == 0
        assert sum(prefill.layers[b][phase]["bytes"] for b in moe) == len(moe) * 2 * 256 * row_bytes, phase
        assert sum(prefill.layers[b][phase]["control_bytes"] for b in moe) == 0
    longer, _, _ = _predicted(loaded, h100, 4, 2, True, new_tokens=1, prompt=129)
    assert sum(longer.layers[b]["dispatch"]["control_bytes"] for b in moe) > 0  # dynamic gating sends its counts
    static, _, _ = _predicted(loaded, h100, 4, 2, True, new_tokens=3, service=False, prompt=128)
    assert sum(static.layers[b]["dispatch"]["control_bytes"] for b in moe) > sum(
        prefill.layers[b]["dispatch"]["control_bytes"] for b in moe)  # dynamic gating sends its counts every step


def test_the_prices_meet_the_steps_measured_on_an_h200():
    """The graph figures were fitted to the 16-block cells; the 48-block ones were held out."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    sys.path.insert(0, str(ROOT / "benchmarks" / "gpu"))
    from decode_step import QWEN3, cut_config, predicted_cell

    report = json.loads((ROOT / "benchmarks" / "gpu" / "results" / "h200_2026-11-28_decode_step_48_layers.json").read_text())
    config = cut_config(QWEN3, report["layers"], tiny=False)
    for cell in report["cells"]:
        priced = predicted_cell(config, report["profile"], cell["batch"], report["context"], seed=0)
        assert 0.8 < cell["graph_step_s"] / priced["predicted_graph_step_s"] < 1.25
        assert 0.8 < cell["step_s"] / priced["predicted_step_s"] < 1.25


def test_profiles_without_the_graph_figures_price_as_before():
    loaded = _loaded("qwen3-30b-a3b.json")
    h100 = load_hardware("h100-sxm")
    bare = dataclasses.replace(h100, graph_op_overhead_s=None, graph_op_row_s=None)
    assert not decode_graphs_possible(loaded.module, loaded.ir, bare)
    per_op = runtime_profile(bare).op_overhead_s
    assert step_profile(runtime_profile(bare), 64, False).op_overhead_s == per_op == h100.runtime_op_overhead_s


def test_a_captured_service_prices_its_attention_over_the_caches_it_builds(monkeypatch):
    """A service whose steps are captured builds every cache layer with spare columns (MLA's latents too, 2 ops a
    block more than the library's layers its eager steps keep): its attention takes the table's captured count,
    an eager static run the eager one."""
    from moeplan.passes.cost import runtime_ops as ops_module

    h100 = load_hardware("h100-sxm")
    table = ops_module._table()
    for name in ("DeepseekV3ForCausalLM", "Qwen3MoeForCausalLM"):
        ops = ops_module.runtime_ops(h100, name)
        assert ops.captured().attention == table[name]["attention_block_captured"]
        assert ops.attention == table[name]["attention_block"]
    assert table["DeepseekV3ForCausalLM"]["attention_block_captured"] > table["DeepseekV3ForCausalLM"]["attention_block"]
    loaded = _loaded("qwen3-30b-a3b.json")
    before = {service: _decode_step(loaded, h100, 4, 2, True, service) for service in (True, False)}
    row = dict(table["Qwen3MoeForCausalLM"], attention_block_captured=table["Qwen3MoeForCausalLM"]["attention_block"] + 10)
    monkeypatch.setattr(ops_module, "_table", lambda dtype="bfloat16": {**table, "Qwen3MoeForCausalLM": row})
    after = {service: _decode_step(loaded, h100, 4, 2, True, service) for service in (True, False)}
    assert after[True] > before[True] and after[False] == before[False]
