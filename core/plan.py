"""The Plan: every decision the planner made, versioned, as the contract with the backends.

`plan.json` is what users diff in CI, so its bytes depend only on the inputs: sorted keys, fixed
indentation, one float rule for every target (8 significant digits, so Lambda prices near 1e-5
$/GB-s keep their precision; NaN and infinities become null), no timestamps or absolute paths.
A bundle is a function of (plan.json, weights): backends read only the plan and the weights it
names, and `moeplan codegen plan.json` regenerates any target's bundle byte for byte.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields, is_dataclass

from moeplan.core.plan_sections import SECTIONS, Communication, Deployment, Placement, Predicted, Section

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
      These three and `deployment` are typed sections (`core/plan_sections.py`); given as dicts,
      they become sections.
    * `shards`: per-rank weight file names, rank order (filled in by torchrun codegen).
    * `inputs`: what the plan was computed from: `model` (the spec as given, which `moeplan
      codegen` reads the weights from), trace hash, options.
    * `deployment`: how the bundle is deployed: the engine targets' parallel layout (attention TP
      or DP, EP size, redundant experts, max running requests: `core/engine_layout.py`), and target
      settings that shape the bundle (Kubernetes image and storage class; Lambda payload limit and
      the request rate its README prices).
    """

    target: str
    model: dict
    topology: dict
    placement: Placement
    communication: Communication
    predicted: Predicted
    shards: list = field(default_factory=list)
    inputs: dict = field(default_factory=dict)
    deployment: Deployment = field(default_factory=Deployment)
    version: int = PLAN_VERSION

    def __post_init__(self):
        for name, kind in SECTIONS.items():  # a section given as its JSON object (a malformed one stays as it is)
            value = getattr(self, name)
            if isinstance(value, dict):
                object.__setattr__(self, name, kind.from_json(value))

    @property
    def world_size(self) -> int:
        return int(self.topology["nodes"]) * int(self.topology["gpus_per_node"])

    def to_dict(self) -> dict:
        return rounded({f.name: _plain(getattr(self, f.name)) for f in fields(self)})

    def as_written(self) -> Plan:
        """The plan as plan.json holds it (floats rounded by the plan's one rule), for what is shown
        beside it (summaries, READMEs) to say exactly what the file says."""
        return Plan.from_dict(self.to_dict())

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_dict(cls, data: dict) -> Plan:
        if not isinstance(data, dict) or data.get("version") != PLAN_VERSION:
            raise ValueError(f"plan version {data.get('version') if isinstance(data, dict) else None!r} is not {PLAN_VERSION}")
        names = cls.__dataclass_fields__.keys()
        missing = [n for n in ("target", "model", "topology", "placement", "communication", "predicted") if n not in data]
        if missing:
            raise ValueError(f"plan lacks fields {missing}")
        return cls(**{k: v for k, v in data.items() if k in names})

    @classmethod
    def from_json(cls, text: str) -> Plan:
        return cls.from_dict(json.loads(text))


def _plain(value):
    """`value` as plain JSON-able containers: sections as their objects, other dataclasses as dicts
    (what `dataclasses.asdict` gave before the sections were typed)."""
    if isinstance(value, Section):
        return _plain(value.to_json())
    if is_dataclass(value) and not isinstance(value, type):
        return asdict(value)
    if isinstance(value, dict):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value)
    return value


SIGNIFICANT_DIGITS = 8


def rounded(value):
    """The plan's one float rule, applied to every value on the way to JSON."""
    if isinstance(value, float):
        if not math.isfinite(value):
            return None
        return float(f"{value:.{SIGNIFICANT_DIGITS}g}")
    if isinstance(value, dict):
        return {str(k): rounded(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [rounded(v) for v in value]
    if hasattr(value, "item") and not isinstance(value, (str, bytes)):
        return rounded(value.item())
    return value


def plan_reads_back(facts) -> None:
    """Postcondition of every plan pass: plan.json reads back as the plan that wrote it (what
    `moeplan codegen` and `simulate` will read is what was decided)."""
    text = facts["plan"].to_json()
    if Plan.from_json(text).to_json() != text:
        raise ValueError("plan.json does not read back as the plan that wrote it")
