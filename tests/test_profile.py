"""Operator profiling: exact peak memory, XGBoost predictors, vCPU scaling, cache by model hash."""
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from moeplan.passes.analysis.profile import operators as prof
from moeplan.passes.analysis.profile.predictor import features, fit_predictors
from moeplan.passes.analysis.profile.peak_memory import peak_intermediate_bytes
from moeplan.passes.analysis.serverless_facts import build_facts
from moeplan.core.platforms import load_platform

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "tiny_moe"
SMALL = {"vocab_size": 256, "hidden_size": 32, "num_layers": 2, "num_heads": 2, "num_experts": 4, "top_k": 2,
         "expert_hidden": 32, "shared_experts": 0, "max_positions": 64, "norm_eps": 1e-5}


def small_model_dir(tmp_path) -> Path:
    d = tmp_path / "small_moe"
    d.mkdir()
    shutil.copy(EXAMPLE / "model.py", d / "model.py")
    (d / "config.json").write_text(json.dumps({"moeplan_loader": "model.py:load", "model_type": "tiny_moe", **SMALL}))
    return d


def small_model(tmp_path):
    from moeplan.passes.importers import load_model

    torch.manual_seed(0)
    return load_model(str(small_model_dir(tmp_path)))


def test_peak_memory_counts_intermediates_exactly():
    lin = torch.nn.Linear(16, 32, bias=False)
    for n in (1, 7, 100):
        assert peak_intermediate_bytes(lin, torch.randn(n, 16)) == n * 32 * 4  # the output only
    mlp = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 16))
    # hidden (64) and its ReLU are alive together, then the hidden is freed before the output
    assert peak_intermediate_bytes(mlp, torch.randn(10, 16)) == 10 * 64 * 4 * 2


def test_u_per_token_uses_the_vcpu_share():
    times = [[1e-6], [0.6e-6]]  # 1 and 2 threads
    assert prof.u_per_token(times, (1, 2), 0.5)[0] == pytest.approx(2e-6)   # half a core
    assert prof.u_per_token(times, (1, 2), 1.0)[0] == pytest.approx(1e-6)   # 2 threads on 1 vCPU lose
    assert prof.u_per_token(times, (1, 2), 2.0)[0] == pytest.approx(0.6e-6)


def test_predictors_fit_a_clean_law_with_small_rmsle():
    rng = np.random.default_rng(0)
    tokens = rng.choice([8, 64, 512, 2048], size=120)
    threads = rng.choice([1, 2], size=120)
    flops = rng.choice([1e4, 1e5], size=120)
    X = features(flops, flops * 2, tokens, threads, np.zeros(120))
    secs = 2e-5 + flops * tokens / 1e10 / threads
    mem = 4.0 * tokens * np.sqrt(flops)
    p = fit_predictors(X, secs, mem)
    assert p.time_rmsle < 0.3 and p.memory_rmsle < 0.3
    assert p.train_rows + p.test_rows == 120


def test_profile_is_cached_by_model_hash_and_feeds_facts(tmp_path):
    loaded = small_model(tmp_path)
    kw = dict(tokens_grid=(8, 64), threads=(1,), budget_s=0.0, cache_dir=tmp_path / "cache")
    p1 = prof.profile_model(loaded.ir, loaded.module, **kw)
    assert not p1.cached and np.isfinite(p1.time_rmsle) and np.isfinite(p1.memory_rmsle)
    assert {"head.dense", "layer0.expert", "layer0.dense", "layer1.expert", "layer1.dense", "tail.dense"} <= set(p1.groups)
    assert all(not r["estimated"] for r in p1.rows if r["kind"] == "expert")
    p2 = prof.profile_model(loaded.ir, loaded.module, **kw)
    assert p2.cached and p2.to_dict() == p1.to_dict()
    assert len(list((tmp_path / "cache").glob("profile-*.json"))) == 1
    # a different model (or settings) gets a different key
    assert prof.model_hash(loaded.ir, (8, 64), (1,), 0.0) != prof.model_hash(loaded.ir, (8, 128), (1,), 0.0)
    facts = build_facts(loaded.ir, p1, load_platform())
    lf = facts.layers[0]
    assert lf.num_experts == 4 and lf.d_in == 32 * 4
    # more memory never makes an expert slower
    u = [float(lf.u(m, 64)) for m in facts.platform.memory_options_mb]
    assert all(a >= b - 1e-15 for a, b in zip(u, u[1:]))


def test_units_without_a_runnable_module_are_estimated(tmp_path):
    loaded = small_model(tmp_path)
    p = prof.profile_model(loaded.ir, None, tokens_grid=(8, 64), threads=(1,), budget_s=0.0, cache_dir=None)
    assert p.rows and all(r["estimated"] for r in p.rows)


def test_onnx_nodes_are_attributed_to_the_units_whose_weights_they_read():
    from onnx import TensorProto, helper

    from moeplan.passes.analysis.profile.onnx_session import node_units

    w = lambda name: helper.make_tensor(name, TensorProto.FLOAT, [2, 2], [0.0] * 4)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "blocks.0.attn.qkv.weight"], ["a"], name="n0"),
         helper.make_node("Relu", ["a"], ["b"], name="n1"),
         helper.make_node("MatMul", ["b", "blocks.0.moe.experts.1.w_up.weight"], ["c"], name="n2"),
         helper.make_node("Sigmoid", ["c"], ["d"], name="n3"),
         helper.make_node("MatMul", ["b", "blocks.0.moe.gate.weight"], ["g"], name="n4")],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 2])],
        [helper.make_tensor_value_info("d", TensorProto.FLOAT, [2, 2])],
        [w("blocks.0.attn.qkv.weight"), w("blocks.0.moe.experts.1.w_up.weight"), w("blocks.0.moe.gate.weight")])
    units = [prof.Unit("blocks.0.attn", "dense", "layer0", 1, 1), prof.Unit("blocks.0.moe.expert1", "expert", "layer0", 1, 1),
             prof.Unit("blocks.0.moe.expert11", "expert", "layer0", 1, 1), prof.Unit("blocks.0.moe.router", "dense", "layer0", 1, 1)]
    got = node_units(helper.make_model(graph), units)
    assert got == {"n0": "blocks.0.attn", "n1": "blocks.0.attn", "n2": "blocks.0.moe.expert1",
                   "n3": "blocks.0.moe.expert1", "n4": "blocks.0.moe.router"}
