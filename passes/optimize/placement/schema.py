"""The placement contract: `Topology`, `Placement` (which devices host which experts of each MoE layer)
and its `placement.json` form (format version 1), read and validated here, and the dispatch rule
that goes with it.

The dispatch rule (which copy of a replicated expert a token's slot uses) is the runtime's own:
`runtime/ep/expert_table.py: ExpertTable`, which bundles run, the cost model replays and the
placement metric follows (`Placement.expert_table()`). It lives in the runtime because a bundle
runs without moeplan installed. The two halves follow SGLang's `ExpertLocationMetadata`
(python/sglang/srt/eplb/expert_location.py) and `expert_location_dispatch.py` (sglang 0.5.23).

`placement.json`: {"version": 1, "policy", "topology": {"nodes", "gpus_per_node"},
"layers": [{"layer": l, "devices": [[expert ids on device 0], ...]}], "metrics": {...}}.
Device d sits on node d // gpus_per_node. A device's list may repeat an expert hosted by another
device (a replica) but never twice on itself. Every expert of every layer is hosted somewhere.
Bytes are deterministic: sorted keys, fixed indentation, floats by the plan's one rule (`planner.plan.rounded`), and no
run-dependent figures (solve time) unless asked for.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from moeplan.runtime.ep.expert_table import ExpertTable
from moeplan.core.atomic import write_text_atomic
from moeplan.core.errors import UserError
from moeplan.core.plan import rounded

PLACEMENT_VERSION = 1
RUN_DEPENDENT_METRICS = ("solve_seconds",)


@dataclass(frozen=True)
class Topology:
    """Homogeneous nodes of GPUs; device ids run node by node."""

    nodes: int
    gpus_per_node: int

    @property
    def devices(self) -> int:
        return self.nodes * self.gpus_per_node

    def node_of(self, device):
        return device // self.gpus_per_node


@dataclass
class Placement:
    """Experts hosted per device per MoE layer, plus how it was obtained and how it scores."""

    policy: str
    topology: Topology
    layers: list  # layers[l][d] = sorted list of expert ids on device d
    num_experts: int
    metrics: dict = field(default_factory=dict)
    # work `policies.plan_placement` left for later (an ILP's bound: `policies.finish_placement`); never written
    deferred_bound: object = field(default=None, repr=False, compare=False)

    @classmethod
    def from_hosts(cls, policy: str, topology: Topology, hosts: np.ndarray, metrics=None) -> Placement:
        """Build from a bool [L, E, D] hosting array."""
        L, E, D = hosts.shape
        layers = [[np.flatnonzero(hosts[l, :, d]).tolist() for d in range(D)] for l in range(L)]
        return cls(policy, topology, layers, E, dict(metrics or {}))

    def hosts(self) -> np.ndarray:
        """bool [L, E, D]: hosts[l, e, d] = expert e of layer l has a replica on device d."""
        D = self.topology.devices
        out = np.zeros((len(self.layers), self.num_experts, D), dtype=bool)
        for l, devices in enumerate(self.layers):
            for d, experts in enumerate(devices):
                out[l, experts, d] = True
        return out

    def expert_table(self) -> ExpertTable:
        """The dispatch rule over this placement's copies: what the runtime builds from placement.json."""
        return ExpertTable(self.hosts(), self.topology.gpus_per_node)

    def to_json(self, timings: bool = False) -> str:
        """Deterministic text: sorted keys, one line per layer (diffable), floats rounded.

        Run-dependent figures (`solve_seconds`) are left out unless `timings`, so the same inputs
        give the same bytes."""
        metrics = {k: v for k, v in self.metrics.items() if timings or k not in RUN_DEPENDENT_METRICS}
        head = {
            "version": PLACEMENT_VERSION,
            "policy": self.policy,
            "topology": {"nodes": self.topology.nodes, "gpus_per_node": self.topology.gpus_per_node},
            "num_experts": self.num_experts,
            "metrics": rounded(metrics),
        }
        lines = [json.dumps({"devices": devices, "layer": l}, sort_keys=True, separators=(", ", ": "))
                 for l, devices in enumerate(self.layers)]
        body = json.dumps(head, indent=1, sort_keys=True)
        layers = '"layers": [\n  ' + ",\n  ".join(lines) + "\n ]"
        return body[: body.rindex("}")].rstrip() + ",\n " + layers + "\n}\n"

    def save(self, path: str | os.PathLike, timings: bool = False) -> None:
        write_text_atomic(path, self.to_json(timings), kind="placement")


