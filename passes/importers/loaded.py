"""What an importer returns: the IR of a model and what can run it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from moeplan.core.ir import ModelIR


@dataclass
class LoadedModel:
    """The IR plus what can execute the model: an `nn.Module` (maybe on meta) or an ONNX path."""

    ir: ModelIR
    module: Any | None = None  # torch.nn.Module
    onnx_path: str | None = None
    has_weights: bool = True  # False for meta-device models built from a config alone
    notes: tuple = ()  # what the import left out or assumed, one sentence each (shown by `inspect`)
