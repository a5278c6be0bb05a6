"""Hugging Face configs -> models: full-size on the `meta` device, or with weights from a directory.

A config alone is enough to plan: the architecture's own transformers class is built under
`torch.device("meta")`, so every parameter has its real shape and dtype but no storage, and a
671B-parameter model costs nothing. Nothing here touches the network: the hub is switched off and
configs that ask for remote code (`auto_map`) are built with transformers' own class for their
`model_type`. A `quantization_config` (MXFP4, FP8, GPTQ/AWQ) or a float8 `dtype` sets the bytes
each weight is stored in (`quantization.py`); the model itself is built at its compute dtype.
A multimodal config is planned as its text model, with a note on what is left out.
"""
from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path
from collections.abc import Sequence

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from moeplan.core.errors import UserError
from moeplan.passes.importers.checkpoint import load_state_into
from moeplan.passes.importers.loaded import LoadedModel
from moeplan.passes.importers.quantization import FLOAT8_DTYPES, checkpoint_storage
from moeplan.passes.importers.torch_module import import_module

IGNORED_KEYS = ("auto_map", "quantization_config")


def _transformers():
    try:
        import transformers
    except ImportError:
        raise UserError(
            "Hugging Face models need the transformers package; install it with "
            "`pip install 'moeplan[hf]'`"
        ) from None
    return transformers


def dtype_name(data: dict) -> str:
    """The dtype the config names (`dtype`, or the older `torch_dtype`); float32 if none."""
    return str(data.get("dtype") or data.get("torch_dtype") or "float32").replace("torch.", "")


def model_dtype(data: dict, source: str):
    """The torch dtype to build the model in: the config's, but bfloat16 for a float8 dtype.

    torch has no float8 storage on `meta` ("couldn't find storage object Float8_e4m3fnStorage");
    a float8 checkpoint computes in bfloat16 and is charged its 1-byte storage separately.
    """
    import torch

    name = dtype_name(data)
    if name in FLOAT8_DTYPES:
        return torch.bfloat16
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise UserError(f"{source}: unknown dtype {name!r}; use e.g. \"bfloat16\", \"float16\" or \"float32\"")
    return dtype


def make_config(data: dict, source: str):
    """A transformers config object from config.json contents; UserError for what a user can fix."""
    _transformers()
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    model_type = data.get("model_type")
    if not model_type:
        raise UserError(
            f"{source} has no \"model_type\"; a Hugging Face config names its architecture there "
            "(e.g. \"mixtral\"), a moeplan model directory names its loader in \"moeplan_loader\""
        )
    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
        import transformers

        raise UserError(
            f"{source}: unknown model_type {model_type!r} (transformers {transformers.__version__} "
            "does not know it); use a supported architecture or give the model as package.module:factory"
        )
    clean = {k: v for k, v in data.items() if k not in IGNORED_KEYS}
    for key, limit in SIZE_LIMITS.items():  # before building: 1e9 layers would hang, not fail
        value = clean.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and not 0 <= value <= limit:
            raise UserError(f"{source}: {key} is {value}, outside 0..{limit}; fix the value")
    coerced: set = set()
    while True:
        try:
            return CONFIG_MAPPING[model_type].from_dict(clean)
        except Exception as exc:  # transformers validates configs with many exception types
            field = _int_for_float(exc)
            if field is None or field in coerced or not _coerce_to_float(clean, field):
                raise UserError(
                    f"{source}: invalid {model_type} config: {_one_line(exc)}; fix the value named"
                ) from None
            coerced.add(field)


INT_FOR_FLOAT = re.compile(r"Field '(\w+)' expected float, got int")


def _int_for_float(exc: BaseException):
    """The field a strict transformers config rejects for being `1` where it wants `1.0`, if so."""
    match = INT_FOR_FLOAT.search(str(exc))
    return match.group(1) if match else None


def _coerce_to_float(data, key: str) -> bool:
    """Make every int `key` in `data` (nested dicts included) a float; published configs write
    `1` for float fields (DBRX's `moe_normalize_expert_weights`), which is the same number."""
    changed = False
    if isinstance(data, dict):
        for k, v in data.items():
            if k == key and isinstance(v, int) and not isinstance(v, bool):
                data[k] = float(v)
                changed = True
            elif isinstance(v, dict):
                data[k] = dict(v)
                changed = _coerce_to_float(data[k], key) or changed
    return changed


# Sizes no real model reaches; larger values in a config are corruption, refused before building.
SIZE_LIMITS = {"num_hidden_layers": 4096, "n_layer": 4096, "num_layers": 4096, "num_local_experts": 1 << 16,
               "num_experts": 1 << 16, "n_routed_experts": 1 << 16, "num_experts_per_tok": 1 << 16,
               "num_attention_heads": 1 << 16, "num_key_value_heads": 1 << 16}


