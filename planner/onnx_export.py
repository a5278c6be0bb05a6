"""Export a torch MoE model to ONNX, so its ONNX form can be imported, traced and compared.

The export uses the dynamo exporter (`torch.onnx.export(..., dynamo=True)`) because it records
each node's module path and class hierarchy in `metadata_props`, which is what lets the ONNX
importer give stages the same names as the torch importer. Batch and sequence axes are dynamic.
The graph optimizer is left off: it renames transposed weights and merges identical
initializers (two untrained norms, say), both of which would hide which parameter belongs where.

Model-level metadata (`moeplan.name`, `moeplan.architecture`) carries the model's name and
class, so an imported ONNX file is named like the torch model it came from.
"""
from __future__ import annotations

import contextlib
import io
import logging
import os
import warnings
from pathlib import Path

from moeplan.planner.atomic import atomic_path
from moeplan.planner.errors import UserError

INPUT_NAME = "input_ids"
OUTPUT_NAME = "logits"
NAME_KEY = "moeplan.name"
ARCHITECTURE_KEY = "moeplan.architecture"
EXAMPLE_SHAPE = (2, 8)


def _max_positions(module) -> int | None:
    config = getattr(module, "config", None)
    for attr in ("max_positions", "max_position_embeddings"):
        value = config.get(attr) if isinstance(config, dict) else getattr(config, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


@contextlib.contextmanager
def _quiet_loggers(quiet: bool):
    """Silence torch.onnx's registry chatter (e.g. "torchvision is not installed") while exporting."""
    logger = logging.getLogger("torch.onnx")
    level = logger.level
    if quiet:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _export_program(module, example):
    """torch.export with dynamic batch and sequence (sequence capped by learned positions)."""
    import torch

    seq_max = _max_positions(module)
    batch = torch.export.Dim("batch", min=1)
    seq = torch.export.Dim("sequence", min=1, max=seq_max) if seq_max else torch.export.Dim("sequence", min=1)
    return torch.export.export(
        module, (example,), dynamic_shapes=({0: batch, 1: seq},), strict=False
    )


def export_onnx(module, out: str | os.PathLike, *, name: str, opset: int = 18, quiet: bool = True) -> Path:
    """Write `module` (token ids [B, S] -> logits) to `out` as one self-contained ONNX file.

    Raises UserError when torch cannot capture the model as a static graph.
    """
    import onnx
    import torch

    module = module.eval()
    example = torch.zeros(EXAMPLE_SHAPE, dtype=torch.long)
    sink = io.StringIO()
    quiet_ctx = contextlib.redirect_stdout(sink) if quiet else contextlib.nullcontext()
    with torch.no_grad(), warnings.catch_warnings(), quiet_ctx, _quiet_loggers(quiet):
        warnings.simplefilter("ignore")
        try:
            program = _export_program(module, example)
            onnx_program = torch.onnx.export(
                program,
                (example,),
                dynamo=True,
                input_names=[INPUT_NAME],
                output_names=[OUTPUT_NAME],
                opset_version=opset,
                optimize=False,
                verbose=False,
            )
        except Exception as exc:  # torch raises many types; all mean "cannot capture this model"
            first = " ".join(str(exc).split())[:200]
            raise UserError(
                f"cannot export {name} to ONNX ({type(exc).__name__}: {first}); "
                "the model's forward must be capturable by torch.export"
            ) from None
    proto = onnx_program.model_proto
    written = next((i.version for i in proto.opset_import if i.domain in ("", "ai.onnx")), None)
    if written != opset:  # torch falls back to its own opset when it cannot convert; refuse, not mislabel
        raise UserError(f"torch could not export {name} at opset {opset} (it produced opset {written}); "
                        f"use --opset {written}")
    for key, value in ((NAME_KEY, name), (ARCHITECTURE_KEY, type(module).__name__)):
        entry = next((p for p in proto.metadata_props if p.key == key), None) or proto.metadata_props.add()
        entry.key, entry.value = key, value
    out = Path(out)
    with atomic_path(out, kind="onnx") as tmp:
        onnx.save_model(proto, str(tmp), save_as_external_data=False)
    return out
