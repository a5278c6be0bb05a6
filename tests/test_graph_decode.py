"""Decode steps over KV pools in buckets (runtime/serving/row_pool.py, runtime/model/graph_decode.py), the path a GPU
rank alone captures as CUDA graphs: the pools hold what the row cache holds through joins and leaves, at addresses
that never change; a worker stepping through them produces the eager worker's tokens, logits and slot counts; the
buckets are few and bounded; a GPU rank says why it stays eager where it does. (The capture itself needs a GPU:
benchmarks/gpu/decode_step.py measures it there; here each bucket's step runs uncaptured, the same function over
the same tensors.)"""
import json
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moeplan.passes.importers.resolve import import_file
from moeplan.runtime.model.compiled_decode import compiler_missing
from moeplan.runtime.model.graph_decode import ENV, FUSED_ENV, GraphDecode, bucket
from moeplan.runtime.model.growable_cache import growable_cache
from moeplan.runtime.model.library_model import build_transformers
from moeplan.runtime.serving.decode_compile import enable_graph_decode, why_not_compiled
from moeplan.runtime.serving.row_cache import RowCache
from moeplan.runtime.serving.row_pool import PooledRows, PoolFull
from moeplan.runtime.serving.worker import BatchWorker
from runtime_fixtures import hf_model_dir, single_rank_engine

ROOT = Path(__file__).resolve().parents[1]
bench = import_file(ROOT / "benchmarks" / "compiled_decode.py")  # its step plans and logits hook
tiny = import_file(ROOT / "examples" / "hf_tiny" / "architectures.py")


@given(st.integers(1, 5000), st.sampled_from([1, 64]))
def test_a_bucket_holds_its_size_within_half_again(n, least):
    size = bucket(n, 10**6, least)
    assert size >= n and size <= max(least, 1.5 * n)
    assert bucket(size, 10**6, least) == size and bucket(n + 1, 10**6, least) >= size  # its own bucket; monotone
    assert bucket(n, n) == n  # capped at the pools' size


def _prefilled(config, lengths: list, seqs: list, seed: int) -> RowCache:
    """A RowCache as a prefill leaves it: rows right-aligned at width max(lengths), random K/V [B, H, S, d]."""
    g = torch.Generator().manual_seed(seed)
    cache = growable_cache(config, 64)
    S = max(lengths)
    for layer in cache.layers:
        layer.update(torch.randn(len(lengths), 2, S, 4, generator=g), torch.randn(len(lengths), 2, S, 4, generator=g))
    rows = RowCache("transformers")
    rows.cache, rows.seqs, rows.lengths, rows.width = cache, list(seqs), list(lengths), S
    return rows


def _visible(rows: RowCache) -> dict:
    """{seq: per layer (keys, values) of its tokens}: what attention sees of each row."""
    out = {}
    for b, (s, n) in enumerate(zip(rows.seqs, rows.lengths)):
        out[s] = [(layer.keys[b, :, rows.width - n:], layer.values[b, :, rows.width - n:]) for layer in rows.cache.layers]
    return out


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(1, 12), min_size=1, max_size=3), st.integers(0, 3), st.integers(0, 2)),
                min_size=1, max_size=8), st.integers(0, 2**16))
