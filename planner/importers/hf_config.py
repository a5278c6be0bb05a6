"""Hugging Face configs -> models: full-size on the `meta` device, or with weights from a directory.

A config alone is enough to plan: the architecture's own transformers class is built under
`torch.device("meta")`, so every parameter has its real shape and dtype but no storage, and a
671B-parameter model costs nothing. Nothing here touches the network: the hub is switched off and
configs that ask for remote code (`auto_map`) are built with transformers' own class for their
`model_type`. Quantisation settings are dropped: the model is planned at the config's `dtype`.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional, Sequence

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from moeplan.planner.errors import UserError  # noqa: E402
from moeplan.planner.importers import LoadedModel  # noqa: E402
from moeplan.planner.importers.torch_module import import_module  # noqa: E402

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


def model_dtype(data: dict, source: str):
    """The torch dtype the config asks for (`dtype`, or the older `torch_dtype`); float32 if none."""
    import torch

    name = data.get("dtype") or data.get("torch_dtype") or "float32"
    dtype = getattr(torch, str(name).replace("torch.", ""), None)
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
    try:
        return CONFIG_MAPPING[model_type].from_dict(clean)
    except Exception as exc:  # transformers validates configs with many exception types
        raise UserError(f"{source}: invalid {model_type} config: {_one_line(exc)}; fix the value named") from None


# Sizes no real model reaches; larger values in a config are corruption, refused before building.
SIZE_LIMITS = {"num_hidden_layers": 4096, "n_layer": 4096, "num_layers": 4096, "num_local_experts": 1 << 16,
               "num_experts": 1 << 16, "n_routed_experts": 1 << 16, "num_experts_per_tok": 1 << 16,
               "num_attention_heads": 1 << 16, "num_key_value_heads": 1 << 16}


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:300]}"


def _auto_class(config):
    """AutoModelForCausalLM where the architecture has an LM head, else the bare AutoModel."""
    from transformers import AutoModel, AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return AutoModelForCausalLM if config.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES else AutoModel


def _skip_weight_init():
    """Meta tensors have no values to initialise; skipping the init calls saves ~0.3 s at 671B."""
    import contextlib

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
                return _auto_class(config).from_config(config, dtype=dtype)
        return _auto_class(config).from_config(config, dtype=dtype)
    except UserError:
        raise
    except Exception as exc:
        raise UserError(f"cannot build a {config.model_type} model from its config: {_one_line(exc)}") from None


def model_name(data: dict, config_path: Path) -> str:
    if data.get("_name_or_path"):
        return str(data["_name_or_path"])
    return config_path.parent.name if config_path.stem == "config" else config_path.stem


def load_config_file(config_path: Path, data: dict) -> LoadedModel:
    """A config.json alone: the full-size model on `meta`, imported with no weights."""
    dtype = model_dtype(data, str(config_path))
    config = make_config(data, str(config_path))
    module = build_model(config, dtype, meta=True)
    ir = import_module(module, name=model_name(data, config_path), config=config, source_format="hf-config")
    return LoadedModel(ir=ir, module=module, has_weights=False)


def _weight_files(directory: Path) -> list:
    """The checkpoint files transformers would load from `directory` (safetensors or torch .bin)."""
    return sorted(directory.glob("*.safetensors")) + sorted(directory.glob("pytorch_model*.bin"))


def load_directory(directory: Path, data: dict, weights: Optional[Sequence[Path]] = None) -> LoadedModel:
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
        try:
            module = _auto_class(config).from_pretrained(
                str(directory), config=config, dtype=dtype, local_files_only=True, trust_remote_code=False
            )
        except Exception as exc:
            raise UserError(f"cannot load the weights in {directory}: {_one_line(exc)}") from None
    else:
        from moeplan.planner.importers.checkpoint import load_state_into

        module = build_model(config, dtype, meta=False)
        for path in weights:
            load_state_into(module, path, strict=len(weights) == 1)
    module.eval()
    ir = import_module(module, name=model_name(data, config_path), config=config, source_format="hf")
    return LoadedModel(ir=ir, module=module, has_weights=True)
