"""Count the kernels a piece of the runtime launches: every aten op dispatched under a
`TorchDispatchMode`, views aside (a view is metadata, no kernel). What the cost model's launch counts
stand for (`passes/cost/cost_model.py`: ATTN_OPS, MOE_OPS, ...), measured instead of guessed.

    with OpCounter() as ops:
        block(x)
    ops.total, ops.by_op   # int, {"aten.mm.default": 3, ...}

Nothing here imports moeplan: bundles run without it.
"""
from __future__ import annotations

from collections import Counter

from torch.utils._python_dispatch import TorchDispatchMode


class OpCounter(TorchDispatchMode):
    """Counts non-view aten ops run inside the `with` block (see module docstring)."""

    def __init__(self):
        super().__init__()
        self.by_op = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not getattr(func, "is_view", False):
            self.count(func)
        return func(*args, **(kwargs or {}))

    def count(self, func) -> None:
        """One kernel of `func` (a subclass may also attribute it, benchmarks/runtime_op_counts.py)."""
        self.by_op[str(func)] += 1

    @property
    def total(self) -> int:
        return sum(self.by_op.values())
