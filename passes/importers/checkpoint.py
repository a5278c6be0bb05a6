"""Weights files (`.safetensors`, `.pt`) -> state dicts loaded into a model, with one-line errors."""
from __future__ import annotations

from pathlib import Path

from moeplan.core.errors import UserError

CHECKPOINT_SUFFIXES = (".safetensors", ".pt", ".pth", ".bin")


def read_state_dict(path: Path) -> dict:
    """Tensors by name from a safetensors file or a torch-saved state dict (weights only, no code)."""
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            return load_file(str(path))
        import torch

        state = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as exc:
        raise UserError(
            f"cannot read checkpoint {path}: {type(exc).__name__}: {' '.join(str(exc).split())[:200]}; "
            "give a .safetensors file or a torch-saved state dict"
        ) from None
    for key in ("state_dict", "model"):  # common wrappers around the state dict itself
        if isinstance(state, dict) and isinstance(state.get(key), dict):
            state = state[key]
    if not isinstance(state, dict):
        raise UserError(f"checkpoint {path} holds a {type(state).__name__}, not a state dict of tensors")
    return state


def load_state_into(module, path: Path, *, strict: bool = True) -> None:
    """Copy the checkpoint's tensors into `module`; names or shapes that disagree are a UserError.

    `strict=False` is for one shard of several: missing names are allowed, unknown ones are not.
    """
    state = read_state_dict(path)
    try:
        result = module.load_state_dict(state, strict=strict)
    except RuntimeError as exc:
        first = " ".join(str(exc).split())[:300]
        raise UserError(f"checkpoint {path} does not fit the model in {path.parent}: {first}") from None
    if result.unexpected_keys:
        raise UserError(
            f"checkpoint {path} does not fit the model in {path.parent}: unknown tensors "
            f"{', '.join(result.unexpected_keys[:3])}"
        )
