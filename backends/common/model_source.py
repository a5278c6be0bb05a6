"""Which runtime a model runs under, the model files a bundle ships with it, and the pinned library.

* `tiny_moe`: a moeplan model directory (config.json with `"model_type": "tiny_moe"` and a
  `"moeplan_loader"`); the bundle ships that config and the source file it names.
* `transformers`: a Hugging Face model directory whose config names a causal-LM class that
  transformers builds and that has an MoE block the runtime's adapter recognises; the bundle ships
  config.json and, where the directory has them, the files the serving front reads text with
  (tokenizer.json, tokenizer_config.json and chat_template.jinja for the chat template,
  generation_config.json for the end-of-sequence ids), and the plan and the bundle's
  requirements.txt pin the transformers version it was compiled with.
Both are rebuilt by `moeplan run --verify` from the bundle alone.

`MODEL_FILES` is the pass that finds them (`model_spec` -> `model_files`: {"architecture": runtime
family, "files": {bundle path: bytes}}; only codegen needs it, so `moeplan plan` never asks for it),
and `needs_weights` the precondition of every codegen pass.
"""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

from moeplan.core.errors import UserError
from moeplan.core.library_pins import library_pins
from moeplan.core.pass_manager import Pass

SUPPORTED = ("tiny_moe",)
TOKENIZER = "tokenizer.json"
SERVER_PACKAGES = ("starlette", "uvicorn")
TEXT_FILES = (TOKENIZER, "tokenizer_config.json", "chat_template.jinja", "generation_config.json")
CHECKPOINT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def _hint() -> str:
    return ("the torchrun target runs moeplan model directories (config.json with \"model_type\": \"tiny_moe\" and a "
            "\"moeplan_loader\", see examples/tiny_moe) and Hugging Face MoE model directories (config.json + weights); "
            "a Hugging Face config file alone plans ('moeplan plan')")


def model_files(model_spec: str) -> tuple:
    """(architecture, {bundle path: bytes}) for a model spec, or a UserError saying what runs."""
    path = Path(model_spec).expanduser()
    if not path.exists():  # missing, not unsupported: say so before naming what runs
        raise UserError(f"model '{model_spec}' not found: no such file or directory; give the model's directory "
                        "(config.json and its weights)")
    config_path = path / "config.json" if path.is_dir() else path
    if path.is_dir() and not config_path.is_file():
        raise UserError(f"model directory '{model_spec}' has no config.json; give the model's directory (config.json "
                        "and its weights)")
    if not config_path.is_file() or config_path.suffix != ".json":  # a directory, or a config file alone
        raise UserError(f"cannot compile '{model_spec}' for torchrun; {_hint()}")
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        where = f" (line {exc.lineno}, column {exc.colno}: {exc.msg})" if isinstance(exc, json.JSONDecodeError) else ""
        raise UserError(f"{config_path} is not valid JSON{where}; fix the file") from None
    if not isinstance(config, dict):
        raise UserError(f"{config_path} must hold a JSON object; fix the file")
    arch = config.get("model_type")
    loader = str(config.get("moeplan_loader", ""))
    if arch in SUPPORTED and ":" in loader:
        source = config_path.parent / loader.split(":", 1)[0]
        if not source.is_file():
            raise UserError(f"model source '{source}' named by moeplan_loader in {config_path} does not exist")
        if not any(p.suffix in CHECKPOINT_SUFFIXES for p in config_path.parent.iterdir() if p.is_file()):
            raise UserError(f"model directory '{config_path.parent}' holds no checkpoint ({', '.join(CHECKPOINT_SUFFIXES)}): "
                            "its loader would build random weights and the bundle would not be reproducible; "
                            "train or copy the weights there first")
        return arch, {"model/config.json": config_path.read_bytes(), "model/model.py": source.read_bytes()}
    files = {"model/config.json": config_path.read_bytes()}
    for name in TEXT_FILES:
        if (config_path.parent / name).is_file():
            files[f"model/{name}"] = (config_path.parent / name).read_bytes()
    expert_containers("transformers", files, spec=model_spec)  # fails here, with the reason, if it cannot run
    return "transformers", files


def expert_containers(arch: str, files: dict, spec: str | None = None) -> list:
    """The runtime's view of where each MoE layer's experts live, from the bundle's model files."""
    from moeplan.runtime.model.library_model import ModelError, decoder_layers
    from moeplan.runtime.model.moe_adapter import find_containers

    try:
        prefix, layers = decoder_layers(bundle_model(arch, files, spec))
    except ModelError as exc:
        raise UserError(f"cannot compile '{spec}' for torchrun: {exc}") from None
    return find_containers(layers, prefix)


def bundle_model(arch: str, files: dict, spec: str | None = None):
    """The library's model built from a bundle's model files (transformers: on the meta device)."""
    from moeplan.runtime.model.library_model import build_tiny_moe

    with tempfile.TemporaryDirectory() as tmp:
        for rel, data in files.items():
            (Path(tmp) / Path(rel).name).write_bytes(data)
        if arch == "tiny_moe":
            return build_tiny_moe(Path(tmp) / "config.json", Path(tmp) / "model.py")
        return _build_meta(Path(tmp), spec)


def _build_meta(config_dir: Path, spec):
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise UserError("Hugging Face models need transformers: pip install 'moeplan[hf]'") from None
    from moeplan.runtime.model.library_model import build_transformers

    try:
        return build_transformers(config_dir, device="meta")
    except (ValueError, KeyError, TypeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(f"cannot compile '{spec}' for torchrun: transformers cannot build its model ({first}); {_hint()}") from None


def requirements(arch: str) -> str:
    """requirements.txt of a torchrun bundle: what its runtime imports, with the model library
    pinned: numpy for the replica rule (runtime/ep/expert_table.py) and the expert cache's policy
    modules, and the HTTP server rank 0 runs with `--serve` (runtime/serving/http_server.py)."""
    import importlib.metadata

    import numpy
    import safetensors
    import torch

    lines = [f"torch=={torch.__version__.split('+')[0]}", f"safetensors=={safetensors.__version__}",
             f"numpy=={numpy.__version__}"]
    lines += [f"{name}=={importlib.metadata.version(name)}" for name in SERVER_PACKAGES]
    lines += [f"{name}=={version}" for name, version in sorted(library_pins(arch).items())]
    return "\n".join(lines) + "\n"


def _model_files(facts):
    arch, files = model_files(facts["model_spec"])
    return {"model_files": {"architecture": arch, "files": files}}


def needs_weights(facts) -> None:
    """Precondition of codegen: a bundle ships weights, so a config-only (meta) model cannot compile."""
    if facts["model"].module is None or not facts["model"].has_weights:
        raise UserError(f"model '{facts['model_spec']}' has no weights to ship; compiling a bundle needs a runnable model "
                        "('moeplan plan' plans it without weights)")


MODEL_FILES = Pass("runtime", ("model_spec",), ("model_files",), _model_files)
