"""One small seeded TinyMoE, exported to ONNX once per test session and shared by the ONNX tests.

The dynamo export costs tens of seconds, so `exported_model` caches the directory and the .onnx
file under pytest's session base temp: the import tests and the trace tests reuse one export.
The model is examples/tiny_moe/model.py itself (same code path as the reference model) at a
reduced size.
"""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "tiny_moe"
SMALL = {"moeplan_loader": "model.py:load", "model_type": "tiny_moe", "vocab_size": 256, "hidden_size": 32,
         "num_layers": 3, "num_heads": 2, "num_experts": 8, "top_k": 2, "expert_hidden": 16,
         "shared_experts": 0, "max_positions": 64, "norm_eps": 1e-5}


def example_module():
    if str(EXAMPLE) not in sys.path:
        sys.path.insert(0, str(EXAMPLE))
    import model  # examples/tiny_moe/model.py

    return model


def _model_dir(root: Path) -> Path:
    import torch
    from safetensors.torch import save_file

    directory = root / "tiny_small"
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(SMALL, indent=2))
    shutil.copy(EXAMPLE / "model.py", directory / "model.py")
    m = example_module()
    torch.manual_seed(0)
    net = m.TinyMoE(m.TinyMoEConfig.from_dict(SMALL))
    save_file({k: v.contiguous() for k, v in net.state_dict().items()}, str(directory / "model.safetensors"))
    return directory


def exported_model(tmp_path_factory) -> tuple:
    """(model directory, exported .onnx path), built on first use in this session."""
    root = tmp_path_factory.getbasetemp() / "onnx_export_cache"
    onnx_path = root / "tiny_small.onnx"
    directory = root / "tiny_small"
    if not onnx_path.is_file():
        from moeplan.passes.importers import load_model
        from moeplan.planner.onnx_export import export_onnx

        directory = _model_dir(root)
        loaded = load_model(str(directory))
        export_onnx(loaded.module, onnx_path, name=loaded.ir.name)
    return directory, onnx_path


def contrib_moe_model(path: Path, *, op: str = "MoE", bits: int = 4, normalize: int = 1,
                      router_softmax: bool = False, generic_names: bool = False) -> dict:
    """Write a hand-made graph: ids -> embedding -> router MatMul -> com.microsoft MoE/QMoE -> head.

    `router_softmax` feeds the op probabilities (router -> Softmax -> router_probs) instead of
    logits; `generic_names` names the embedding and head `W0`/`W1` with no module path anywhere.
    Returns the sizes used, so tests can check the import against them.
    """
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    V, D, E, I, K = 32, 8, 4, 6, 2

    def tensor(name, shape, dtype=np.float32):
        if dtype == np.uint8:
            return numpy_helper.from_array(rng.integers(0, 255, shape, dtype=np.uint8), name)
        return numpy_helper.from_array((rng.standard_normal(shape) * 0.3).astype(dtype), name)

    inits = [tensor("embed.weight", (V, D)), tensor("router_w", (D, E)), tensor("head.weight", (D, V)),
             numpy_helper.from_array(np.array([-1, D], dtype=np.int64), "flat_shape")]
    if op == "MoE":
        inits += [tensor("fc1", (E, I, D)), tensor("fc2", (E, D, I))]
        moe_inputs = ["hf", "logits", "fc1", "", "fc2"]
        attrs = {"k": K, "activation_type": "relu", "normalize_routing_weights": normalize}
    else:
        pack = 8 // bits
        inits += [tensor("fc1_q", (E, I, D // pack), np.uint8), tensor("fc1_s", (E, I)),
                  tensor("fc2_q", (E, D, I // pack), np.uint8), tensor("fc2_s", (E, D))]
        moe_inputs = ["hf", "logits", "fc1_q", "fc1_s", "", "fc2_q", "fc2_s"]
        attrs = {"k": K, "activation_type": "relu", "normalize_routing_weights": normalize,
                 "expert_weight_bits": bits}
    nodes = [
        helper.make_node("Gather", ["embed.weight", "input_ids"], ["h"], name="embed"),
        helper.make_node("Reshape", ["h", "flat_shape"], ["hf"], name="flatten"),
        helper.make_node("MatMul", ["hf", "router_w"], ["logits"], name="router"),
        helper.make_node(op, moe_inputs, ["moe_out"], name="layers.0.moe", domain="com.microsoft", **attrs),
        helper.make_node("MatMul", ["moe_out", "head.weight"], ["out"], name="head"),
    ]
    if router_softmax:
        nodes.insert(3, helper.make_node("Softmax", ["logits"], ["probs"], name="router_softmax", axis=-1))
        nodes[4].input[1] = "probs"
    if generic_names:
        rename = {"embed.weight": "W0", "head.weight": "W1"}
        for t in inits:
            t.name = rename.get(t.name, t.name)
        for node in nodes:
            node.name = ""
            node.input[:] = [rename.get(i, i) for i in node.input]
    graph = helper.make_graph(
        nodes, "contrib_moe",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["B", "S"])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)], inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)],
                              ir_version=10)
    onnx.save(model, str(path))
    return {"vocab": V, "hidden": D, "experts": E, "inner": I, "top_k": K}


def dense_softmax_model(path: Path) -> None:
    """A graph with a router-like MatMul -> Softmax but no TopK: not an MoE model."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    w = numpy_helper.from_array(np.ones((8, 4), dtype=np.float32), "layers.0.gate.weight")
    nodes = [helper.make_node("MatMul", ["x", "layers.0.gate.weight"], ["logits"]),
             helper.make_node("Softmax", ["logits"], ["probs"], axis=-1)]
    graph = helper.make_graph(nodes, "no_topk", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 8])],
                              [helper.make_tensor_value_info("probs", TensorProto.FLOAT, ["N", 4])], [w])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10), str(path))
