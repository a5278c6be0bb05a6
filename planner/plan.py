"""The Plan: every decision the planner made, versioned, as the contract with the backends.

`plan.json` is what users diff in CI, so its bytes depend only on the inputs: sorted keys, fixed
indentation, floats rounded to 6 decimals, no timestamps or absolute paths. Backends read only
the plan (and the weights it names), never the planner's internals.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

PLAN_VERSION = 1


@dataclass(frozen=True)
class Plan:
    """A deployment decision for one target.

    * `model`: name, architecture (the runtime family), config/source files shipped in the bundle,
      the ModelIR as a dict, and `weights_sha256` of the source state dict.
    * `topology`: nodes and GPUs per node; ranks are devices node by node.
    * `placement`: the `placement.json` document (experts per device per MoE layer).
    * `communication`: how tokens move (mode, gating) - what the runtime is configured with.
    * `predicted`: the metrics the planner predicts for this plan.
    * `shards`: per-rank weight file names, rank order.
    * `inputs`: hashes and options of what the plan was computed from (trace, flags).
    """

    target: str
    model: dict
    topology: dict
    placement: dict
    communication: dict
    predicted: dict
    shards: list = field(default_factory=list)
    inputs: dict = field(default_factory=dict)
    version: int = PLAN_VERSION

    @property
    def world_size(self) -> int:
        return int(self.topology["nodes"]) * int(self.topology["gpus_per_node"])

    def to_dict(self) -> dict:
        return _rounded(asdict(self))

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_dict(cls, data: dict) -> "Plan":
        if not isinstance(data, dict) or data.get("version") != PLAN_VERSION:
            raise ValueError(f"plan version {data.get('version') if isinstance(data, dict) else None!r} is not {PLAN_VERSION}")
        names = cls.__dataclass_fields__.keys()
        missing = [n for n in ("target", "model", "topology", "placement", "communication", "predicted") if n not in data]
        if missing:
            raise ValueError(f"plan lacks fields {missing}")
        return cls(**{k: v for k, v in data.items() if k in names})

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        return cls.from_dict(json.loads(text))


def _rounded(value):
    if isinstance(value, float):
        return round(value, 6)
    if isinstance(value, dict):
        return {str(k): _rounded(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_rounded(v) for v in value]
    if hasattr(value, "item") and not isinstance(value, (str, bytes)):
        return _rounded(value.item())
    return value