def test_pooled_rows_hold_what_the_row_cache_holds_at_fixed_addresses(ops, seed):
    """Random joins (prompt lengths), departures (of the first rows) and decode steps (columns written through the
    library layers' update), applied to a RowCache and to PooledRows alike."""
    import transformers

    config = transformers.MixtralConfig(hidden_size=8, num_attention_heads=2, num_key_value_heads=2, head_dim=4,
                                        num_hidden_layers=2, vocab_size=16)
    plain, pooled = RowCache("transformers"), PooledRows("transformers", rows=24, columns=64)
    addresses, next_seq = None, 0
    for step, (lengths, leaving, decodes) in enumerate(ops):
        departing = plain.seqs[:leaving]
        plain.leave(departing)
        pooled.leave(departing)
        seqs = list(range(next_seq, next_seq + len(lengths)))
        next_seq += len(lengths)
        if len(plain) + len(lengths) <= 24:
            plain.join(_prefilled(config, lengths, seqs, seed + step))
            pooled.join(_prefilled(config, lengths, seqs, seed + step))
        for d in range(decodes if len(plain) else 0):
            g = torch.Generator().manual_seed(seed + 1000 * step + d)
            new = [(torch.randn(len(plain), 2, 1, 4, generator=g), torch.randn(len(plain), 2, 1, 4, generator=g))
                   for _ in plain.cache.layers]
            for rows in (plain, pooled):
                for layer, (k, v) in zip(rows.cache.layers, new):
                    layer.update(k, v)
                rows.advanced(rows.cache, 1)
        assert (plain.seqs, plain.lengths, plain.width) == (pooled.seqs, pooled.lengths, pooled.width)
        if len(plain):
            for s, layers in _visible(plain).items():
                for (k, v), (pk, pv) in zip(layers, _visible(pooled)[s]):
                    assert torch.equal(k, pk) and torch.equal(v, pv)
            for layer, (keys, values) in zip(pooled.cache.layers, pooled.pools):
                assert layer.keys.data_ptr() == keys.data_ptr() and layer.values.data_ptr() == values.data_ptr()
        if pooled.pools is not None:
            now = [t.data_ptr() for pair in pooled.pools for t in pair]
            assert addresses in (None, now)  # allocated once
            addresses = now


def test_a_join_beyond_the_pools_says_so():
    import transformers

    config = transformers.MixtralConfig(hidden_size=8, num_attention_heads=2, num_key_value_heads=2, head_dim=4,
                                        num_hidden_layers=1, vocab_size=16)
    pooled = PooledRows("transformers", rows=2, columns=8)
    pooled.join(_prefilled(config, [3, 2], [0, 1], 0))
    with pytest.raises(PoolFull, match="3 rows of 3 columns exceed the KV pools' 2 rows of 8 columns"):
        pooled.join(_prefilled(config, [1], [2], 1))


def _workers(tmp_path, rows: int):
    directory, model = hf_model_dir(tmp_path, "mixtral")
    out = []
    for pooled in (False, True):
        engine = single_rank_engine(model, build_transformers(directory), "transformers", "standard", 2, record=False)
        worker = BatchWorker(engine, "transformers", tokens_to_rank0=False)
        logits = bench.keep_logits(engine)
        if pooled:
            assert enable_graph_decode(worker, rows) is None
        logits.clear()
        out.append((worker, logits))
    return out


def test_bucketed_steps_over_the_pools_match_the_eager_worker_through_joins_and_departures(tmp_path):
    (eager, eager_logits), (fast, fast_logits) = _workers(tmp_path, rows=16)
    graphs = fast.engine.model.compiled_decode
    assert isinstance(graphs, GraphDecode) and isinstance(fast.rows, PooledRows)
    warm_steps = graphs.steps
    assert warm_steps == 4 and fast.steps == 0 and not fast.running  # the warm-up's decode steps, then forgotten
    addresses = None
    decode_steps = 0
    for plan in bench.schedule(seed=5, steps=40, vocab=64):
        decode_steps += bool(eager.running - set(plan.depart))
        assert fast.step(plan) == eager.step(plan)
        assert len(fast_logits) == len(eager_logits)
        for a, b in zip(fast_logits, eager_logits):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
        fast_logits.clear()
        eager_logits.clear()
        if fast.rows.pools is not None:
            now = [t.data_ptr() for pair in fast.rows.pools for t in pair]
            assert addresses in (None, now)
            addresses = now
    assert decode_steps > 25 and graphs.steps - warm_steps == decode_steps  # every decode step ran over the pools
    assert fast.engine.counters.to_dict() == eager.engine.counters.to_dict()  # padding rows' slots are not counted
    assert graphs.captures == len(graphs.buckets) <= 6  # rows 1-16 in buckets 1, 2, 3, 4, 6, 8, 12, 16; columns 64
    assert all(columns == 64 for _, columns in graphs.buckets)


