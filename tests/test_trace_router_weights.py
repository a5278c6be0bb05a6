"""Traced gate weights are the weights the library's router hands its experts, not its selection scores.

DeepSeek-V3 and GLM-4.5 select experts by sigmoid score + e_score_correction_bias but weigh them
with the uncorrected scores, renormalised and scaled by routed_scaling_factor; gpt-oss weighs by
the softmax of the selected logits; Llama-4 by the sigmoid of the selected logit; PhiMoE by its
sparsemixer's masked softmaxes. The reference is what the experts module is called with (its
forward inputs top_k_index, top_k_weights; Llama-4's experts get the router's scores), taken by
a hook independent of the recorder's. The ONNX tracer is checked on an exported DeepSeek-V3 with a
nonzero correction bias, where the TopK values (corrected scores) differ from the weights.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
from moeplan.passes.analysis.trace.record import record_trace
from moeplan.passes.importers import LoadedModel, load_model
from moeplan.passes.importers.resolve import import_file
from moeplan.passes.importers.torch_module import import_module

ROOT = Path(__file__).resolve().parents[1]
bench = import_file(ROOT / "benchmarks" / "import_fidelity.py")
TEXT_IDS = np.random.default_rng(0).integers(3, 64, (2, 12))


def biased(model_type):
    """The tiny model; its score-correction biases are nonzero (`tiny_model` sets a ramp), as in
    trained checkpoints, so selection scores and gate weights differ."""
    model = bench.tiny_model(model_type)
    biases = [m.e_score_correction_bias for m in model.modules() if hasattr(m, "e_score_correction_bias")]
    assert all(b.abs().max() > 0.1 for b in biases)
    return model


def experts_calls(model, input_ids):
    """(ids [N, K], weights [N, K]) per MoE layer, as the library calls its experts modules."""
    calls = []

    def on_experts(_module, args):
        calls.append((args[1].reshape(-1, args[1].shape[-1]), args[2].reshape(-1, args[2].shape[-1])))

    def on_llama4_router(_module, _args, output):
        scores = output[0]  # [N, E]: sigmoid of the chosen logits, exactly 0 elsewhere
        k = _module.top_k
        ids = torch.argsort(-(scores > 0).to(torch.int8), dim=-1, stable=True)[:, :k]
        calls.append((ids, scores.gather(1, ids)))

    handles = []
    for module in model.modules():
        cls = type(module).__name__
        if cls == "Llama4Router":
            handles.append(module.register_forward_hook(on_llama4_router))
        elif cls.endswith("Experts") and cls != "Llama4TextExperts" and hasattr(module, "num_experts"):
            handles.append(module.register_forward_pre_hook(on_experts))
    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")  # as the recorder runs it (it needs attention probabilities)
    with torch.no_grad():
        model(input_ids=torch.from_numpy(input_ids), use_cache=False)
    model.set_attn_implementation(previous)
    for h in handles:
        h.remove()
    return calls


def heaviest_first(ids, weights):
    order = torch.argsort(-weights, dim=-1, stable=True)
    return torch.gather(ids, 1, order).numpy(), torch.gather(weights, 1, order).numpy()


@pytest.mark.parametrize("model_type", ["deepseek_v3", "glm4_moe", "gpt_oss", "llama4_text", "phimoe"])
def test_torch_trace_records_the_weights_the_experts_receive(model_type):
    model = biased(model_type)
    loaded = LoadedModel(ir=import_module(model, name=model_type, config=model.config), module=model)
    trace = record_trace(loaded, [TEXT_IDS], batch=2, seq_len=TEXT_IDS.shape[1])
    calls = experts_calls(model, TEXT_IDS)
    assert len(calls) == trace.experts.shape[1]
    for layer, (ids, weights) in enumerate(calls):
        expected_ids, expected_weights = heaviest_first(ids, weights)
        assert np.array_equal(trace.experts[:, layer], expected_ids)
        assert np.array_equal(trace.weights[:, layer], expected_weights.astype(np.float32))


def corrected_scores_at(model, input_ids, layer_ids) -> list:
    """Per MoE layer, sigmoid(router logits) + correction bias at the chosen experts (DeepSeek-V3)."""
    inputs = []
    gates = [layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "gate")]
    handles = [g.register_forward_pre_hook(lambda m, args: inputs.append(args[0])) for g in gates]
    with torch.no_grad():
        model(input_ids=torch.from_numpy(input_ids), use_cache=False)
    for h in handles:
        h.remove()
    out = []
    for gate, x, ids in zip(gates, inputs, layer_ids):
        logits = x.reshape(-1, x.shape[-1]) @ gate.weight.T
        corrected = logits.sigmoid() + gate.e_score_correction_bias
        out.append(corrected.gather(1, torch.tensor(ids)).detach().numpy())
    return out


@pytest.mark.slow
def test_onnx_trace_of_deepseek_v3_records_normalised_scaled_uncorrected_weights(tmp_path):
    from moeplan.planner.onnx_export import export_onnx

    model = biased("deepseek_v3")
    path = export_onnx(model, tmp_path / "deepseek_v3.onnx", name="deepseek_v3")
    trace = record_trace(load_model(str(path)), [TEXT_IDS], batch=2, seq_len=TEXT_IDS.shape[1])
    calls = experts_calls(model, TEXT_IDS)
    assert len(calls) == trace.experts.shape[1] == 2
    for layer, (ids, weights) in enumerate(calls):
        expected_ids, expected_weights = heaviest_first(ids, weights)
        assert np.array_equal(trace.experts[:, layer], expected_ids)
        assert np.allclose(trace.weights[:, layer], expected_weights, rtol=0, atol=1e-6)  # float32 op order
    wrong = corrected_scores_at(model, TEXT_IDS, [trace.experts[:, i] for i in range(2)])
    assert all(np.abs(w - trace.weights[:, i]).max() > 0.1 for i, w in enumerate(wrong))  # what was recorded before
