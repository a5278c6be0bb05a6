"""An all-to-all of equal blocks as one torch op (`torch.ops.moeplan.exchange_equal`), so that a compiled decode
step can hold its exchanges inside one graph.

Why an op: the dynamic-gating exchange (`exchange.py`) sends each rank exactly its rows, so the sizes it receives
are data (a count round, then lists of ints): torch.compile must break the graph there. A gathered decode step
(`gathered_moe.py`) sends every rank the same fixed number of rows, so what comes back has the shape of what
went out, and the op's shape rule (`register_fake`) says so: inductor calls it as an opaque kernel inside the
graph. Its body is the Exchanger's own `exchange_sorted` with the counts known on both sides (no count round;
shared memory between CPU ranks of one host, else gloo or nccl), counting the bytes as every exchange does.

An op takes tensors and plain values only, so the Exchanger is named by a handle (`register`).
"""
from __future__ import annotations

import itertools
import weakref

import torch

_EXCHANGERS = weakref.WeakValueDictionary()  # handle -> Exchanger, for as long as the exchanger lives
_HANDLES = itertools.count()


def register(exchanger) -> int:
    """A handle for `exchanger` that `exchange_equal` takes (the same exchanger keeps its handle)."""
    for handle, known in list(_EXCHANGERS.items()):
        if known is exchanger:
            return handle
    handle = next(_HANDLES)
    _EXCHANGERS[handle] = exchanger
    return handle


@torch.library.custom_op("moeplan::exchange_equal", mutates_args=())
def exchange_equal(send: torch.Tensor, exchanger: int, layer: int, phase: str) -> torch.Tensor:
    """send float32 [W * n, R]: block d (rows d*n .. d*n + n - 1) goes to rank d -> float32 [W * n, R]: block s
    came from rank s. Every rank calls it with the same n."""
    ex = _EXCHANGERS[exchanger]
    rows = send.shape[0] // ex.world
    counts = [rows] * ex.world
    recv, _ = ex.exchange_sorted(send, counts, send.shape[1], layer, phase, recv_counts=counts)
    return recv.clone() if recv.data_ptr() == send.data_ptr() else recv


@exchange_equal.register_fake
def _exchange_equal_shape(send: torch.Tensor, exchanger: int, layer: int, phase: str) -> torch.Tensor:
    return torch.empty_like(send)
