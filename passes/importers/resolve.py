"""`load_model(spec)`: whatever a user passes as MODEL -> a `LoadedModel`, or one-line UserError.

Resolution order: an existing path decides by what it is (directory, `.json`, `.onnx`,
checkpoint); otherwise a `package.module:factory` (or `file.py:factory`) spec is imported;
otherwise the model is missing. Heavy imports (torch, transformers, onnx) happen only on the
path that needs them, so `inspect` of a config stays fast.
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.util
import os
import re
import sys
from pathlib import Path

from moeplan.core.errors import UserError
from moeplan.core.model_dirs import LOADER_KEY, read_json_object
from moeplan.passes.importers.checkpoint import CHECKPOINT_SUFFIXES, load_state_into
from moeplan.passes.importers.loaded import LoadedModel
from moeplan.passes.importers.torch_module import import_module

FACTORY_SPEC = re.compile(r"^(?P<target>[\w./\\-]+?):(?P<attr>[A-Za-z_]\w*)$")
USAGE = (
    "give a model directory with config.json, a Hugging Face config.json, an .onnx file, "
    "a .safetensors/.pt checkpoint beside its config.json, or package.module:factory"
)


def load_model(spec) -> LoadedModel:
    """Load MODEL as the CLI accepts it (see `moeplan.passes.importers` for the forms)."""
    text = str(spec)
    path = Path(text).expanduser()
    if path.exists():
        return _load_path(path)
    match = FACTORY_SPEC.match(text)
    if match and not text.endswith((".json", ".onnx", *CHECKPOINT_SUFFIXES)):
        return _load_factory(text, match["target"], match["attr"])
    raise UserError(f"model {text!r} not found: no such file or directory; {USAGE}")


def _load_path(path: Path) -> LoadedModel:
    if path.is_dir():
        config = path / "config.json"
        if not config.is_file():
            raise UserError(f"directory {path} has no config.json; {USAGE}")
        return _load_config(config, read_json_object(config), is_dir_spec=True)
    suffix = path.suffix.lower()
    if suffix == ".json":
        return _load_config(path, read_json_object(path))
    if suffix == ".onnx":
        return _load_onnx(path)
    if suffix in CHECKPOINT_SUFFIXES:
        return _load_checkpoint(path)
    raise UserError(f"{path}: unsupported model file type {suffix or '(none)'!r}; {USAGE}")


def _load_config(config_path: Path, data: dict, is_dir_spec: bool = False) -> LoadedModel:
    """A config.json: moeplan model directory if it names a loader, else a Hugging Face config.

    A Hugging Face config given as a file is built on `meta` even if weights lie beside it (the
    cheap, explicit choice); give the directory to load them.
    """
    if LOADER_KEY in data:
        return _load_moeplan_dir(config_path.parent, data)
    from moeplan.passes.importers.hf_config import load_config_file, load_directory  # switches the hub off: HF only

    if is_dir_spec:
        return load_directory(config_path.parent, data)
    return load_config_file(config_path, data)


def _load_checkpoint(path: Path) -> LoadedModel:
    config = path.parent / "config.json"
    if not config.is_file():
        raise UserError(
            f"checkpoint {path} has no config.json beside it; put the model's config.json "
            "(moeplan loader or Hugging Face config) in the same directory"
        )
    data = read_json_object(config)
    if LOADER_KEY in data:
        return _load_moeplan_dir(path.parent, data, checkpoint=path)
    from moeplan.passes.importers.hf_config import load_directory  # switches the hub off: HF models only

    return load_directory(path.parent, data, weights=[path])


def _load_onnx(path: Path) -> LoadedModel:
    try:
        from moeplan.passes.importers.onnx_graph import import_onnx
    except ModuleNotFoundError as exc:
        if exc.name != "moeplan.passes.importers.onnx_graph":
            raise
        raise UserError("this moeplan build cannot import ONNX models yet; give the torch model instead") from None
    return LoadedModel(ir=import_onnx(str(path)), onnx_path=str(path), has_weights=True)


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"


@contextlib.contextmanager
def _cwd_importable():
    """Like `python -m`: modules in the current directory are importable while loading."""
    cwd = os.getcwd()
    added = cwd not in sys.path
    if added:
        sys.path.insert(0, cwd)
    try:
        yield
    finally:
        if added and cwd in sys.path:
            sys.path.remove(cwd)


def import_file(path: Path):
    """Import a Python file by path under a name unique to that path (no sys.path changes); the
    module is registered first, so dataclasses in it can look it up while it executes."""
    if not path.is_file():
        raise UserError(f"model code {path} not found; check the loader path")
    name = "moeplan_user_" + hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:12]
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[name]
        raise UserError(f"cannot load model code {path}: {_describe(exc)}") from None
    return module


def _callable(module, attr: str, where: str):
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise UserError(f"{where} has no callable {attr!r}; name a function that returns the model")
    return factory


def _as_module(obj, where: str):
    import torch.nn as nn

    if not isinstance(obj, nn.Module):
        raise UserError(f"{where} returned a {type(obj).__name__}, not a torch.nn.Module")
    return obj


def _call(factory, where: str, *args):
    try:
        return factory(*args)
    except UserError:
        raise
    except Exception as exc:
        raise UserError(f"{where} failed: {_describe(exc)}") from None


def _loaded(module, *, name: str, config=None) -> LoadedModel:
    ir = import_module(module, name=name, config=config)
    has_weights = not any(p.is_meta for p in module.parameters())
    return LoadedModel(ir=ir, module=module, has_weights=has_weights)


def _load_factory(spec: str, target: str, attr: str) -> LoadedModel:
    name = spec
    if target.endswith(".py"):
        module = import_file(Path(target).expanduser())
        name = f"{Path(target).stem}:{attr}"
    else:
        with _cwd_importable():
            try:
                module = importlib.import_module(target)
            except ImportError as exc:
                raise UserError(
                    f"cannot import {target!r} for model {spec!r} ({_describe(exc)}); "
                    "check the module name and that it is on PYTHONPATH"
                ) from None
            except Exception as exc:
                raise UserError(f"importing {target!r} failed: {_describe(exc)}") from None
    factory = _callable(module, attr, repr(target))
    return _loaded(_as_module(_call(factory, spec), spec), name=name)


def _load_moeplan_dir(directory: Path, data: dict, checkpoint: Path | None = None) -> LoadedModel:
    """A moeplan model directory: its config names `file.py:function`, called with the directory."""
    loader = data[LOADER_KEY]
    file, sep, attr = str(loader).rpartition(":")
    if not sep or not file or not attr:
        raise UserError(
            f"{directory / 'config.json'}: {LOADER_KEY} must be \"file.py:function\", not {loader!r}"
        )
    where = f"{LOADER_KEY} {loader!r} in {directory}"
    factory = _callable(import_file(directory / file), attr, str(directory / file))
    module = _as_module(_call(factory, where, directory), where)
    if checkpoint is not None:
        load_state_into(module, checkpoint)
        module.eval()
    name = str(data.get("name") or data.get("model_type") or directory.resolve().name)
    return _loaded(module, name=name, config=data)
