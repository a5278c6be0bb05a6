"""Attention at context for moeplan's own runtime (passes/cost/attention_context.py): FLOPs per key and KV bytes
per cached token from real configs, and a step's extra cost growing with the context its tokens attend to."""
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moeplan.passes.cost.attention_context import AttentionContext, context_cost, runtime_attention_context

CONFIGS = Path(__file__).resolve().parents[1] / "examples" / "configs"


def loaded(name: str):
    from moeplan.passes.importers.resolve import load_model

    model = load_model(CONFIGS / name)
    return model.module.config, model.ir


@pytest.mark.slow
def test_gqa_and_mla_attention_at_context_from_real_configs():
    qwen = runtime_attention_context(*loaded("qwen3-30b-a3b.json"))  # 32 q heads, 4 KV heads of 128
    assert qwen.flops_per_key == 2 * 32 * (128 + 128)
    assert qwen.kv_bytes_per_key == 2 * 4 * 128 * 4  # K and V of the KV heads, float32
    v3 = runtime_attention_context(*loaded("deepseek-v3.json"))  # 128 heads, qk 128 + 64, v 128; latent 512 + 64
    assert v3.flops_per_key == 2 * 128 * (192 + 128)
    assert v3.kv_bytes_per_key == (512 + 64) * 4


def test_decode_at_long_context_costs_more_and_prefill_reads_each_cache_once():
    ctx = AttentionContext(flops_per_key=100.0, kv_bytes_per_key=10.0)
    assert context_cost(ctx, [(0, 1023), (1, 1023)]) == (100.0 * 2048, 10.0 * 2048)
    assert context_cost(ctx, [(0, 0), (1, 0)]) == (200.0, 20.0)
    prefill = context_cost(ctx, [(0, p) for p in range(4)])  # 1 + 2 + 3 + 4 keys, one cache of 4 tokens read
    assert prefill == (1000.0, 40.0)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 7), st.integers(0, 5000)), min_size=1, max_size=30, unique=True),
       st.integers(1, 4096))
def test_cost_grows_with_context(tokens, later):
    ctx = AttentionContext(flops_per_key=3.0, kv_bytes_per_key=2.0)
    flops, nbytes = context_cost(ctx, tokens)
    more_flops, more_bytes = context_cost(ctx, [(s, p + later) for s, p in tokens])
    assert more_flops > flops and more_bytes > nbytes
    assert flops == pytest.approx(3.0 * sum(p + 1 for _, p in tokens))
