"""The K/V a dense Lambda function keeps for one request between its invocations, so that decoding
a token computes only that token (the prefix's keys and values are reused, never recomputed).

Why here and how: one Step Functions execution generates all of a request's tokens, invoking each
dense function once per step and segment. The function's part runs the library's attention on the
new rows only, with the library's own cache (`DynamicCache` for transformers, TinyMoE's per-block
dicts) rebuilt from what earlier steps left:
* in the container's memory (`Store`, LRU within a byte budget): the usual case, since the same
  function is invoked again a few hundred ms later and Lambda keeps its container warm;
* otherwise (a cold or another container, an evicted entry, a retried step) from S3: every
  invocation writes its part's new K/V (the `delta`: the new rows of append-only layers, the whole
  state of others) inside the state file it writes anyway, so durability costs no extra request;
  a miss reads the deltas of the steps it lacks, in order, and is correct whatever the container.
Rows: the batch is left-padded (key mask [B, past + W]), so every step appends W columns.

A layer's state is flat: {name: tensor or JSON scalar}, names like `keys`, `conv_states.0`;
`APPEND` names grow by the step's W rows along dim -2 (full attention K/V), every other tensor is
replaced (sliding windows, recurrent states: bounded). Only torch, transformers' cache classes
(imported when a transformers model asks) and the standard library.
"""
from __future__ import annotations

from collections import OrderedDict

import torch

KV_PREFIX = "kv/"


# --- one layer's cache object <-> a flat dict -----------------------------------------------------
def flatten_layer(layer) -> dict:
    """transformers cache layer -> {name: tensor | scalar}; types it cannot keep raise (no silent loss)."""
    out = {}
    for attr, value in vars(layer).items():
        _flatten_value(attr, value, out)
    return out


def _flatten_value(name: str, value, out: dict) -> None:
    if isinstance(value, torch.Tensor):
        out[name] = value
    elif isinstance(value, dict):
        for k, v in value.items():
            _flatten_value(f"{name}.{k}", v, out)
    elif value is None or isinstance(value, (bool, int, float, str)):
        out[name] = value
    elif isinstance(value, torch.dtype):
        out[name] = {"dtype": str(value).replace("torch.", "")}
    elif isinstance(value, torch.device):
        out[name] = {"device": value.type}
    else:
        raise TypeError(f"cache attribute {name!r} of type {type(value).__name__} cannot be kept between invocations")


def restore_layer(layer, flat: dict) -> None:
    """Set a fresh cache layer's attributes from `flatten_layer`'s dict (dict keys matched by their text)."""
    for name, value in flat.items():
        attr, _, key = name.partition(".")
        if isinstance(value, dict) and "dtype" in value:
            value = getattr(torch, value["dtype"])
        elif isinstance(value, dict) and "device" in value:
            value = torch.device(value["device"])
        if key:
            holder = getattr(layer, attr)
            match = next((k for k in holder if str(k) == key), key)
            holder[match] = value
        else:
            setattr(layer, attr, value)


def append_names(layer) -> set:
    """Names whose tensors only grow by new rows: full-attention keys and values."""
    from transformers.cache_utils import DynamicLayer

    return {"keys", "values"} if type(layer) is DynamicLayer else set()


# --- a part's K/V: {layer index: flat dict}, deltas and their application ----------------------------
def delta_of(state: dict, append: dict, rows: int) -> dict:
    """What one step adds: the last `rows` columns of append names, everything else as it is now.
    state: {layer: flat}; append: {layer: set of names}."""
    out = {}
    for layer, flat in state.items():
        grow = append.get(layer, set())
        out[layer] = {n: (v[..., -rows:, :] if n in grow and rows else v) for n, v in flat.items()}
    return out


def apply_delta(state: dict, delta: dict, append: dict) -> dict:
    """state after one more step (a new dict; tensors are never modified in place)."""
    out = {layer: dict(flat) for layer, flat in state.items()}
    for layer, flat in delta.items():
        grow = append.get(layer, set())
        have = out.setdefault(layer, {})
        for n, v in flat.items():
            if n in grow and isinstance(have.get(n), torch.Tensor):
                have[n] = torch.cat([have[n], v], dim=-2)
            else:
                have[n] = v
    return out


def to_file(delta: dict, append: dict) -> tuple:
    """(tensors, meta) to ride in a state file: tensors under `kv/<layer>/<name>`."""
    tensors, scalars = {}, {}
    for layer, flat in delta.items():
        for n, v in flat.items():
            if isinstance(v, torch.Tensor):
                tensors[f"{KV_PREFIX}{layer}/{n}"] = v
            else:
                scalars.setdefault(str(layer), {})[n] = v
    meta = {"scalars": scalars, "append": {str(k): sorted(v) for k, v in sorted(append.items()) if v},
            "layers": sorted(int(k) for k in delta)}
    return tensors, meta


def from_file(tensors: dict, meta: dict) -> tuple:
    """(delta, append) from a state file's tensors and meta (`to_file`'s inverse)."""
    delta = {int(layer): {} for layer in meta.get("layers", [])}
    for key, v in tensors.items():
        if key.startswith(KV_PREFIX):
            layer, _, name = key[len(KV_PREFIX):].partition("/")
            delta.setdefault(int(layer), {})[name] = v
    for layer, flat in meta.get("scalars", {}).items():
        delta.setdefault(int(layer), {}).update(flat)
    append = {int(k): set(v) for k, v in meta.get("append", {}).items()}
    return delta, append


def nbytes(state: dict) -> int:
    return sum(v.numel() * v.element_size() for flat in state.values() for v in flat.values() if isinstance(v, torch.Tensor))


class Store:
    """This container's K/V per (request, part): (steps it covers, state, append names), LRU by bytes."""

    def __init__(self, budget_bytes: int):
        self.budget = int(budget_bytes)
        self.entries = OrderedDict()
        self.hits = self.misses = 0

    def load(self, request: str, part: str, step: int, read_delta) -> tuple:
        """(state, append) covering steps 0..step-1; `read_delta(t) -> (delta, append)` reads step t's
        from storage for the steps memory lacks (all of them in a cold container)."""
        entry = self.entries.pop((request, part), None)
        if entry is not None and entry[0] == step:
            self.hits += 1
            return entry[1], entry[2]
        self.misses += 1
        have, state, append = entry if entry is not None and entry[0] < step else (0, {}, {})
        for t in range(have, step):
            delta, grow = read_delta(t)
            append = {**append, **grow}
            state = apply_delta(state, delta, append)
        return state, append

    def keep(self, request: str, part: str, steps: int, state: dict, append: dict) -> None:
        self.entries[(request, part)] = (steps, state, append)
        total = sum(nbytes(e[1]) for e in self.entries.values())
        while total > self.budget and self.entries:
            _, old = self.entries.popitem(last=False)
            total -= nbytes(old[1])

    def forget(self, request: str, part: str) -> None:
        self.entries.pop((request, part), None)
