"""Peak bytes of tensors alive while a torch module runs, counted exactly from the ops it executes.

Why not RSS or torch.profiler: process RSS on a shared CPU machine is noisy and allocator-
cached, and the profiler reports allocations, not the peak of live bytes. A dispatch mode sees
every tensor an op returns; counting each storage once while any tensor on it is alive gives a
deterministic peak of intermediate memory, the M^itrm a serverless function must hold.
"""
from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class _LiveBytes(TorchDispatchMode):
    def __init__(self, existing=()):
        super().__init__()
        self._existing = {t.untyped_storage().data_ptr() for t in existing}
        self.live = 0
        self.peak = 0
        self._refs = {}  # storage key -> [tensor count, bytes]

    def _track(self, t: torch.Tensor):
        storage = t.untyped_storage()
        key = (storage.data_ptr(), storage.nbytes())
        if key[0] == 0 or key[0] in self._existing:
            return
        entry = self._refs.get(key)
        if entry is None:
            entry = self._refs[key] = [0, storage.nbytes()]
            self.live += entry[1]
            self.peak = max(self.peak, self.live)
        entry[0] += 1
        weakref.finalize(t, self._release, key)

    def _release(self, key):
        entry = self._refs.get(key)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            self.live -= entry[1]
            del self._refs[key]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._track(t)
        return out


def peak_intermediate_bytes(module: torch.nn.Module, *inputs) -> int:
    """Peak bytes of tensors created during `module(*inputs)` (output included; weights and inputs not)."""
    with torch.no_grad():
        existing = [*module.parameters(), *module.buffers(), *(x for x in inputs if isinstance(x, torch.Tensor))]
        mode = _LiveBytes(existing)
        with mode:
            out = module(*inputs)
        peak = mode.peak
        del out
    return int(peak)
