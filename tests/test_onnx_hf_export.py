"""`moeplan export-onnx` on Hugging Face MoE models, through the real CLI, and the import of the file.

gpt-oss covers what HF exports needed: no KV-cache output, the batched_mm experts, RMSNorm
stages, the rotary `inv_freq` buffer (not a parameter), fused experts with biases and attention
sinks. DBRX cannot be captured (its experts loop over the experts hit, a data-dependent count):
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


def test_dbrx_export_is_refused_in_one_whole_line(tmp_path):
    model = bench.tiny_model("dbrx")
    model.save_pretrained(tmp_path / "dbrx")
    result = CliRunner().invoke(main, ["export-onnx", str(tmp_path / "dbrx"), "--out", str(tmp_path / "d.onnx")])
    assert result.exit_code == 2 and result.stdout == ""
    line = result.stderr
    assert line.startswith("error: cannot export") and line.count("\n") == 1
    assert "data-dependent" in line and "modeling_dbrx.py" in line and "for expert_idx in expert_hit" in line
    assert not (tmp_path / "d.onnx").exists()
