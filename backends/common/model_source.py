"""Which runtime family a model belongs to, and the model files a bundle ships with it.

The runtime implements TinyMoE-family models (moeplan's reference architecture): a model
directory whose config.json says `"model_type": "tiny_moe"` and names its loader file
(`"moeplan_loader": "model.py:load"`). The bundle ships that config and that source file, so
`moeplan run --verify` can rebuild the source model without the original directory. Hugging Face
Mixtral and Qwen2-MoE directories run too (`hf_moe`); their bundle ships the config, and
verification rebuilds the model with transformers.
"""
from __future__ import annotations

import json
from pathlib import Path

from moeplan.planner.errors import UserError

SUPPORTED = ("tiny_moe",)
HF_SUPPORTED = ("mixtral", "qwen2_moe")
CHECKPOINT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def model_files(model_spec: str) -> tuple:
    """(architecture, {bundle path: bytes}) for a model spec, or a UserError saying what runs."""
    path = Path(model_spec)
    config_path = path / "config.json" if path.is_dir() else path
    hint = ("the torchrun target runs TinyMoE-family models (config.json with \"model_type\": \"tiny_moe\" "
            "and a \"moeplan_loader\", see examples/tiny_moe) and Hugging Face Mixtral / Qwen2-MoE directories")
    if not config_path.is_file() or config_path.name != "config.json":
        raise UserError(f"cannot compile '{model_spec}' for torchrun; {hint}")
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        where = f" (line {exc.lineno}, column {exc.colno}: {exc.msg})" if isinstance(exc, json.JSONDecodeError) else ""
        raise UserError(f"{config_path} is not valid JSON{where}; fix the file") from None
    if not isinstance(config, dict):
        raise UserError(f"{config_path} must hold a JSON object; fix the file")
    arch = config.get("model_type")
    if arch in HF_SUPPORTED:
        return "hf_moe", {"model/config.json": config_path.read_bytes()}
    loader = str(config.get("moeplan_loader", ""))
    if arch not in SUPPORTED or ":" not in loader:
        raise UserError(f"cannot compile '{model_spec}' (model_type {arch!r}) for torchrun; {hint}")
    source = config_path.parent / loader.split(":", 1)[0]
    if not source.is_file():
        raise UserError(f"model source '{source}' named by moeplan_loader in {config_path} does not exist")
    if not any(p.suffix in CHECKPOINT_SUFFIXES for p in config_path.parent.iterdir() if p.is_file()):
        raise UserError(f"model directory '{config_path.parent}' holds no checkpoint ({', '.join(CHECKPOINT_SUFFIXES)}): "
                        "its loader would build random weights and the bundle would not be reproducible; "
                        "train or copy the weights there first")
    return arch, {"model/config.json": config_path.read_bytes(), "model/model.py": source.read_bytes()}
