"""Per-rank weight shards: dense weights and gates on every rank, each rank only its experts.

A tensor belongs to an expert if the architecture says so (`is_expert_tensor`); the placement
decides which ranks hold that expert (replicas included). Tensors keep their source names, so a
rank's shard is a subset of the source state dict. The file is standard safetensors, but written
here with a header whose keys are sorted: the safetensors library keeps metadata in a hash map
whose order changes between processes, which would make bundle bytes differ run to run.

`write_rank_shards` writes every rank's file in one pass over `TensorEntry`s (`tensor_entries.py`)
holding one tensor at a time, and hashes the weights on the way; `write_reference_indexes` writes,
for `--weights reference`, each rank's index into the original checkpoint instead.
"""
from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import torch

from moeplan.core import progress


def shard_name(rank: int, form: str = "copy") -> str:
    """A rank's weights file: its shard (`copy`), or its index into the checkpoint (`reference`)."""
    return f"shards/rank-{rank:05d}." + ("index.json" if form == "reference" else "safetensors")


def holders(placement: dict, is_expert_tensor):
    """name -> ranks holding that tensor (every rank for dense ones, the expert's hosts otherwise)."""
    devices_per_layer = [layer["devices"] for layer in sorted(placement["layers"], key=lambda e: e["layer"])]
    world = len(devices_per_layer[0])
    hosted = [{(l, int(e)) for l, devices in enumerate(devices_per_layer) for e in devices[r]} for r in range(world)]

    def ranks(name: str) -> tuple:
        owner = is_expert_tensor(name)
        return tuple(r for r in range(world) if owner is None or owner in hosted[r])
    return ranks


SAFETENSORS_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
                      torch.int64: "I64", torch.int32: "I32", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}


def write_shard(path: Path, tensors: dict, rank: int) -> None:
    """Write a safetensors file with sorted header keys and data in name order."""
    from moeplan.backends.common.tensor_entries import TensorEntry

    entries = [TensorEntry(n, n, tuple(t.shape), True, tuple(t.shape), t.dtype, (lambda t=t: t)) for n, t in sorted(tensors.items())]
    write_rank_shards(Path(path).parent, [Path(path).name], entries, lambda name: (0,), rank_base=rank)


class StateHash:
    """sha256 of a state dict fed one tensor (or one leading-dimension slice of it) at a time.

    The digest is that of `state_dict_sha256`: for each tensor in name order, "name|dtype|shape|"
    then its bytes. A tensor may arrive in consecutive dim-0 slices (one expert of a fused
    experts tensor after another), so a checkpoint can be hashed without holding any tensor whole.
    """

    def __init__(self):
        import hashlib

        self._h = hashlib.sha256()

    def begin(self, name: str, dtype: torch.dtype, shape: tuple) -> None:
        self._h.update(f"{name}|{dtype}|{tuple(shape)}|".encode())

    def update(self, t: torch.Tensor) -> None:
        if t.numel():
            self._h.update(t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy())

    def hexdigest(self) -> str:
        return self._h.hexdigest()


def _header(entries: list, rank: int) -> bytes:
    """Length prefix + JSON header (sorted keys, padded to 8 bytes) of a shard holding `entries` in order."""
    header = {"__metadata__": {"format": "pt", "moeplan_rank": str(rank)}}
    offset = 0
    for e in entries:
        size = math.prod(e.shape) * torch.empty((), dtype=e.dtype).element_size()
        header[e.name] = {"dtype": SAFETENSORS_DTYPES[e.dtype], "shape": list(e.shape), "data_offsets": [offset, offset + size]}
        offset += size
    head = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    return struct.pack("<Q", len(head + b" " * (-len(head) % 8))) + head + b" " * (-len(head) % 8)


def write_rank_shards(root: Path, shard_paths: list, entries: list, ranks_of, rank_base: int = 0) -> str:
    """Write every rank's safetensors shard in one pass over `entries` (tensor_entries.TensorEntry),
    loading one tensor at a time and appending it to each shard that holds it; returns the
    `state_dict_sha256` of the library state dict the entries make up.

    The header is known before any data (shapes and dtypes), so the files are written front to
    back: memory stays at one tensor, whatever the checkpoint's size. Data are in entry order.
    """
    world = len(shard_paths)
    per_rank = [[] for _ in range(world)]
    for e in entries:
        if e.dtype not in SAFETENSORS_DTYPES:
            raise ValueError(f"tensor {e.name} has dtype {e.dtype}, which shards do not support")
        for r in ranks_of(e.name):
            per_rank[r].append(e)
    h = StateHash()
    handles = []
    try:
        for r, rel in enumerate(shard_paths):
            path = Path(root) / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            handles.append(open(path, "wb"))
            handles[-1].write(_header(per_rank[r], rank_base + r))
        with progress.step(f"writing {world} shards (tensors)", total=len(entries)) as advance:
            _write_data(entries, ranks_of, handles, h, advance)
    finally:
        for fh in handles:
            fh.close()
    return h.hexdigest()


def _write_data(entries: list, ranks_of, handles: list, h: StateHash, advance) -> None:
    """Each entry's bytes appended to the shards of the ranks holding it, one tensor in memory at a time."""
    for e in entries:
        t = e.load().detach().to("cpu").contiguous()
        if tuple(t.shape) != tuple(e.shape) or t.dtype != e.dtype:
            raise ValueError(f"tensor {e.name} is {t.dtype}{list(t.shape)}, expected {e.dtype}{list(e.shape)}")
        if e.starts_library:
            h.begin(e.library, e.dtype, e.library_shape)
        h.update(t)
        if t.numel():
            data = t.reshape(-1).view(torch.uint8).numpy()
            for r in ranks_of(e.name):
                handles[r].write(data)
            del data  # a view: it would keep the tensor alive while the next one loads
        del t
        advance()


def entries_sha256(entries: list) -> str:
    """`state_dict_sha256` of the library state dict the entries make up, loading one at a time."""
    h = StateHash()
    for e in entries:
        if e.starts_library:
            h.begin(e.library, e.dtype, e.library_shape)
        h.update(e.load())
    return h.hexdigest()


def write_reference_indexes(root: Path, index_paths: list, entries: list, ranks_of) -> None:
    """Each rank's index into the checkpoint: {bundle tensor name: recipe} (runtime/checkpoint_reader.py)."""
    per_rank = [dict() for _ in index_paths]
    for e in entries:
        for r in ranks_of(e.name):
            per_rank[r][e.name] = e.recipe
    for r, rel in enumerate(index_paths):
        path = Path(root) / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        doc = {"version": 1, "rank": r, "tensors": per_rank[r]}
        path.write_text(json.dumps(doc, sort_keys=True, separators=(",", ":")) + "\n")


def state_dict_sha256(state: dict) -> str:
    """Hash of names, dtypes, shapes and bytes of a state dict, in name order."""
    h = StateHash()
    for name in sorted(state):
        t = state[name]
        h.begin(name, t.dtype, tuple(t.shape))
        h.update(t)
    return h.hexdigest()
