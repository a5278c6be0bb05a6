"""The tensors of a bundle, in the order shards store them, each loadable on its own.

A `TensorEntry` is one bundle tensor: a dense tensor under its library name, or one expert's
slice of a per-expert parameter under `<container>.<e>.<param>` (see `moe_adapter`). Entries
run in library-name order and, within a fused experts tensor, in expert order, so that feeding
them in order to `StateHash` gives `state_dict_sha256` of the library's state dict, and the
library tensors can be rebuilt by concatenating consecutive entries. `load()` returns the tensor
(from memory, or read from a checkpoint by its `recipe`, which `--weights reference` stores).
"""
from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Callable

import torch


@dataclass(frozen=True)
class TensorEntry:
    name: str                      # bundle name
    library: str                   # library state-dict name this tensor is (a slice of)
    library_shape: tuple           # full shape of the library tensor
    starts_library: bool           # first slice of its library tensor (or the whole tensor)
    shape: tuple                   # shape of this bundle tensor
    dtype: torch.dtype
    load: Callable[[], torch.Tensor]
    recipe: dict | None = None  # how to read it from the checkpoint (checkpoint sources only)


def expert_params(containers: list) -> dict:
    """library name of a fused per-expert parameter -> (container, param name)."""
    return {f"{c.path}.{p}": (c, p) for c in containers if c.kind != "tiny_moe" for p, _ in c.params}


def per_expert_rows(shape: tuple, count: int) -> int:
    """Rows of the first dimension that one expert owns: 1 for [E, ...], r for DBRX's [E * r, ...]."""
    if shape[0] % count:
        raise ValueError(f"expert tensor of shape {tuple(shape)} does not split into {count} experts")
    return shape[0] // count


def expert_shape(shape: tuple, count: int) -> tuple:
    """Shape of one expert's slice: [E, a, b] -> [a, b]; [E * r, D] -> [r, D]."""
    return tuple(shape[1:]) if shape[0] == count else (per_expert_rows(shape, count), *shape[1:])


def entries_from_state(state: dict, containers: list) -> list:
    """Entries over an in-memory library state dict (per-expert parameters cut as `split_expert_state`)."""
    fused = expert_params(containers)
    out = []
    for name in sorted(state):
        t = state[name]
        shape = tuple(t.shape)
        if name not in fused:
            out.append(TensorEntry(name, name, shape, True, shape, t.dtype, (lambda t=t: t)))
            continue
        c, p = fused[name]
        rows = per_expert_rows(shape, c.num_experts)
        for e in range(c.num_experts):
            piece = (lambda t=t, e=e, rows=rows: t[e * rows:(e + 1) * rows].reshape(expert_shape(t.shape, len(t) // rows)))
            out.append(TensorEntry(f"{c.path}.{e}.{p}", name, shape, e == 0, expert_shape(shape, c.num_experts), t.dtype,
                                   piece))
    return out
