"""What kind of model directory a path is, a rule both the importers (passes/importers/) and codegen
(backends/torchrun/codegen.py: which checkpoints are streamed into the shards) apply.

* `read_json_object`: a model config as a JSON object, or a one-line UserError;
* `streamable_directory`: a Hugging Face model directory with safetensors weights (imported on
  `meta`, its checkpoint read tensor by tensor), not a moeplan model directory (`moeplan_loader`).
"""
from __future__ import annotations

import json
from pathlib import Path

from moeplan.core.errors import UserError

LOADER_KEY = "moeplan_loader"  # config.json key naming the loader of a moeplan model directory


def read_json_object(path: Path) -> dict:
    """A JSON object from `path`; unreadable, invalid or non-object files are a UserError."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else type(exc).__name__
        raise UserError(f"cannot read {path}: {reason}; check the path and its permissions") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UserError(
            f"{path} is not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg}); fix the file"
        ) from None
    if not isinstance(data, dict):
        raise UserError(f"{path} holds a JSON {type(data).__name__}, not an object; a model config is an object")
    return data


INDEX = "model.safetensors.index.json"


def has_safetensors(directory: Path) -> bool:
    """A safetensors checkpoint: one or more *.safetensors files, or their index json."""
    return directory.is_dir() and ((directory / INDEX).is_file() or any(directory.glob("*.safetensors")))


def streamable_directory(spec: str) -> Path | None:
    """The directory when `spec` is a Hugging Face model directory with safetensors weights, else None."""
    path = Path(spec).expanduser()
    if not path.is_dir() or not (path / "config.json").is_file() or not has_safetensors(path):
        return None
    data = read_json_object(path / "config.json")
    if LOADER_KEY in data or "model_type" not in data:
        return None
    return path
