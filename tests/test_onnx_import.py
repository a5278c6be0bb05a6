"""ONNX import: an exported TinyMoE imports to the IR of its torch import; fused MoE ops and bad files."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from moeplan.planner.cli import main
from moeplan.core.errors import UserError
from moeplan.passes.importers import load_model
from moeplan.passes.importers.onnx_graph import import_onnx
from onnx_fixtures import SMALL, contrib_moe_model, dense_softmax_model, exported_model


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    return exported_model(tmp_path_factory)


def test_exported_tiny_moe_imports_equal_to_its_torch_import(exported):
    directory, onnx_path = exported
    torch_ir = load_model(str(directory)).ir
    onnx_loaded = load_model(str(onnx_path))
    assert onnx_loaded.ir == torch_ir
    assert onnx_loaded.onnx_path == str(onnx_path) and onnx_loaded.module is None
    assert onnx_loaded.ir.source_format == "onnx" and torch_ir.source_format == "torch"
    moe = onnx_loaded.ir.moe_stages
    assert [s.name for s in moe] == [f"blocks.{i}.moe" for i in range(SMALL["num_layers"])]
    assert {(s.num_experts, s.top_k) for s in moe} == {(SMALL["num_experts"], SMALL["top_k"])}
    assert all(s.source.startswith("onnx:") for s in moe)


def test_export_runs_in_onnxruntime_at_any_batch_and_length(exported):
    import onnxruntime as ort
    import torch

    directory, onnx_path = exported
    module = load_model(str(directory)).module
    session = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(1)
    for shape in [(1, 5), (3, 17)]:
        ids = rng.integers(0, 256, shape)
        with torch.no_grad():
            expected = module(torch.from_numpy(ids)).numpy()
        got = session.run(None, {"input_ids": ids})[0]
        assert got.shape == expected.shape
        assert np.abs(got - expected).max() < 1e-4


def test_contrib_moe_op_reads_k_and_stacked_expert_shapes(tmp_path):
    sizes = contrib_moe_model(tmp_path / "moe.onnx")
    ir = import_onnx(tmp_path / "moe.onnx")
    D, E, I = sizes["hidden"], sizes["experts"], sizes["inner"]
    assert [s.kind for s in ir.stages] == ["embedding", "moe", "head"]
    (moe,) = ir.moe_stages
    assert moe.name == "layers.0.moe" and moe.top_k == sizes["top_k"] and moe.num_experts == E
    assert moe.expert_params == 2 * D * I and moe.router_params == D * E
    assert moe.params == E * 2 * D * I + D * E and moe.hidden_size == D
    assert ir.vocab_size == sizes["vocab"] and ir.hidden_size == D  # head stored [D, V] as x @ W


def test_contrib_moe_op_with_router_probabilities_through_softmax(tmp_path):
    """onnxruntime's MoE takes router_probs; a graph may compute them with a Softmax first."""
    sizes = contrib_moe_model(tmp_path / "moe.onnx", router_softmax=True)
    ir = import_onnx(tmp_path / "moe.onnx")
    (moe,) = ir.moe_stages
    D, E, _I = sizes["hidden"], sizes["experts"], sizes["inner"]
    assert (moe.num_experts, moe.top_k, moe.router_params) == (E, sizes["top_k"], D * E)
    assert ir.stages == import_onnx(_plain(tmp_path)).stages  # the same model as its logits-fed twin


def _plain(tmp_path):
    contrib_moe_model(tmp_path / "plain.onnx")
    return tmp_path / "plain.onnx"


def test_anonymous_embedding_and_head_are_found_by_data_flow(tmp_path):
    """Initializers named W0/W1 with no node names: the Gather by the token ids is the embedding,
    the MatMul producing the graph output the head; the vocabulary comes from them."""
    sizes = contrib_moe_model(tmp_path / "anon.onnx", generic_names=True)
    ir = import_onnx(tmp_path / "anon.onnx")
    assert ir.vocab_size == sizes["vocab"] and ir.hidden_size == sizes["hidden"]
    kinds = [s.kind for s in ir.stages]
    assert kinds == ["embedding", "moe", "head"]
    assert ir.total_params == import_onnx(_plain(tmp_path)).total_params


