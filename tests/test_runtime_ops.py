"""The torchrun cost model's launch counts (issue 39 item 2): counted off the runtime's real decode step per model
class (passes/cost/runtime_op_counts.json, benchmarks/runtime_op_counts.py), priced at the measured op cost on the
GPU profiles, the fitted counts elsewhere; an expert touched adds no launch where counted."""
from __future__ import annotations

import dataclasses
import importlib
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from moeplan.core.hardware import load_hardware
from moeplan.passes.cost.context import shape_of_plan
from moeplan.passes.cost.cost_model import STANDARD, ModelShape, Workload, predict, routing_from_trace
from moeplan.passes.cost.runtime_ops import COHERENT_HOOK_OPS, FITTED, runtime_ops
from moeplan.planner.cli import main

REPO = Path(__file__).resolve().parents[1]
TABLES = json.loads((REPO / "passes" / "cost" / "runtime_op_counts.json").read_text())
TABLE, TABLE_FLOAT32 = TABLES["architectures"], TABLES["architectures_float32"]


def _counter():
    """benchmarks/runtime_op_counts.py, imported by name (its 2-rank count spawns processes that import it so)."""
    if str(REPO / "benchmarks") not in sys.path:
        sys.path.insert(0, str(REPO / "benchmarks"))
    return importlib.import_module("runtime_op_counts")


@pytest.mark.parametrize("arch, cls", [("qwen3_moe", "Qwen3MoeForCausalLM"), ("deepseek_v3", "DeepseekV3ForCausalLM"),
                                       ("tiny_moe", "TinyMoE")])
def test_the_table_is_what_the_runtime_dispatches_now(arch, cls):
    """A recount of the runtime's decode step gives the table's row, coherent mode's extra ops at one rank too: the
    table cannot drift from the runtime."""
    counter = _counter()
    counted = counter.count(arch, 4, torch.bfloat16)
    assert counted["architecture"] == cls
    parts = ("attention_block", "moe_block", "dense_mlp_block", "fixed")
    assert {p: counted[p] for p in parts} == {p: TABLE[cls][p] for p in parts}
    coherent = counter.count(arch, 4, torch.bfloat16, mode="coherent")
    assert counter.coherent_excess(coherent, counted) == (TABLE[cls]["coherent_block"], 0)
    assert TABLE[cls]["coherent_block"] > 0  # its hooks: the routing pass, the context and block-output hooks


def test_a_float32_step_is_priced_with_the_float32_counts():
    """The runtime holds a float32 checkpoint at float32 (and every model on a CPU without AMX): its step casts
    nothing, and the table's float32 rows are what it dispatches (recounted here for Qwen3-MoE); bf16 and fp16 take
    the bf16 rows; a plan records which (`shape_of_plan` reads it back: the GPU plan test below)."""
    counted = _counter().count("qwen3_moe", 4, torch.float32)
    row = TABLE_FLOAT32["Qwen3MoeForCausalLM"]
    assert {p: counted[p] for p in ("attention_block", "moe_block", "fixed")} == {
        p: row[p] for p in ("attention_block", "moe_block", "fixed")}
    assert row["attention_block"] < TABLE["Qwen3MoeForCausalLM"]["attention_block"]  # no casts around the norms
    h100 = load_hardware("h100-sxm")
    assert runtime_ops(h100, "Qwen3MoeForCausalLM", "float32").attention == row["attention_block"]
    for dtype in ("bfloat16", "float16"):
        assert runtime_ops(h100, "Qwen3MoeForCausalLM", dtype).attention == TABLE["Qwen3MoeForCausalLM"]["attention_block"]
    assert runtime_ops(h100, "Qwen3MoeForCausalLM", "float32").record()["dtype"] == "float32"


@pytest.mark.slow
def test_the_expert_parallel_moe_block_is_what_two_ranks_dispatch_now():
    """Rank 0 of 2 gloo processes: the MoE block with its dispatch and combine exchanges, by dynamic gating and
    gathered, as the table says."""
    dynamic, gathered, coherent = _counter().count_at_world("qwen3_moe", 2)
    row = TABLE["Qwen3MoeForCausalLM"]
    assert dynamic["moe_block"] == row["moe_block_ep"]
    assert gathered["moe_block"] == row["moe_block_gathered"] < dynamic["moe_block"]
    one_rank = _counter().count("qwen3_moe", 4, torch.bfloat16)  # coherent mode's excess is over one rank's step
    assert _counter().coherent_excess(coherent, one_rank) == (row["coherent_block_ep"], row["coherent_step_ep"])


