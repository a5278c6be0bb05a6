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
* `ReferenceStore`: the original checkpoint through the rank's reference index (`--weights
  reference`): one expert's recipe per load (runtime/checkpoint_reader.py), i.e. that expert's rows of a
  fused [E, ...] or DBRX [E * r, D] tensor via `get_slice`, or its own per-expert tensors.

The host tier (`preload(keys)`): the plan's host-memory keys for this rank are read once when the
rank starts and held as float32 (pinned on CUDA); every later load of them is a host load, every
load of any other key reads the files again. Preloaded rather than kept after the first read
because that is the planner's model (`Timing.copy_s`: a host-tier expert never pays the NVMe
read), so the simulator's disk/host split needs no first-touch state, and because the host memory
(pinned on CUDA) is then committed, and fails if short, before the first token rather than in
the middle of serving. The preload's reads are reported apart (`preloaded`), not as run traffic.
Nothing here imports moeplan: bundles run without it.
"""
from __future__ import annotations


COUNTERS = ("disk_loads", "disk_bytes", "host_loads", "host_bytes")


def tensor_bytes(tensors: dict) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


class ExpertStore:
    """Base: counters and the float32 (pinned on CUDA) form of what `read` returns."""

    def __init__(self, pinned: bool = False):
        self.pinned = pinned
        self.host = {}  # (layer, expert) -> {param: float32 tensor}: the host tier
        self.preloaded = {"loads": 0, "bytes": 0}
        self.reset_counters()

    def read(self, layer: int, expert: int) -> dict:
        """{param: tensor as stored} of one expert, from the backing files."""
        raise NotImplementedError

    def dense(self) -> dict:
        """{name: float32 CPU tensor} of the rank's tensors that are not per-expert (read once)."""
        raise NotImplementedError

    def reset_counters(self) -> None:
        self.disk_loads = self.disk_bytes = self.host_loads = self.host_bytes = 0

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
        """{param: float32 tensor} of one expert (pinned host memory when `pinned`): the host
        tier's copy if it holds the expert, else read from the files."""
        held = self.host.get((layer, expert))
        if held is None:
            return self._from_disk(layer, expert)
        self.host_loads += 1
        self.host_bytes += tensor_bytes(held)
        return held

    def host_weights(self, layer: int, expert: int) -> dict:
        """{param: float32 CPU tensor} of one expert for computing it on the host (host compute on
        a miss): the host tier's copy, which moves nowhere and is not counted, or a disk read,
        counted as one (the simulator's rule: a key outside the host tier is read for it)."""
        held = self.host.get((layer, expert))
        return held if held is not None else self._from_disk(layer, expert)

    def preload(self, keys) -> None:
        """Read the host tier's experts ((layer, expert) pairs) into host memory, once."""
        before = self.counters()
        for layer, expert in keys:
            if (int(layer), int(expert)) not in self.host:
                self.host[(int(layer), int(expert))] = self._from_disk(int(layer), int(expert))
        self.preloaded = {"loads": self.preloaded["loads"] + self.disk_loads - before["disk_loads"],
                          "bytes": self.preloaded["bytes"] + self.disk_bytes - before["disk_bytes"]}
        self.disk_loads, self.disk_bytes = before["disk_loads"], before["disk_bytes"]

    def counters(self) -> dict:
        return {**{name: getattr(self, name) for name in COUNTERS}, "host_experts": len(self.host),
                "preload_bytes": self.preloaded["bytes"]}


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
        self.owner = owner

    def read(self, layer: int, expert: int) -> dict:
        return {param: self.file.get_tensor(name) for param, name in self.names_of[(layer, expert)]}

    def dense(self) -> dict:
        return {name: self.file.get_tensor(name).float() for name in self.file.keys() if self.owner(name) is None}


class ReferenceStore(ExpertStore):
    """An expert's tensors read from the original checkpoint by the rank's reference index
    (`shards/rank-N.index.json`: bundle tensor name -> recipe); the checkpoint's files stay open."""

    def __init__(self, directory, index_path, owner, pinned: bool = False):
        import json
        from pathlib import Path

        from ..checkpoint_reader import OpenFiles

        super().__init__(pinned)
        self.directory = Path(directory)
        self.recipes = json.loads(Path(index_path).read_text())["tensors"]
        self.owner, self.files = owner, OpenFiles(self.directory)
        self.recipes_of = {}
        for name, recipe in sorted(self.recipes.items()):
            o = owner(name)
            if o is not None:
                self.recipes_of.setdefault((o[0], o[1]), []).append((o[2], recipe))

    def read(self, layer: int, expert: int) -> dict:
        from ..checkpoint_reader import read_recipe

        return {param: read_recipe(self.directory, recipe, self.files) for param, recipe in self.recipes_of[(layer, expert)]}

    def dense(self) -> dict:
        from ..checkpoint_reader import read_recipe

        return {name: read_recipe(self.directory, recipe).float() for name, recipe in sorted(self.recipes.items())
                if self.owner(name) is None}


def open_rank_store(weights_path, owner, pinned: bool = False, host_keys=(), checkpoint_dir=None) -> tuple:
    """(store, dense tensors) of one rank: its copied shard, or for a reference index
    (`*.index.json`) the checkpoint in `checkpoint_dir`; the host tier `host_keys` preloaded."""
    if str(weights_path).endswith(".index.json"):
        if checkpoint_dir is None:
            raise ValueError(f"'{weights_path}' is a checkpoint index; the rank needs the checkpoint's directory")
        store = ReferenceStore(checkpoint_dir, weights_path, owner, pinned)
    else:
        store = ShardStore(weights_path, owner, pinned)
    dense = store.dense()
    store.preload(host_keys)
    return store, dense