def _one_line(exc: BaseException) -> str:
    """The whole message on one line: cutting it would hide the part that says what to fix."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}"


def _auto_class(config):
    """AutoModelForCausalLM where the architecture has an LM head, else the bare AutoModel."""
    from transformers import AutoModel, AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return AutoModelForCausalLM if config.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES else AutoModel


def _skip_weight_init():
    """Meta tensors have no values to initialise; skipping the init calls saves ~0.3 s at 671B."""
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # an older or newer transformers without it: initialise, only slower
        return contextlib.nullcontext()
    return no_init_weights()


def build_model(config, dtype, *, meta: bool):
    """The transformers model for `config`, on `meta` (no storage) or on the CPU (random weights)."""
    import torch

    try:
        if meta:
            with torch.device("meta"), _skip_weight_init():
                module = _auto_class(config).from_config(config, dtype=dtype)
            # Skipping init skips tying too: tie the head to the embedding as loading would.
            module.tie_weights()
            return module
        return _auto_class(config).from_config(config, dtype=dtype)
    except UserError:
        raise
    except Exception as exc:
        raise UserError(f"cannot build a {config.model_type} model from its config: {_one_line(exc)}") from None


def model_name(data: dict, config_path: Path) -> str:
    if data.get("_name_or_path"):
        return str(data["_name_or_path"])
    return config_path.parent.name if config_path.stem == "config" else config_path.stem


def _count(module) -> int:
    return sum(p.numel() for p in module.parameters())


def multimodal_notes(config, module) -> tuple:
    """What of a multimodal config the built text model leaves out, with its parameter count.

    transformers' causal-LM class for a composite config (Llama 4: `text_config` +
    `vision_config`) is the text model alone; the vision tower and projector are not planned.
    """
    parts = [k for k in (getattr(config, "sub_configs", None) or {}) if k != "text_config"
             and getattr(config, k, None) is not None]
    if not parts or type(module.config) is type(config):
        return ()
    import torch
    from transformers import AutoModel

    try:
        with torch.device("meta"), _skip_weight_init():
            full = AutoModel.from_config(config)
        dropped = f"{_count(full) - _count(module):,} parameters"
    except Exception:  # a composite class transformers cannot build alone: say what, without a count
        dropped = "parameters not counted"
    return (
        f"multimodal model: moeplan plans its text model ({type(module).__name__}); "
        f"{', '.join(p.replace('_config', '') for p in parts)} parts ({dropped}) are left out",
    )


def load_config_file(config_path: Path, data: dict) -> LoadedModel:
    """A config.json alone: the full-size model on `meta`, imported with no weights."""
    dtype = model_dtype(data, str(config_path))
    config = make_config(data, str(config_path))
    module = build_model(config, dtype, meta=True)
    storage, notes = checkpoint_storage(data, dtype_name(data), str(config_path))
    ir = import_module(module, name=model_name(data, config_path), config=config, source_format="hf-config",
                       storage=storage)
    notes += multimodal_notes(config, module)
    return LoadedModel(ir=ir, module=module, has_weights=False, notes=notes)


def _weight_files(directory: Path) -> list:
    """The checkpoint files transformers would load from `directory` (safetensors or torch .bin)."""
    return sorted(directory.glob("*.safetensors")) + sorted(directory.glob("pytorch_model*.bin"))


def load_directory(directory: Path, data: dict, weights: Sequence[Path] | None = None) -> LoadedModel:
    """A Hugging Face model directory: with safetensors, the model with its weights; else on meta.

    `weights` names checkpoint files to load into a model built from the config (a checkpoint
    given directly); otherwise the directory's own safetensors load through transformers, which
    knows each architecture's checkpoint layout (sharding, per-expert tensor names).
    """
    config_path = directory / "config.json"
    if weights is None and not _weight_files(directory):
        return load_config_file(config_path, data)
    dtype = model_dtype(data, str(config_path))
    config = make_config(data, str(config_path))
    if weights is None:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # "Loading weights: 19/19" on stderr is no part of a command's output
        try:
            module = _auto_class(config).from_pretrained(
                str(directory), config=config, dtype=dtype, local_files_only=True, trust_remote_code=False
            )
        except Exception as exc:
            raise UserError(f"cannot load the weights in {directory}: {_one_line(exc)}") from None
    else:
        module = build_model(config, dtype, meta=False)
        for path in weights:
            load_state_into(module, path, strict=len(weights) == 1)
    module.eval()
    storage, notes = checkpoint_storage(data, dtype_name(data), str(config_path))
    ir = import_module(module, name=model_name(data, config_path), config=config, source_format="hf",
                       storage=storage)
    return LoadedModel(ir=ir, module=module, has_weights=True, notes=notes + multimodal_notes(config, module))
