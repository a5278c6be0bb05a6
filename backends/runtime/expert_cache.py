"""A bounded cache of expert tensors on the compute device, backed by the rank's safetensors shard.

Why: a GPU that holds the dense weights but only some experts (offloading, issue 13) keeps a
planned number of (layer, expert) entries resident and loads the others when the router asks for
them. The engine iterates `serve(layer, experts, token)` once per MoE layer step, with the step's
distinct experts in request order (token order, then each token's top-k order: the order of the
simulator's request stream) and computes each expert as it is yielded; the cache makes each one
resident in the weights dict the architecture reads (evicting by its policy) and counts requests,
hits, loads and bytes moved, the figures `moeplan simulate` predicts.

* Backing store: `ShardStore` reads an expert's tensors from the shard file on each load
  (safetensors memory map); on CUDA it keeps them in pinned host memory and copies on a side
  stream, which the compute stream waits for before the layer runs.
* Policies: `LRUPolicy` is built in. Any object with the simulator's policy interface
  (passes/optimize/offload/policies.py: start, begin_step, touch, victim, inserted, evicted) can
  be plugged in; it sees the requests through `OnlineStream`, which grows step by step exactly
  like the simulator's precomputed stream, so the same policy takes the same decisions.
Nothing here imports moeplan: bundles run without it.
"""
from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch


class OnlineStream:
    """The request stream as it happens: same fields as the simulator's `Stream`, grown per step."""

    def __init__(self, num_layers: int, num_experts: int):
        self.num_layers, self.num_experts = num_layers, num_experts
        self.num_keys = num_layers * num_experts
        self._keys = np.zeros(1024, dtype=np.int64)
        self.step_start, self.step_layer, self.step_token, self.step_seq = [0], [], [], []

    @property
    def keys(self) -> np.ndarray:
        return self._keys[: self.step_start[-1]]

    def add_step(self, layer: int, token: int, seq: int, keys: list) -> int:
        """Append one step's keys; returns its index."""
        end = self.step_start[-1] + len(keys)
        while end > len(self._keys):
            self._keys = np.concatenate([self._keys, np.zeros(len(self._keys), dtype=np.int64)])
        self._keys[self.step_start[-1]:end] = keys
        self.step_start.append(end)
        self.step_layer.append(layer)
        self.step_token.append(token)
        self.step_seq.append(seq)
        return len(self.step_layer) - 1


class LRUPolicy:
    """Least recently used; the initial residents count as used in their listed order."""

    name = "lru"

    def start(self, stream, cached, resident):
        self.order = OrderedDict((int(k), None) for k in resident)

    def begin_step(self, s):
        pass

    def touch(self, r, key, hit):
        self.order[key] = None
        self.order.move_to_end(key)

    def inserted(self, key, r):
        self.order[key] = None

    def evicted(self, key):
        del self.order[key]

    def victim(self, r, exclude=()):
        return next(iter(self.order))


class ShardStore:
    """An expert's tensors by (layer, expert), read from a safetensors shard when loaded."""

    def __init__(self, path, names_of: dict, pinned: bool = False):
        from safetensors import safe_open

        self.file = safe_open(str(path), framework="pt")
        self.names_of = names_of  # (layer, expert) -> [tensor names]
        self.pinned = pinned

    def load(self, layer: int, expert: int) -> dict:
        out = {}
        for name in self.names_of[(layer, expert)]:
            t = self.file.get_tensor(name).float()
            out[name] = t.pin_memory() if self.pinned else t
        return out



class ExpertCache:
    """At most `capacity` (layer, expert) entries of `weights` (the architecture's tensor dict)."""

    def __init__(self, capacity: int, store: ShardStore, weights: dict, num_layers: int, num_experts: int, device,
                 policy=None, resident=()):
        if capacity < 1:
            raise ValueError("the expert cache needs at least one entry")
        self.capacity, self.store, self.weights, self.device = capacity, store, weights, torch.device(device)
        self.E = num_experts
        self.stream = OnlineStream(num_layers, num_experts)
        self.policy = policy or LRUPolicy()
        self.cached = np.zeros(num_layers * num_experts, dtype=bool)
        self.copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.requests = self.hits = self.loads = self.bytes_moved = 0
        resident = [int(k) for k in list(resident)[:capacity]]
        for k in resident:
            self._install(k)
        self.loads = self.bytes_moved = 0  # the initial fill is not traffic of the run
        self.policy.start(self.stream, self.cached, resident)
        self.size = len(resident)

    def _install(self, key: int) -> None:
        tensors = self.store.load(key // self.E, key % self.E)
        if self.copy_stream is not None:  # pinned host -> device on the side stream
            with torch.cuda.stream(self.copy_stream):
                moved = {n: t.to(self.device, non_blocking=True) for n, t in tensors.items()}
            torch.cuda.current_stream(self.device).wait_stream(self.copy_stream)
        else:
            moved = {n: t.to(self.device) for n, t in tensors.items()}
        self.weights.update(moved)
        self.cached[key] = True
        self.loads += 1
        self.bytes_moved += sum(t.numel() * t.element_size() for t in tensors.values())

    def _drop(self, key: int) -> None:
        for name in self.store.names_of[(key // self.E, key % self.E)]:
            self.weights.pop(name, None)
        self.cached[key] = False

    def serve(self, layer: int, experts: list, token: int, seq: int = 0):
        """Yield the step's experts (distinct, in request order), each made resident just before
        its turn (evicting by the policy): an expert computes before the next one is loaded."""
        keys = [layer * self.E + int(e) for e in experts]
        s = self.stream.add_step(layer, token, seq, keys)
        self.policy.begin_step(s)
        r0 = self.stream.step_start[s]
        for i, key in enumerate(keys):
            r = r0 + i
            self.requests += 1
            if self.cached[key]:
                self.hits += 1
                self.policy.touch(r, key, True)
            else:
                if self.size >= self.capacity:
                    v = int(self.policy.victim(r))
                    self._drop(v)
                    self.policy.evicted(v)
                else:
                    self.size += 1
                self._install(key)
                self.policy.inserted(key, r)
                self.policy.touch(r, key, False)
            yield key % self.E

    def stats(self) -> dict:
        return {"requests": self.requests, "hits": self.hits, "loads": self.loads, "bytes_moved": self.bytes_moved,
                "hit_ratio": self.hits / self.requests if self.requests else 0.0, "capacity": self.capacity}
