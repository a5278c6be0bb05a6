"""Export a torch MoE model to ONNX, so its ONNX form can be imported, traced and compared.

The export uses the dynamo exporter (`torch.onnx.export(..., dynamo=True)`) because it records
each node's module path and class hierarchy in `metadata_props`, which is what lets the ONNX
importer give stages the same names as the torch importer. Batch and sequence axes are dynamic.
The graph optimizer is left off: it renames transposed weights and merges identical
initializers (two untrained norms, say), both of which would hide which parameter belongs where.

Model-level metadata (`moeplan.name`, `moeplan.architecture`) carries the model's name and
class, so an imported ONNX file is named like the torch model it came from; `moeplan.buffers`
lists the initializers that were buffers (rotary `inv_freq`, DeepSeek's score-correction bias),
which torch does not count as parameters and neither does the importer.

Hugging Face models are exported as transformers 5 lets torch capture them (`_export_ready`):
no KV cache (`config.use_cache = False`; a `DynamicCache` output is no tensor torch.onnx can
write) and the `batched_mm` experts implementation (a batched matmul over every token's top-k
experts' weights, gathered by index) instead of the default `grouped_mm`, whose custom op
`transformers::grouped_mm_fallback` has no ONNX translation. Both are restored afterwards.
Code torch cannot capture although its arithmetic is plain (DBRX's loop over the experts hit,
complex-valued rotary embeddings) is replaced during the export by the same arithmetic in a
capturable form (`onnx_export_equivalents.py`). Architectures that still fail say why in one
untruncated line (the list measured with transformers 5.23 is in
`benchmarks/import_fidelity.py`'s docstring).
"""
from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import re
import warnings
from pathlib import Path

from moeplan.core.atomic import atomic_path
from moeplan.core.errors import UserError
from moeplan.planner.onnx_export_equivalents import export_equivalents

INPUT_NAME = "input_ids"
OUTPUT_NAME = "logits"
NAME_KEY = "moeplan.name"
ARCHITECTURE_KEY = "moeplan.architecture"
BUFFERS_KEY = "moeplan.buffers"  # initializers that were module buffers, not parameters (JSON list)
EXAMPLE_SHAPE = (2, 8)
QUIET_LOGGERS = ("torch.onnx", "torch.export", "torch._export", "torch._dynamo", "torch.fx")


def _max_positions(module) -> int | None:
    config = getattr(module, "config", None)
    for attr in ("max_positions", "max_position_embeddings"):
        value = config.get(attr) if isinstance(config, dict) else getattr(config, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


@contextlib.contextmanager
def _redirect_both(sink):
    with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
        yield


@contextlib.contextmanager
def _quiet_loggers(quiet: bool):
    """Silence torch.onnx's registry chatter (e.g. "torchvision is not installed") and torch.export's
    dump of the whole captured graph on failure (the error itself is reported in one line)."""
    loggers = [logging.getLogger(name) for name in QUIET_LOGGERS]
    levels = [logger.level for logger in loggers]
    if quiet:
        for logger in loggers:
            logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


EXPORT_EXPERTS = "batched_mm"


@contextlib.contextmanager
def _export_ready(module):
    """A transformers model set up for capture (no cache, batched_mm experts), restored after."""
    config = getattr(module, "config", None)
    saved_cache = getattr(config, "use_cache", None)
    saved_experts = getattr(config, "_experts_implementation", None)
    can_set = getattr(module, "_can_set_experts_implementation", None)
    switch = callable(can_set) and hasattr(module, "set_experts_implementation") and can_set()
    try:
        if saved_cache is not None:
            config.use_cache = False
        if switch:
            module.set_experts_implementation(EXPORT_EXPERTS)
        yield
    finally:
        if saved_cache is not None:
            config.use_cache = saved_cache
        if switch and saved_experts is not None:
            module.set_experts_implementation(saved_experts)


def _export_program(module, example):
    """torch.export with dynamic batch and sequence (sequence capped by learned positions)."""
    import torch

    seq_max = _max_positions(module)
    batch = torch.export.Dim("batch", min=1)
    seq = torch.export.Dim("sequence", min=1, max=seq_max) if seq_max else torch.export.Dim("sequence", min=1)
    return torch.export.export(
        module, (example,), dynamic_shapes=({0: batch, 1: seq},), strict=False
    )


ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _paragraph(exc: BaseException) -> str:
    """The first paragraph of an exception's message on one line, colour codes removed."""
    text = ANSI.sub("", str(exc)).strip()
    return " ".join(text.split("\n\n", 1)[0].split())


def _reason(exc: BaseException) -> str:
    """The exporter's explanation on one line, whole: the first paragraph of the error and of its
    root cause (torch.onnx wraps the real failure, e.g. an operator with no ONNX translation),
    plus the model source line it last reached. torch appends the captured graph (thousands of
    lines) after a blank line; that dump is left out, the explanation never cut."""
    parts = [f"{type(exc).__name__}: {_paragraph(exc)}"]
    root = exc
    while root.__cause__ is not None or (root.__context__ is not None and not root.__suppress_context__):
        root = root.__cause__ or root.__context__
    if root is not exc:
        parts.append(f"caused by {type(root).__name__}: {_paragraph(root)}")
    lines = ANSI.sub("", str(exc)).splitlines()
    for i, line in enumerate(lines):
        if line.strip() == "The following call raised this error:" and i + 2 < len(lines):
            parts.append(f"at {lines[i + 1].strip()}: {lines[i + 2].strip()}")
            break
    return "; ".join(parts)


def export_onnx(module, out: str | os.PathLike, *, name: str, opset: int = 18, quiet: bool = True) -> Path:
    """Write `module` (token ids [B, S] -> logits) to `out` as one self-contained ONNX file.

    Raises UserError when torch cannot capture the model as a static graph.
    """
    import onnx
    import torch

    module = module.eval()
    example = torch.zeros(EXAMPLE_SHAPE, dtype=torch.long)
    sink = io.StringIO()
    quiet_ctx = _redirect_both(sink) if quiet else contextlib.nullcontext()
    with torch.no_grad(), warnings.catch_warnings(), quiet_ctx, _quiet_loggers(quiet):
        warnings.simplefilter("ignore")
        try:
            with _export_ready(module), export_equivalents(module):
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
            reason = _reason(exc)
            raise UserError(
                f"cannot export {name} to ONNX: torch.export must capture its forward and torch.onnx "
                f"translate every operator, and here one failed ({reason})"
            ) from None
    proto = onnx_program.model_proto
    written = next((i.version for i in proto.opset_import if i.domain in ("", "ai.onnx")), None)
    if written != opset:  # torch falls back to its own opset when it cannot convert; refuse, not mislabel
        raise UserError(f"torch could not export {name} at opset {opset} (it produced opset {written}); "
                        f"use --opset {written}")
    initializers = {t.name for t in proto.graph.initializer}
    buffers = json.dumps(sorted(n for n, _ in module.named_buffers() if n in initializers))
    for key, value in ((NAME_KEY, name), (ARCHITECTURE_KEY, type(module).__name__), (BUFFERS_KEY, buffers)):
        entry = next((p for p in proto.metadata_props if p.key == key), None) or proto.metadata_props.add()
        entry.key, entry.value = key, value
    out = Path(out)
    with atomic_path(out, kind="onnx") as tmp:
        onnx.save_model(proto, str(tmp), save_as_external_data=False)
    return out
