"""`moeplan export-onnx MODEL --out model.onnx`: write a torch MoE model as an ONNX graph.

The ONNX file imports to the same IR as MODEL (`moeplan inspect model.onnx`) and traces through
onnxruntime (`moeplan trace model.onnx ...`), so a deployment can be planned from either form.
"""
from __future__ import annotations

from pathlib import Path

import click

from moeplan.core import cli_types as T
from moeplan.core.errors import UserError


@click.command("export-onnx")
@click.argument("model")
@click.option("--out", "out", required=True, type=click.Path(path_type=Path), help="ONNX file to write (.onnx).")
@click.option("--opset", type=T.ONNX_OPSET, default=18, show_default=True, help="ONNX opset version.")
@click.option("--quiet", is_flag=True, help="No summary line.")
def export_onnx_cmd(model, out, opset, quiet):
    """Export MODEL (a torch MoE model with weights) to ONNX with dynamic batch and sequence axes."""
    from moeplan.passes.importers import load_model
    from moeplan.planner.onnx_export import export_onnx

    loaded = load_model(model)
    if loaded.module is None:
        raise UserError(f"{model} is already an ONNX model; export-onnx takes a torch model")
    if not loaded.has_weights:
        raise UserError(
            f"{model} was built from a config alone and has no weights; give a directory or checkpoint with weights"
        )
    written = export_onnx(loaded.module, out, name=loaded.ir.name, opset=opset)
    if not quiet:
        size = written.stat().st_size / 2**20
        click.echo(f"wrote {written} ({size:.1f} MiB, opset {opset}, {len(loaded.ir.moe_stages)} MoE layers)")
