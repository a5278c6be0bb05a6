"""`moeplan export-onnx` on Hugging Face MoE models, through the real CLI, and the import of the file.

gpt-oss covers what HF exports needed: no KV-cache output, the batched_mm experts, RMSNorm
stages, the rotary `inv_freq` buffer (not a parameter), fused experts with biases and attention
sinks. PhiMoE routes with no TopK node (its sparsemixer picks two experts by ArgMax, masking the
first): the importer reads it as a top-2 router and the tracer records the sparsemixer's own
picks and weights. DBRX cannot be captured (its experts loop over the experts hit, a data-dependent count):
the refusal is one line with the whole reason. The other architectures are in
`benchmarks/import_fidelity.py`.
"""
import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")
from click.testing import CliRunner  # noqa: E402

from moeplan.planner.cli import main  # noqa: E402
from moeplan.planner.importers import load_model  # noqa: E402
from moeplan.planner.importers.resolve import import_file  # noqa: E402

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


def test_dbrx_export_is_refused_in_one_whole_line(tmp_path):
    model = bench.tiny_model("dbrx")
    model.save_pretrained(tmp_path / "dbrx")
    result = CliRunner().invoke(main, ["export-onnx", str(tmp_path / "dbrx"), "--out", str(tmp_path / "d.onnx")])
    assert result.exit_code == 2 and result.stdout == ""
    line = result.stderr
    assert line.startswith("error: cannot export") and line.count("\n") == 1
    assert "data-dependent" in line and "modeling_dbrx.py" in line and "for expert_idx in expert_hit" in line
    assert not (tmp_path / "d.onnx").exists()