def test_gpu_profiles_price_counted_ops_and_cpu_profiles_the_fitted_ones():
    h100, cpu = load_hardware("h100-sxm"), load_hardware("cpu-gloo")
    ops = runtime_ops(h100, "Qwen3MoeForCausalLM")
    assert ops.counted and ops.expert_call == 0 and ops.moe == TABLE["Qwen3MoeForCausalLM"]["moe_block"]
    assert ops.moe_block(1) == ops.moe and ops.moe_block(8) == TABLE["Qwen3MoeForCausalLM"]["moe_block_ep"]
    assert ops.exchange_call("dispatch", 8) == 0 and ops.exchange_call("merge", 8) == FITTED.exchange_call("merge", 8) > 0
    # coherent mode: its hooks and every exchange of it in the counted excess over standard mode's step
    row = TABLE["Qwen3MoeForCausalLM"]
    assert (ops.coherent_hooks(1), ops.coherent_hooks(2), ops.coherent_step(2)) == (
        row["coherent_block"], row["coherent_block_ep"], row["coherent_step_ep"])
    # a few ops per peer beyond 2 ranks (counted at 4); 118 and 21 were counted at 8 ranks too
    assert (ops.coherent_hooks(8), ops.coherent_step(8)) == (118.0, 21.0)
    assert all(ops.exchange_calls("coherent").exchange_call(p, 8) == 0 for p in ("dispatch", "merge", "context", "token_sync"))
    assert FITTED.coherent_hooks(8) == COHERENT_HOOK_OPS and FITTED.exchange_calls("coherent") is FITTED
    assert runtime_ops(cpu, "Qwen3MoeForCausalLM") == FITTED and not FITTED.counted
    unknown = runtime_ops(h100, "SomeNewMoeForCausalLM")
    assert "median" in unknown.source and "SomeNewMoeForCausalLM" in unknown.source
    assert unknown.attention == float(np.median([row["attention_block"] for row in TABLE.values()]))


def _step(profile, touched: int) -> float:
    """Decode step seconds of 16 sequences on one rank whose tokens touch `touched` of 64 experts, with experts
    that cost nothing but their launches."""
    shape = ModelShape(hidden=64, top_k=2, num_blocks=2, moe_blocks=(0, 1), attention_flops=0.0, expert_flops=0.0,
                       architecture="Qwen3MoeForCausalLM")
    workload = Workload((4,) * 16, 2)
    tokens = sum(len(s) for s in workload.steps())
    first = np.arange(tokens) % touched
    experts = np.stack([first, (first + 1) % max(touched, 2)], axis=1)  # [tokens, 2], distinct when touched > 1
    routing = routing_from_trace(np.repeat(experts[:, None, :], 2, axis=1), workload)
    pred = predict(np.ones((2, 64, 1), dtype=bool), 1, shape, STANDARD, workload, routing, profile)
    return pred.summary(workload.prompt_tokens)["seconds_per_decode_step"]


def test_a_moe_layers_launches_do_not_grow_with_the_experts_it_calls_where_counted():
    h100 = dataclasses.replace(load_hardware("h100-sxm"), flops_per_s=1e30, memory_bytes_per_s=1e30)
    assert _step(h100, 2) == pytest.approx(_step(h100, 64), rel=1e-12)
    fitted = dataclasses.replace(h100, runtime_op_overhead_s=None)  # the old counts: one call's ops per expert
    assert _step(fitted, 64) > _step(fitted, 2)


def test_a_gpu_plan_records_the_counts_it_priced_and_whether_it_captured_its_steps_and_a_cpu_plan_neither(tmp_path):
    """plan.json `predicted.cost`: `runtime_ops` on GPU profiles; `decode_steps: cuda graphs` where GPU ranks run
    standard mode, alone or several whose MoE blocks gather (runtime_ops.py: `captures_decode_graphs`); neither on a
    CPU profile."""
    qwen3 = REPO / "examples" / "qwen3_moe"
    runner = CliRunner()
    trace = tmp_path / "t.npz"
    assert runner.invoke(main, ["trace", str(qwen3), "--data", str(REPO / "examples" / "tiny_moe" / "corpus_heldout.txt"),
                                "--max-tokens", "256", "--out", str(trace), "--quiet"]).exit_code == 0
    captured = {}
    for hardware, gpus in (("h100-sxm", 1), ("h100-sxm", 2), ("cpu-gloo", 2)):
        out = tmp_path / f"{hardware}-{gpus}.json"
        result = runner.invoke(main, ["plan", str(qwen3), "--trace", str(trace), "--nodes", "1", "--gpus-per-node",
                                      str(gpus), "--policy", "contiguous", "--mode", "standard", "--hardware", hardware,
                                      "--out", str(out)])
        assert result.exit_code == 0, result.output
        cost = json.loads(out.read_text())["predicted"]["cost"]
        captured[hardware, gpus] = cost.get("decode_steps"), cost.get("gathered_wire_bytes")
        if hardware == "h100-sxm":
            # a float32 checkpoint, held at float32 on a GPU too: the counts of a float32 step
            assert cost["runtime_ops"] == runtime_ops(load_hardware(hardware), "Qwen3MoeForCausalLM", "float32").record()
            assert cost["runtime_ops"]["dtype"] == "float32"
            assert shape_of_plan(json.loads(out.read_text())).held_dtype == "float32"  # what a check of it prices with
            assert cost["runtime_ops"]["source"] == "counted: Qwen3MoeForCausalLM"
        else:
            assert "runtime_ops" not in cost
    # a float32 checkpoint: its gathered rows travel as float32 (a bf16 one's as bf16: test_graph_pricing.py)
    assert captured == {("h100-sxm", 1): ("cuda graphs", 4), ("h100-sxm", 2): ("cuda graphs", 4),
                        ("cpu-gloo", 2): (None, None)}


