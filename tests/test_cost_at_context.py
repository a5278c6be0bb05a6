"""Attention at context in the torchrun cost model (issue 38 item 2): a decode step's attention FLOPs and
KV-cache reads grow with the context its tokens attend to (passes/cost/attention_context.py, added to each
block's attention compute by cost_model.predict), by hand on a tiny shape, on a real config, and in the
plans `moeplan plan --workload` writes."""
import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from moeplan.core.hardware import load_hardware
from moeplan.passes.cost.attention_context import AttentionContext
from moeplan.passes.cost.context import attention_of, shape_of_plan, shape_with_context
from moeplan.passes.cost.cost_model import STANDARD, ModelShape, Workload, predict, routing_from_trace
from moeplan.planner.cli import main

ROOT = Path(__file__).resolve().parents[1]
MIXTRAL = ROOT / "examples" / "configs" / "mixtral-8x7b.json"
MIXTRAL_TRACE = ROOT / "examples" / "ci" / "mixtral-8x7b.trace.npz"


def _same_route(workload: Workload, layers: int, top_k: int) -> dict:
    """Every token routed to experts 0..k-1 at every layer: steps differ only by their context."""
    tokens = sum(len(s) for s in workload.steps())
    return routing_from_trace(np.tile(np.arange(top_k), (tokens, layers, 1)), workload)


def _one_block_shapes() -> tuple[ModelShape, ModelShape]:
    """One MoE block with no attention or expert FLOPs of its own, priced at a short context and at
    context (1000 FLOPs per key, 64 KV bytes per cached token): their difference is the context's."""
    short = ModelShape(hidden=8, top_k=1, num_blocks=1, moe_blocks=(0,), attention_flops=0.0, expert_flops=0.0)
    return short, dataclasses.replace(short, attention_context=AttentionContext(flops_per_key=1000.0, kv_bytes_per_key=64.0))


@pytest.mark.parametrize("flops_per_s, memory_bytes_per_s, bound", [(1e4, 1e6, "flops"), (1e6, 1e3, "bytes")])
def test_each_step_adds_its_keys_and_cache_reads_as_the_formula_gives(flops_per_s, memory_bytes_per_s, bound):
    """One rank, one MoE block, workload 2 x 3 + 2, 1000 FLOPs per key and 64 KV bytes per cached token.
    Prefill: keys 1 + 2 + 3 per sequence = 12 -> 12,000 FLOPs; caches 3 + 3 tokens -> 384 bytes. Decode (each
    sequence at position 3): keys 4 + 4 -> 8,000 FLOPs; caches 4 + 4 -> 512 bytes. The attention's compute is
    ops x op cost + max(FLOPs / rate, bytes / bandwidth), so with no other FLOPs or bytes in it each step
    grows by exactly max(FLOPs / rate, bytes / bandwidth) over the same step at a short context."""
    profile = dataclasses.replace(load_hardware("cpu-gloo"), flops_per_s=flops_per_s, memory_bytes_per_s=memory_bytes_per_s)
    short, at_context = _one_block_shapes()
    workload = Workload((3, 3), 2)
    routing = _same_route(workload, 1, 1)
    hosts = np.ones((1, 4, 1), dtype=bool)
    base = predict(hosts, 1, short, STANDARD, workload, routing, profile).step_seconds
    more = predict(hosts, 1, at_context, STANDARD, workload, routing, profile).step_seconds
    by_hand = [max(12_000 / flops_per_s, 384 / memory_bytes_per_s), max(8_000 / flops_per_s, 512 / memory_bytes_per_s)]
    assert [m - b for m, b in zip(more, base)] == pytest.approx(by_hand, rel=1e-9)
    assert by_hand[1] == (8_000 / flops_per_s if bound == "flops" else 512 / memory_bytes_per_s)


def test_two_ranks_each_read_the_caches_of_the_sequences_they_hold():
    """Standard mode on 2 ranks computing at once: sequence s runs its attention on rank s % 2, and each rank adds
    only its own sequences' keys (decode: sequence 0 at position 9 on rank 0, 10 keys; sequence 1 at position 1
    on rank 1, 2 keys), so the step, paced by the slowest rank, grows by rank 0's 10 x 1000 FLOPs."""
    profile = dataclasses.replace(load_hardware("cpu-gloo"), flops_per_s=1e4, memory_bytes_per_s=1e12, parallel_ranks=2)
    short, at_context = _one_block_shapes()
    workload = Workload((9, 1), 2)
    routing = _same_route(workload, 1, 1)
    hosts = np.ones((1, 4, 2), dtype=bool)
    base = predict(hosts, 2, short, STANDARD, workload, routing, profile).step_seconds
    more = predict(hosts, 2, at_context, STANDARD, workload, routing, profile).step_seconds
    assert more[1] - base[1] == pytest.approx(10 * 1000 / 1e4, rel=1e-9)


