"""Top-k routers with no TopK node: k picks by ArgMax, each masking the last (PhiMoE's sparsemixer shape).

A small torch MoE that routes top-3 by repeated argmax + scatter(-inf) is exported to ONNX; the
importer must read it as a top-3 router (IR equal to the torch import) and the ONNX tracer must
record the picks and weights the module computes. An ArgMax over the head's logits (an in-graph
greedy decode) is no router. PhiMoE itself is in test_onnx_hf_export.py.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from moeplan.passes.analysis.trace.record_onnx import record_onnx_routing
from moeplan.passes.importers.onnx_gating import find_gates
from moeplan.passes.importers.onnx_graph import import_onnx
from moeplan.passes.importers.torch_module import import_module
from moeplan.planner.onnx_export import export_onnx

V, D, E, F, K = 48, 16, 6, 8, 3


class Expert(nn.Module):
    def __init__(self):
        super().__init__()
        self.w_up = nn.Linear(D, F, bias=False)
        self.w_down = nn.Linear(F, D, bias=False)

    def forward(self, x):
        return self.w_down(torch.relu(self.w_up(x)))


class ArgmaxMoE(nn.Module):
    """Routes each token to K experts picked one at a time: argmax, then the pick masked to -inf."""

    def __init__(self):
        super().__init__()
        self.top_k = K
        self.gate = nn.Linear(D, E, bias=False)
        self.experts = nn.ModuleList(Expert() for _ in range(E))

    def route(self, x):
        """ids [N, K], weights [N, K]: picks in order, each weighted by its softmax probability."""
        logits = self.gate(x)
        probs = logits.softmax(-1)
        masked, ids, weights = logits, [], []
        for _ in range(K):
            pick = masked.argmax(-1, keepdim=True)
            ids.append(pick)
            weights.append(probs.gather(-1, pick))
            masked = masked.scatter(-1, pick, float("-inf"))
        return torch.cat(ids, -1), torch.cat(weights, -1)

    def forward(self, x):  # x [N, D]
        ids, weights = self.route(x)
        every = torch.stack([e(x) for e in self.experts], 1)  # [N, E, D]
        chosen = every.gather(1, ids[..., None].expand(-1, -1, D))  # [N, K, D]
        return (chosen * weights[..., None]).sum(1)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.moe = ArgmaxMoE()

    def forward(self, h):
        return h + self.moe(self.norm(h).reshape(-1, D)).reshape(h.shape)


class ArgmaxModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.layers = nn.ModuleList(Block() for _ in range(2))
        self.lm_head = nn.Linear(D, V, bias=False)

    def forward(self, input_ids):
        h = self.embed(input_ids)
        for layer in self.layers:
            h = layer(h)
        return self.lm_head(h)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    torch.manual_seed(0)
    model = ArgmaxModel().eval()
    path = tmp_path_factory.mktemp("argmax") / "argmax.onnx"
    export_onnx(model, path, name="argmax")
    return model, path


def test_repeated_argmax_with_masking_is_a_top_k_router(exported):
    model, path = exported
    ir = import_onnx(path)
    assert ir == import_module(model, name="argmax")
    assert [(s.name, s.num_experts, s.top_k) for s in ir.moe_stages] == [(f"layers.{i}.moe", E, K) for i in range(2)]


def test_onnx_trace_records_the_picks_and_weights_the_module_computes(exported):
    model, path = exported
    ids = np.random.default_rng(0).integers(0, V, (2, 7))
    inputs = []
    handles = [layer.moe.register_forward_pre_hook(lambda m, args: inputs.append(args[0])) for layer in model.layers]
    with torch.no_grad():
        model(torch.from_numpy(ids))
        routes = [layer.moe.route(x) for layer, x in zip(model.layers, inputs)]
    for h in handles:
        h.remove()
    out = record_onnx_routing(path, ids)
    for layer, (experts, weights) in enumerate(routes):
        order = torch.argsort(-weights, dim=-1, stable=True)
        assert np.array_equal(out["experts"][:, layer], torch.gather(experts, 1, order).numpy())
        assert np.allclose(out["weights"][:, layer], torch.gather(weights, 1, order).numpy(), rtol=0, atol=1e-6)


def test_argmax_of_the_head_logits_is_no_router(exported, tmp_path):
    """An in-graph greedy decode (ArgMax over the logits) leaves the gates and the IR unchanged."""
    import onnx
    from onnx import TensorProto, helper

    model, path = exported
    proto = onnx.load(str(path))
    logits = proto.graph.output[0].name
    proto.graph.node.append(helper.make_node("ArgMax", [logits], ["next_token"], axis=-1, keepdims=0))
    proto.graph.output.append(helper.make_tensor_value_info("next_token", TensorProto.INT64, None))
    greedy = tmp_path / "greedy.onnx"
    onnx.save(proto, str(greedy))
    assert [g.top_k for g in find_gates(onnx.load(str(greedy)))] == [K, K]
    assert import_onnx(greedy) == import_onnx(path)