def _one_rank_step(profile, mode: str) -> float:
    """Decode step seconds of 16 sequences of a 2-block Qwen3-MoE on one rank in `mode`, nothing but launches."""
    shape = ModelShape(hidden=64, top_k=2, num_blocks=2, moe_blocks=(0, 1), attention_flops=0.0, expert_flops=0.0,
                       architecture="Qwen3MoeForCausalLM")
    workload = Workload((4,) * 16, 2)
    tokens = sum(len(s) for s in workload.steps())
    experts = np.stack([np.arange(tokens) % 64, (np.arange(tokens) + 1) % 64], axis=1)
    routing = routing_from_trace(np.repeat(experts[:, None, :], 2, axis=1), workload)
    pred = predict(np.ones((2, 64, 1), dtype=bool), 1, shape, mode, workload, routing, profile)
    return pred.summary(workload.prompt_tokens)["seconds_per_decode_step"]


def test_a_calibrated_cpu_profile_prices_coherent_modes_counted_hooks():
    """A CPU calibration (`moeplan calibrate` fits `runtime_op_overhead_s`) prices the counted ops, coherent mode's
    hooks included: at one rank coherent mode's step costs the table's `coherent_block` ops a block more than standard
    mode's (the fitted counts priced 36, whatever the model)."""
    cpu = load_hardware("cpu-gloo")
    op = 1e-5
    calibrated = dataclasses.replace(cpu, runtime_op_overhead_s=op, op_overhead_s=op, python_slot_s=0.0,
                                     flops_per_s=1e30, memory_bytes_per_s=1e30)
    assert runtime_ops(calibrated, "Qwen3MoeForCausalLM").counted
    extra = _one_rank_step(calibrated, "coherent") - _one_rank_step(calibrated, STANDARD)
    assert extra == pytest.approx(2 * TABLE["Qwen3MoeForCausalLM"]["coherent_block"] * op, rel=1e-9)
    fitted = dataclasses.replace(calibrated, runtime_op_overhead_s=None)
    fitted_extra = _one_rank_step(fitted, "coherent") - _one_rank_step(fitted, STANDARD)
    assert fitted_extra == pytest.approx((2 * COHERENT_HOOK_OPS + 2) * op, rel=1e-9)  # + the second block's K/V ops


def test_a_cpu_calibrations_op_costs_more_the_more_rows_its_step_runs_on_the_rank():
    """`runtime_op_row_s` (CPU calibrations, method 6): a step's op costs the fixed part + the part per row x the rows
    it runs on the rank (standard mode: its share, coherent mode: every row); GPU profiles keep their device time."""
    from moeplan.passes.cost.cost_model import step_pricing
    from moeplan.passes.cost.runtime_ops import runtime_profile, step_profile

    cpu = dataclasses.replace(load_hardware("cpu-gloo"), runtime_op_overhead_s=1e-5, runtime_op_row_s=1e-7)
    eager = runtime_profile(cpu)
    assert step_profile(eager, 10, False).op_overhead_s == pytest.approx(1e-5 + 10 * 1e-7)
    ops = runtime_ops(cpu, "Qwen3MoeForCausalLM")
    seq = np.arange(8)  # 8 sequences, one token each, over 2 ranks
    standard, _, _ = step_pricing(eager, ops, False, 2, STANDARD, seq)
    coherent, _, _ = step_pricing(eager, ops, False, 2, "coherent", seq)
    assert standard.op_overhead_s == pytest.approx(1e-5 + 4 * 1e-7)
    assert coherent.op_overhead_s == pytest.approx(1e-5 + 8 * 1e-7)
    assert step_profile(runtime_profile(load_hardware("cpu-gloo")), 10, False).op_overhead_s == load_hardware(
        "cpu-gloo").op_overhead_s
