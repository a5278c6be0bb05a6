"""What Lambda functions hand each other: tensor files, which rows each expert replica serves, and
the routed sum their outputs add up to.

Why a separate file: the dense functions (which route and combine), the expert functions and the
local runner (`moeplan run`) must agree on these bytes and row orders; the model itself is the
library's (`model.py`). Rows are flat: every token of every sequence, sorted by sequence.
Only torch, safetensors and the standard library.
"""
from __future__ import annotations

import json
import math
import struct

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save


def to_bytes(tensors: dict, meta: dict | None = None) -> bytes:
    """A safetensors file; `meta` (JSON-able) rides in its header."""
    header = None if meta is None else {"moeplan": json.dumps(meta, sort_keys=True)}
    return st_save({k: v.contiguous() for k, v in sorted(tensors.items())}, metadata=header)


def from_bytes(data: bytes) -> dict:
    return st_load(data)


def meta_of(data: bytes) -> dict:
    """The `meta` a file was written with ({} if none), read from its header only."""
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    return json.loads(header.get("__metadata__", {}).get("moeplan", "{}"))


def assignment(route_ids: torch.Tensor, expert: int, replicas: int) -> list:
    """(token rows, slots) for each replica of `expert`: its rows in token order, split in contiguous shares."""
    tok, slot = torch.where(route_ids == expert)
    n = tok.numel()
    per = math.ceil(n / replicas) if n else 0
    return [(tok[r * per:(r + 1) * per], slot[r * per:(r + 1) * per]) for r in range(replicas)]


def expert_jobs(h: torch.Tensor, route_ids: torch.Tensor, route_w: torch.Tensor, replicas: dict) -> list:
    """(expert, replica, rows [m, D], gate weights [m]) for every replica with work, expert order."""
    jobs = []
    for e, g in sorted(replicas.items()):
        for r, (tok, slot) in enumerate(assignment(route_ids, e, g)):
            if tok.numel():
                jobs.append((e, r, h[tok], route_w[tok, slot]))
    return jobs


def routed_sum(route_ids: torch.Tensor, outputs: dict, replicas: dict, width: int) -> torch.Tensor:
    """[N, D]: per token, the sum of its experts' weighted outputs; `outputs[(e, r)]` are the
    weighted rows of replica r of expert e, in `assignment` order."""
    acc = torch.zeros(route_ids.shape[0], width)
    for e in sorted(replicas):
        for r, (tok, _) in enumerate(assignment(route_ids, e, replicas[e])):
            if tok.numel():
                acc = acc.index_add(0, tok, outputs[(e, r)].float())
    return acc
