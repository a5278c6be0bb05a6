"""ONNX tracing: the same tokens through torch and onnxruntime give the same routing.

The small seeded TinyMoE export is shared with the import tests (`onnx_fixtures`). The trained
example checkpoint is compared too when MOEPLAN_TEST_FULL_ONNX=1 (its export takes about a minute
of CPU, too long for every test run).
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import numpy_helper

from moeplan.passes.analysis.trace.record import record_trace
from moeplan.passes.analysis.trace.record_onnx import record_onnx_routing
from moeplan.core.errors import UserError
from moeplan.passes.importers import load_model
from onnx_fixtures import EXAMPLE, SMALL, contrib_moe_model, dense_softmax_model, exported_model

TEXT = (Path(__file__).resolve().parents[1] / "core" / "ir.py").read_text()[:1500]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    return exported_model(tmp_path_factory)


def _assert_same_routing(torch_trace, onnx_trace):
    assert onnx_trace.experts.shape == torch_trace.experts.shape
    np.testing.assert_array_equal(onnx_trace.experts, torch_trace.experts)
    np.testing.assert_allclose(onnx_trace.weights, torch_trace.weights, atol=1e-5)
    assert onnx_trace.attention_ids is not None
    np.testing.assert_array_equal(onnx_trace.attention_ids, torch_trace.attention_ids)
    np.testing.assert_array_equal(onnx_trace.token_ids, torch_trace.token_ids)


def test_same_text_gives_identical_expert_choices_in_torch_and_onnx(exported):
    directory, onnx_path = exported
    seq_len = SMALL["max_positions"]
    torch_trace = record_trace(load_model(str(directory)), TEXT, batch=4, seq_len=seq_len)
    onnx_trace = record_trace(load_model(str(onnx_path)), TEXT, batch=4, seq_len=seq_len)
    assert onnx_trace.experts.shape[1:] == (SMALL["num_layers"], SMALL["top_k"])
    _assert_same_routing(torch_trace, onnx_trace)


def test_routing_arrays_have_the_documented_shapes(exported):
    _, onnx_path = exported
    ids = np.random.default_rng(3).integers(0, 256, (2, 9))
    out = record_onnx_routing(onnx_path, ids)
    L, K = SMALL["num_layers"], SMALL["top_k"]
    assert out["experts"].shape == (18, L, K) and out["weights"].shape == (18, L, K)
    assert out["weights"].dtype == np.float32
    assert np.all(np.diff(out["weights"], axis=-1) <= 0)  # heaviest first
    np.testing.assert_allclose(out["weights"].sum(-1), 1.0, atol=1e-5)  # TinyMoE renormalises
    assert out["attention_ids"].shape == (18, L)
    assert np.isin(out["attention_ids"], ids).all()
    # the first token of each sequence can only attend to itself
    np.testing.assert_array_equal(out["attention_ids"][[0, 9]], np.repeat(ids[:, :1], L, axis=1))


def test_contrib_moe_routing_reproduces_the_fused_op_output(tmp_path):
    path = tmp_path / "moe.onnx"
    contrib_moe_model(path)
    ids = np.arange(12).reshape(2, 6) % 32
    out = record_onnx_routing(path, ids)
    assert out["attention_ids"] is None and out["experts"].shape == (12, 1, 2)

    model = onnx.load(str(path))
    weights = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    model.graph.output.extend([onnx.ValueInfoProto(name="moe_out"), onnx.ValueInfoProto(name="hf")])
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    fused, tokens = session.run(["moe_out", "hf"], {"input_ids": ids})
    rebuilt = np.zeros_like(tokens)
    for t in range(tokens.shape[0]):
        for e, w in zip(out["experts"][t, 0], out["weights"][t, 0]):
            hidden = np.maximum(tokens[t] @ weights["fc1"][e].T, 0)
            rebuilt[t] += w * (hidden @ weights["fc2"][e].T)
    np.testing.assert_allclose(rebuilt, fused, atol=1e-5)


def test_graph_without_gates_cannot_be_traced(tmp_path):
    path = tmp_path / "dense.onnx"
    dense_softmax_model(path)
    with pytest.raises(UserError, match="no MoE gating pattern"):
        record_onnx_routing(path, np.zeros((1, 4), dtype=np.int64))


@pytest.mark.skipif(
    os.environ.get("MOEPLAN_TEST_FULL_ONNX") != "1" or not (EXAMPLE / "model.safetensors").is_file(),
    reason="set MOEPLAN_TEST_FULL_ONNX=1 (with the trained example present) to export the full model",
)
def test_trained_example_routes_identically_in_onnx(tmp_path):
    from moeplan.planner.onnx_export import export_onnx

    torch_loaded = load_model(str(EXAMPLE))
    onnx_path = export_onnx(torch_loaded.module, tmp_path / "tiny_moe.onnx", name=torch_loaded.ir.name)
    onnx_loaded = load_model(str(onnx_path))
    assert onnx_loaded.ir == torch_loaded.ir
    text = (EXAMPLE / "corpus_heldout.txt").read_text()[:4096]
    _assert_same_routing(record_trace(torch_loaded, text, batch=8, seq_len=128),
                         record_trace(onnx_loaded, text, batch=8, seq_len=128))