def test_latent_attention_steps_over_the_pools_match_the_eager_worker(tmp_path):
    """DeepSeek-V3 (MLA: the cache holds the latent and the rotary key, of different widths): the pools hold them
    where the eager worker keeps the library's own layers, and the bucketed steps give its tokens and logits."""
    from transformers.cache_utils import DynamicLayer

    config = json.loads((tiny.build("deepseek_v3", tmp_path) / "config.json").read_text())
    eager, eager_logits = bench.worker_of(config)
    fast, fast_logits = bench.worker_of(config)
    assert enable_graph_decode(fast, 16) is None
    fast_logits.clear()
    graphs, decode_steps = fast.engine.model.compiled_decode, 0
    warm_steps = graphs.steps
    for plan in bench.schedule(seed=3, steps=30, vocab=config["vocab_size"]):
        decode_steps += bool(eager.running - set(plan.depart))
        assert fast.step(plan) == eager.step(plan)
        for a, b in zip(fast_logits, eager_logits, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
        fast_logits.clear()
        eager_logits.clear()
        if len(eager.rows):
            assert all(type(layer) is DynamicLayer for layer in eager.rows.cache.layers)
    assert decode_steps > 15 and graphs.steps - warm_steps == decode_steps
    widths = {(keys.shape[-1], values.shape[-1]) for keys, values in fast.rows.pools}
    assert widths == {(config["kv_lora_rank"], config["qk_rope_head_dim"])}


@pytest.mark.skipif(compiler_missing() is not None, reason=str(compiler_missing()))
def test_fused_bucket_steps_run_one_compiled_graph_for_every_bucket_and_match_the_eager_worker(tmp_path, monkeypatch):
    """MOEPLAN_GRAPH_INDUCTOR=1: each bucket's step is inductor's (a GPU would capture its fused kernels); rows and
    columns are dynamic, so after the warm-up no bucket compiles a graph of its own."""
    from torch._dynamo.utils import counters

    monkeypatch.setenv(FUSED_ENV, "1")
    (eager, eager_logits), (fast, fast_logits) = _workers(tmp_path, rows=16)
    graphs = fast.engine.model.compiled_decode
    assert graphs.fused and graphs.failure is None
    compiled = counters["stats"]["unique_graphs"]
    for plan in bench.schedule(seed=5, steps=40, vocab=64):
        assert fast.step(plan) == eager.step(plan)
        for a, b in zip(fast_logits, eager_logits, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
        fast_logits.clear()
        eager_logits.clear()
    assert graphs.fused and len(graphs.buckets) >= 4
    assert counters["stats"]["unique_graphs"] == compiled  # no graph compiled after the warm-up


def test_a_gpu_rank_says_why_its_steps_are_not_captured(tmp_path, monkeypatch):
    directory, model = hf_model_dir(tmp_path, "mixtral")
    engine = single_rank_engine(model, build_transformers(directory), "transformers", "standard", 2, record=False)
    worker = BatchWorker(engine, "transformers", tokens_to_rank0=False)
    engine.device = torch.device("cuda", 0)  # the decision only: nothing runs on it
    monkeypatch.setenv(ENV, "1")
    assert why_not_compiled(worker) is None
    monkeypatch.setenv(ENV, "0")
    assert why_not_compiled(worker) == "MOEPLAN_CUDA_GRAPHS is off"
    monkeypatch.setenv(ENV, "1")
    worker.world = engine.world = 2  # ranks of several capture where their steps can gather (gathered_moe.py)
    assert why_not_compiled(worker) is None
    engine.records = True
    assert why_not_compiled(worker) == "a recording engine reads the routing on the host"
    worker.world, worker.coherent = 1, True
    assert why_not_compiled(worker) == "coherent mode's ranks run eager decode steps"