MAX_PLACED_EXPERTS = 1 << 14  # as for traces (passes/analysis/trace/format.py MAX_EXPERTS)


def load_placement(path: str | os.PathLike) -> Placement:
    """Read and validate `placement.json`; the first problem is raised as a `UserError`."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"placement file '{path}' does not exist; write one with 'moeplan place --trace T --out {path}'")
    try:
        doc = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UserError(f"placement file '{path}' is not valid JSON ({exc.__class__.__name__}); regenerate it with 'moeplan place'") from None
    try:
        return placement_from_dict(doc)
    except UserError as exc:
        raise UserError(f"placement file '{path}': {exc}") from None
    except (KeyError, TypeError, ValueError, AttributeError, IndexError, OverflowError) as exc:
        raise UserError(f"placement file '{path}' has a malformed field ({exc.__class__.__name__}: "
                        f"{str(exc)[:80]}); regenerate it with 'moeplan place'") from None


def placement_from_dict(doc) -> Placement:
    if not isinstance(doc, dict):
        raise UserError("a placement must be a JSON object")
    if doc.get("version") != PLACEMENT_VERSION:
        raise UserError(f"placement format version {doc.get('version')!r} is not supported; this moeplan reads version {PLACEMENT_VERSION}")
    try:
        topology = Topology(int(doc["topology"]["nodes"]), int(doc["topology"]["gpus_per_node"]))
        layers = [entry["devices"] for entry in sorted(doc["layers"], key=lambda e: e["layer"])]
    except (KeyError, TypeError, ValueError) as exc:
        raise UserError(f"placement is missing or has a malformed field ({exc}); expected 'topology' and 'layers'") from None
    if topology.nodes < 1 or topology.gpus_per_node < 1:
        raise UserError(f"placement topology {topology} must have at least one node and one GPU per node")
    if not layers:
        raise UserError("placement has no layers")
    ids = [e for devices in layers for experts in devices for e in experts]
    if not all(isinstance(e, int) and e >= 0 for e in ids):
        raise UserError("placement expert ids must be non-negative integers")
    num_experts = int(doc.get("num_experts", max(ids) + 1 if ids else 0))
    if not 0 < num_experts <= MAX_PLACED_EXPERTS or topology.devices > MAX_PLACED_EXPERTS:
        raise UserError(f"placement has {num_experts} experts on {topology.devices} devices; at most "
                        f"{MAX_PLACED_EXPERTS} of each are supported")
    placement = Placement(str(doc.get("policy", "unknown")), topology, layers, num_experts, dict(doc.get("metrics", {})))
    validate_placement(placement)
    return placement


def validate_placement(placement: Placement) -> None:
    """Check the structural invariants; raise `UserError` naming the first violation."""
    D = placement.topology.devices
    for l, devices in enumerate(placement.layers):
        if len(devices) != D:
            raise UserError(f"layer {l} lists {len(devices)} devices but the topology has {D}")
        seen = set()
        for d, experts in enumerate(devices):
            if len(set(experts)) != len(experts):
                raise UserError(f"layer {l} device {d} hosts an expert twice; replicas must be on distinct devices")
            if experts and max(experts) >= placement.num_experts:
                raise UserError(f"layer {l} device {d} hosts expert {max(experts)} but there are {placement.num_experts} experts")
            seen.update(experts)
        missing = sorted(set(range(placement.num_experts)) - seen)
        if missing:
            raise UserError(f"layer {l} places no replica of expert {missing[0]}; every expert needs a device")
