"""`moeplan export-onnx` on Hugging Face MoE models, through the real CLI, and the import of the file.

gpt-oss covers what HF exports needed: no KV-cache output, the batched_mm experts, RMSNorm
stages, the rotary `inv_freq` buffer (not a parameter), fused experts with biases and attention
sinks. PhiMoE routes with no TopK node (its sparsemixer picks two experts by ArgMax, masking the
first): the importer reads it as a top-2 router and the tracer records the sparsemixer's own
picks and weights. DBRX (experts looping over the experts hit) and Llama-4 (complex rotary) export
through export-only stand-ins with the same arithmetic; DeepSeek-V2's rotary stand-in is checked
in eager torch. A model that still cannot be captured (dynamic rotary scaling, which branches on
the sequence length) is refused in one line with the whole reason. The other architectures are in
`benchmarks/import_fidelity.py`.
"""
import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")
from click.testing import CliRunner

from moeplan.planner.cli import main
from moeplan.passes.importers import load_model
from moeplan.passes.importers.resolve import import_file

ROOT = Path(__file__).resolve().parents[1]
bench = import_file(ROOT / "benchmarks" / "import_fidelity.py")


def test_gpt_oss_exports_and_imports_to_its_torch_ir(tmp_path):
    model = bench.tiny_model("gpt_oss")
    model.save_pretrained(tmp_path / "gpt_oss")
    out = tmp_path / "gpt_oss.onnx"
    result = CliRunner().invoke(main, ["export-onnx", str(tmp_path / "gpt_oss"), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert model.config.use_cache is True  # the export's no-cache setting was put back
    torch_ir = load_model(str(tmp_path / "gpt_oss")).ir
    onnx_ir = load_model(str(out)).ir
    assert onnx_ir == torch_ir
    names = [s.name for s in onnx_ir.stages]
    assert "model.layers.0.input_layernorm" in names and not any("rotary" in n for n in names)
    moe = onnx_ir.moe_stages[0]
    experts = model.model.layers[0].mlp.experts
    per_expert = sum(p.numel() for p in experts.parameters()) // 4
    assert moe.expert_params == per_expert  # weights and their biases
    inspected = CliRunner().invoke(main, ["inspect", str(out), "--json", "--summary"])
    assert json.loads(inspected.stdout)["total_params"] == sum(p.numel() for p in model.parameters())


def test_phimoe_sparsemixer_imports_as_a_top_2_router_and_traces_its_own_weights(tmp_path):
    import numpy as np
    import torch

    from moeplan.passes.analysis.trace.record import record_trace

    model = bench.tiny_model("phimoe")
    model.save_pretrained(tmp_path / "phimoe")
    out = tmp_path / "phimoe.onnx"
    result = CliRunner().invoke(main, ["export-onnx", str(tmp_path / "phimoe"), "--out", str(out)])
    assert result.exit_code == 0, result.output
    onnx_ir = load_model(str(out)).ir
    assert onnx_ir == load_model(str(tmp_path / "phimoe")).ir
    assert [(s.num_experts, s.top_k) for s in onnx_ir.moe_stages] == [(4, 2), (4, 2)]

    ids = np.random.default_rng(0).integers(3, 64, (2, 10))
    routed = []
    hooks = [layer.mlp.router.register_forward_hook(lambda m, a, o: routed.append((o[2], o[1])))
             for layer in model.model.layers]
    with torch.no_grad():
        model(input_ids=torch.from_numpy(ids), use_cache=False)
    for h in hooks:
        h.remove()
    trace = record_trace(load_model(str(out)), [ids], batch=2, seq_len=10)
    for layer, (experts, weights) in enumerate(routed):
        order = torch.argsort(-weights, dim=-1, stable=True)
        assert np.array_equal(trace.experts[:, layer], torch.gather(experts, 1, order).numpy())
        assert np.allclose(trace.weights[:, layer], torch.gather(weights, 1, order).numpy(), rtol=0, atol=1e-6)


@pytest.mark.parametrize("model_type", ["dbrx", "llama4_text"])
def test_export_only_stand_ins_export_and_import_equal_to_torch(tmp_path, model_type):
    """DBRX's loop over the experts hit and Llama-4's complex rotary are swapped for the same
    arithmetic during export: the file imports to the torch IR and computes the torch logits."""
    import numpy as np
    import onnxruntime as ort
    import torch

    model = bench.tiny_model(model_type)
    model.save_pretrained(tmp_path / model_type)
    out = tmp_path / f"{model_type}.onnx"
    result = CliRunner().invoke(main, ["export-onnx", str(tmp_path / model_type), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert load_model(str(out)).ir == load_model(str(tmp_path / model_type)).ir
    ids = np.random.default_rng(0).integers(3, 64, (2, 9))
    with torch.no_grad():
        expected = model(input_ids=torch.from_numpy(ids), use_cache=False).logits.numpy()
    got = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"]).run(None, {"input_ids": ids})[0]
    assert np.abs(got - expected).max() < 1e-4


@pytest.mark.parametrize("model_type", ["dbrx", "deepseek_v2", "llama4_text"])
def test_stand_ins_compute_what_the_library_computes(model_type):
    """In eager torch, the model with the stand-ins swapped in gives the library's logits, and the
    library's own code is back afterwards."""
    import numpy as np
    import torch

    from moeplan.planner.onnx_export_equivalents import export_equivalents

    model = bench.tiny_model(model_type)
    ids = torch.from_numpy(np.random.default_rng(1).integers(3, 64, (2, 11)))
    forwards = {name: m.forward for name, m in model.named_modules()}
    with torch.no_grad():
        library = model(input_ids=ids, use_cache=False).logits
        with export_equivalents(model):
            swapped = [name for name, m in model.named_modules() if "forward" in vars(m)]
            stand_in = model(input_ids=ids, use_cache=False).logits
        after = model(input_ids=ids, use_cache=False).logits
    assert swapped  # something was replaced ...
    assert torch.allclose(stand_in, library, rtol=0, atol=1e-5)  # ... by the same arithmetic
    assert torch.equal(after, library)
    assert all("forward" not in vars(m) for m in model.modules())
    assert {name: m.forward.__func__ for name, m in model.named_modules()} == {
        name: f.__func__ for name, f in forwards.items()}


def test_unexportable_model_is_refused_in_one_whole_line(tmp_path):
    """Dynamic rotary scaling updates the frequencies when the length grows (a branch on the
    sequence length, which torch.export cannot keep dynamic): the refusal reaches the user whole,
    in one line, naming the library line."""
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config = CONFIG_MAPPING["deepseek_v2"](**{**bench.BASE, **bench.TINY["deepseek_v2"], "rope_parameters": {
        "rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}})
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "dsv2")
    result = CliRunner().invoke(main, ["export-onnx", str(tmp_path / "dsv2"), "--out", str(tmp_path / "d.onnx")])
    assert result.exit_code == 2 and result.stdout == ""
    line = result.stderr
    assert line.startswith("error: cannot export") and line.count("\n") == 1
    assert "data-dependent" in line and "dynamic_frequency_update" in line and "modeling_rope_utils.py" in line
    assert not (tmp_path / "d.onnx").exists()