def test_a_long_context_decode_step_costs_more_on_a_real_config():
    """Mixtral-8x7B (GQA: 32 query heads, 8 KV heads of 128) on 2 ranks: 16 x 1024 + 8 and 16 x 1 + 8 route every
    token alike, so at a short context their decode steps are equal; priced at context the long one's is
    longer, by at least the KV reads of the busiest rank (all routed rows go to rank 0: its 8 sequences x 1025..1031
    cached tokens x the KV bytes per token, in each of the 32 blocks)."""
    from moeplan.passes.importers import load_model

    loaded = load_model(str(MIXTRAL))
    attention = attention_of(loaded.module, loaded.ir)
    assert attention.flops_per_key == 2 * 32 * (128 + 128) and attention.kv_bytes_per_key == 2 * 8 * 128 * 4
    profile = load_hardware("h100-sxm")
    hosts = np.zeros((32, 8, 2), dtype=bool)
    hosts[:, :4, 0] = hosts[:, 4:, 1] = True
    decode = {}
    for priced in (None, attention):
        shape = shape_with_context(loaded.ir, [], priced)
        for prompt in (1, 1024):
            workload = Workload((prompt,) * 16, 8)
            pred = predict(hosts, 2, shape, STANDARD, workload, _same_route(workload, 32, 2), profile)
            decode[priced is not None, prompt] = pred.summary(workload.prompt_tokens)["seconds_per_decode_step"]
    assert decode[False, 1024] == pytest.approx(decode[False, 1], rel=1e-12)
    assert decode[True, 1] > decode[False, 1]
    kv_reads = 8 * 1025 * attention.kv_bytes_per_key / profile.memory_bytes_per_s  # rank 0's 8 sequences, one block
    assert decode[True, 1024] - decode[False, 1024] >= 32 * kv_reads * (1 - 1e-9)
    assert decode[True, 1024] > decode[True, 1]


def test_plans_price_the_workloads_context_and_record_it(tmp_path):
    """`moeplan plan --workload`: 16 x 1024 + 8 predicts a longer decode step than 16 x 1 + 8, and plan.json
    records the attention at context it priced with, which the report's re-pricing reads back."""
    steps = {}
    for workload in ("16x1024+8", "16x1+8"):
        out = tmp_path / f"{workload}.json"
        result = CliRunner().invoke(main, ["plan", str(MIXTRAL), "--trace", str(MIXTRAL_TRACE), "--nodes", "1",
                                           "--gpus-per-node", "2", "--policy", "contiguous", "--mode", "standard",
                                           "--hardware", "h100-sxm", "--workload", workload, "--out", str(out)])
        assert result.exit_code == 0, result.output
        plan = json.loads(out.read_text())
        cost = plan["predicted"]["cost"]
        # K and V of 8 KV heads of 128 at bf16: the runtime holds Mixtral's bf16 checkpoint at bf16 on an H100
        assert cost["attention_context"] == {"flops_per_key": 2.0 * 32 * 256, "kv_bytes_per_key": 2.0 * 8 * 128 * 2}
        assert shape_of_plan(plan).attention_context == AttentionContext(2.0 * 32 * 256, 2.0 * 8 * 128 * 2)
        steps[workload] = cost["modes"]["standard"]["seconds_per_decode_step"]
    assert steps["16x1024+8"] > steps["16x1+8"]


def test_the_kv_cache_is_priced_at_the_dtype_the_runtime_holds_on_the_plans_hardware():
    """Mixtral-8x7B (bf16): its KV at bf16 on GPU profiles, at float32 where the device is this CPU."""
    from moeplan.passes.importers import load_model

    loaded = load_model(str(MIXTRAL))
    per_key = {name: attention_of(loaded.module, loaded.ir, load_hardware(name)).kv_bytes_per_key
               for name in ("h100-sxm", "a100-sxm", "cpu-gloo")}
    assert per_key == {"h100-sxm": 2.0 * 8 * 128 * 2, "a100-sxm": 2.0 * 8 * 128 * 2, "cpu-gloo": 2.0 * 8 * 128 * 4}
    assert attention_of(loaded.module, loaded.ir).kv_bytes_per_key == per_key["cpu-gloo"]  # no profile: float32