def test_quantized_moe_op_counts_unpacked_4bit_weights(tmp_path):
    sizes = contrib_moe_model(tmp_path / "qmoe.onnx", op="QMoE", bits=4)
    (moe,) = import_onnx(tmp_path / "qmoe.onnx").moe_stages
    D, E, I = sizes["hidden"], sizes["experts"], sizes["inner"]
    scales = I + D  # one float32 scale per output row of fc1 and fc2
    assert moe.expert_params == 2 * D * I + scales
    assert moe.expert_param_bytes == (2 * D * I) // 2 + 4 * scales
    assert moe.top_k == sizes["top_k"] and moe.num_experts == E


def test_softmax_without_topk_is_not_an_moe_model(tmp_path):
    path = tmp_path / "dense.onnx"
    dense_softmax_model(path)
    with pytest.raises(UserError, match=r"no MoE gating pattern \(MatMul->Softmax->TopK or com.microsoft MoE\)"):
        import_onnx(path)


def test_text_file_renamed_onnx_is_rejected(tmp_path):
    path = tmp_path / "notes.onnx"
    path.write_text("these are my notes, not a model\n" * 20)
    with pytest.raises(UserError, match="ONNX"):
        import_onnx(path)


def test_export_onnx_refuses_an_onnx_model(tmp_path):
    contrib_moe_model(tmp_path / "moe.onnx")
    result = CliRunner().invoke(main, ["export-onnx", str(tmp_path / "moe.onnx"), "--out", str(tmp_path / "o.onnx")])
    assert result.exit_code == 2 and "already an ONNX model" in result.output
    assert not (tmp_path / "o.onnx").exists()


@pytest.mark.parametrize("kind", ["text", "no_moe"])
def test_inspect_cli_fails_in_one_line_on_bad_onnx(tmp_path, kind):
    path = tmp_path / f"{kind}.onnx"
    if kind == "text":
        path.write_text("hello\n")
    else:
        dense_softmax_model(path)
    done = subprocess.run([sys.executable, "-m", "moeplan.planner.cli", "inspect", str(path)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.startswith("error: ") and done.stderr.count("\n") == 1
    assert "Traceback" not in done.stderr and str(path) in done.stderr


def _strip_names(src: Path, dst: Path) -> None:
    """The same graph with anonymous initializers (W0, W1, ...) and no node names or metadata."""
    import onnx

    model = onnx.load(str(src))
    renamed = {t.name: f"W{i}" for i, t in enumerate(model.graph.initializer)}
    for tensor in model.graph.initializer:
        tensor.name = renamed[tensor.name]
    for node in model.graph.node:
        del node.metadata_props[:]
        node.name = ""
        for i, name in enumerate(node.input):
            node.input[i] = renamed.get(name, name)
    del model.metadata_props[:]
    onnx.save(model, str(dst))


def test_experts_are_found_from_data_flow_when_names_are_lost(exported, tmp_path):
    _, onnx_path = exported
    anonymous = tmp_path / "anonymous.onnx"
    _strip_names(onnx_path, anonymous)
    named, blind = import_onnx(onnx_path), import_onnx(anonymous)
    fields = ("num_experts", "top_k", "expert_params", "router_params", "params", "flops_per_token", "shared_experts")
    assert [[getattr(s, f) for f in fields] for s in blind.moe_stages] == \
           [[getattr(s, f) for f in fields] for s in named.moe_stages]
    assert blind.total_params == named.total_params
    assert [s.name for s in blind.moe_stages] == [f"moe{i}" for i in range(SMALL["num_layers"])]
