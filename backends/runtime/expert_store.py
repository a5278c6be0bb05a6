"""The backing store behind a rank's expert cache: where an expert's weights come from on a miss.

Why a separate interface: the cache (expert_cache.py) decides *which* expert to load and when;
the store decides *where from*. Every store offers

    load(layer, expert) -> {param: float32 tensor}   one expert's tensors (pinned on CUDA)
    counters() -> {"disk_loads", "disk_bytes", "host_loads", "host_bytes"}
    reset_counters()

`disk_*` counts experts read from the backing files at that load, `host_*` experts served from a
copy already in host memory. Bytes: disk = the expert's tensors in the dtype the bundle stores them
in (what a read takes off disk), host = the float32 copy handed to the device.

* `ShardStore`: the rank's copied safetensors shard (`--weights copy`), read with `safe_open`.
Nothing here imports moeplan: bundles run without it.
"""
from __future__ import annotations

import torch

COUNTERS = ("disk_loads", "disk_bytes", "host_loads", "host_bytes")


def tensor_bytes(tensors: dict) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


class ExpertStore:
    """Base: counters and the float32 (pinned on CUDA) form of what `read` returns."""

    def __init__(self, pinned: bool = False):
        self.pinned = pinned
        self.reset_counters()

    def read(self, layer: int, expert: int) -> dict:
        """{param: tensor as stored} of one expert, from the backing files."""
        raise NotImplementedError

    def reset_counters(self) -> None:
        self.disk_loads = self.disk_bytes = self.host_loads = self.host_bytes = 0

    def counters(self) -> dict:
        return {name: getattr(self, name) for name in COUNTERS}

    def _from_disk(self, layer: int, expert: int) -> dict:
        stored = self.read(layer, expert)
        self.disk_loads += 1
        self.disk_bytes += tensor_bytes(stored)
        out = {}
        for param, t in stored.items():
            t = t.float()
            out[param] = t.pin_memory() if self.pinned else t
        return out

    def load(self, layer: int, expert: int) -> dict:
        """{param: float32 tensor} of one expert (pinned host memory when `pinned`)."""
        return self._from_disk(layer, expert)


class ShardStore(ExpertStore):
    """An expert's tensors by (MoE layer, expert), read from the rank's safetensors shard per load."""

    def __init__(self, path, owner, pinned: bool = False):
        """`owner(name)` -> (MoE layer, expert, param) for per-expert tensor names, None for others."""
        from safetensors import safe_open

        super().__init__(pinned)
        self.file = safe_open(str(path), framework="pt")
        self.names_of = {}
        for name in self.file.keys():
            o = owner(name)
            if o is not None:
                self.names_of.setdefault((o[0], o[1]), []).append((o[2], name))

    def read(self, layer: int, expert: int) -> dict:
        return {param: self.file.get_tensor(name) for param, name in self.names_of[(layer, expert)]}
