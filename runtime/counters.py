"""Communication counters: bytes and messages each rank sends, per MoE layer and per phase.

Only traffic that leaves the rank counts (a rank's rows to itself are a local copy). `bytes` is
what the data exchange carries (hidden rows plus their routing metadata); `control_bytes` and
`control_messages` are the per-destination row counts that dynamic gating exchanges first.
Phases: `dispatch` (tokens to their experts), `combine` (standard EP: expert outputs back to the
home rank), `merge` (context-coherent: non-primary expert outputs to the token's new current
rank), `context` (context-coherent: attention state of every new token to every rank); per step,
`prompt_sync` (the AllGather of prompts) and `token_sync` (of newly generated tokens).
`local_slots`/`slots` count (token, expert) slots at MoE layers >= 1 served on the token's
current rank, the measured `gpu_local_fraction`.
"""
from __future__ import annotations

import copy

PHASES = ("dispatch", "combine", "merge", "context")
FIELDS = ("bytes", "messages", "control_bytes", "control_messages")
STEP_PHASES = ("prompt_sync", "token_sync")


class Counters:
    """Per-layer, per-phase counts for one rank; `to_dict` is JSON-ready and sums across ranks."""

    def __init__(self, num_layers: int):
        self.layers = [
            {phase: dict.fromkeys(FIELDS, 0) for phase in PHASES} | {"local_slots": 0, "slots": 0}
            for _ in range(num_layers)
        ]
        self.step = {f"{phase}_{f}": 0 for phase in STEP_PHASES for f in FIELDS}

    def add(self, layer, phase: str, nbytes: int, messages: int, control_bytes: int, control_messages: int):
        """Count one exchange; layer None means a per-step phase (`prompt_sync`, `token_sync`)."""
        if layer is None:
            for f, v in zip(FIELDS, (nbytes, messages, control_bytes, control_messages)):
                self.step[f"{phase}_{f}"] += v
            return
        entry = self.layers[layer][phase]
        entry["bytes"] += nbytes
        entry["messages"] += messages
        entry["control_bytes"] += control_bytes
        entry["control_messages"] += control_messages

    def to_dict(self) -> dict:
        return {"layers": self.layers, "step": self.step}

    def snapshot(self) -> dict:
        """A copy of the counts now, for `since`."""
        return copy.deepcopy(self.to_dict())

    def since(self, before: dict) -> dict:
        """What was counted after the `snapshot` `before`, in `to_dict`'s form (a CUDA graph's exchanges, counted
        once at its capture: `model/graph_decode.py` adds them again at each replay with `add_counts`)."""
        delta = self.snapshot()
        _add_into(delta, before, sign=-1)
        return delta

    def add_counts(self, counts: dict) -> None:
        """Add counts in `to_dict`'s form (`since`'s) to these, in place (the exchanger holds this object)."""
        _add_into(self.to_dict(), counts)

    def restore(self, counts: dict) -> None:
        """Set these counts to `counts` (`to_dict`'s form), in place."""
        counts = copy.deepcopy(counts)
        for mine, theirs in zip(self.layers, counts["layers"]):
            mine.update(theirs)
        self.step.update(counts["step"])


def _add_into(total: dict, other: dict, sign: int = 1) -> None:
    """`other`'s counts (`to_dict`'s form) added into `total`'s in place (`sign` -1: subtracted)."""
    for mine, theirs in zip(total["layers"], other["layers"]):
        for key, value in theirs.items():
            if isinstance(value, dict):
                for f, v in value.items():
                    mine[key][f] += sign * v
            else:
                mine[key] += sign * value
    for key, value in other["step"].items():
        total["step"][key] += sign * value


def sum_counters(dicts: list) -> dict:
    """Element-wise sum of several ranks' `Counters.to_dict()`."""
    total = copy.deepcopy(dicts[0])
    for other in dicts[1:]:
        _add_into(total, other)
    return total
