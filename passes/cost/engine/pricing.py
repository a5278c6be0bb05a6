"""Price an engine step's ops: measured where the tables cover the op, the roofline elsewhere, and a
source on every price.

The rule, per op (`Pricer.price`):
* inside the measured range of its key (`grid.py`): the database's time; source
  "aiconfigurator-core 0.12.0 sglang 0.5.14 h100_sxm (measured)" (or "(analytic)" for the database's
  bandwidth formulas: element-wise ops);
* beyond it (more tokens, a longer context, a wider GEMM than ever measured): the roofline, scaled by
  the efficiency the database measured at the edge of its range (the edge's measured time over the
  edge's roofline time); source "roofline h100-sxm x ... efficiency at its grid edge";
* a key never measured, a precision or op the database does not time, no database for the GPU or
  aiconfigurator-core not installed: the roofline; source "roofline h100-sxm".
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from moeplan.passes.cost.engine import measured, roofline
from moeplan.passes.cost.engine import ops as O


@dataclass(frozen=True)
class StepPrice:
    """One step's time (seconds) and its parts: {(op name, source): seconds per step}."""

    seconds: float
    parts: dict = field(default_factory=dict)

    def table(self) -> list:
        """[{op, seconds, source}] in a fixed order (by op name, then source): plan.json's per-op prices."""
        return [{"op": name, "seconds": seconds, "source": source}
                for (name, source), seconds in sorted(self.parts.items())]

    def sources(self) -> dict:
        """{source: seconds per step}."""
        out = {}
        for (_, source), seconds in self.parts.items():
            out[source] = out.get(source, 0.0) + seconds
        return out


class Pricer:
    """Prices ops for one deployment on one hardware profile (`core/hardware.py`)."""

    def __init__(self, deployment, profile, use_measured: bool = True):
        self.profile, self.gpus_per_node = profile, deployment.gpus_per_node
        database = deployment.database if use_measured else None
        self.tables = measured.tables(*database) if database else None
        self.roofline_source = roofline.label(profile)
        self._units: dict = {}  # one price per op (all fields but `count`)

    def unit(self, op) -> tuple:
        """(seconds of one run, source) of a leaf op."""
        roof = roofline.price(op, self.profile, self.gpus_per_node)
        if self.tables is None:
            return roof, self.roofline_source
        edge = self.tables.grid.clamp(op)
        if edge is None:
            return roof, self.roofline_source
        got = self.tables.price(edge)
        if got is None:
            return roof, self.roofline_source
        if edge == op:
            kind = "measured" if got.tag in measured.MEASURED_TAGS else "analytic"
            return got.seconds, f"{self.tables.label} ({kind})"
        edge_roof = roofline.price(edge, self.profile, self.gpus_per_node)
        scale = got.seconds / edge_roof if edge_roof > 0 else 1.0
        return roof * scale, f"{self.roofline_source} x {self.tables.label} efficiency at its grid edge"

    def _module_missing(self, op) -> bool:
        """Whether the database has no time for this composite op (then its parts are priced)."""
        return self.tables is None or self.tables.price(replace(op, count=1.0)) is None

    def step(self, ops) -> StepPrice:
        """The time of a list of ops run one after another (each `count` times)."""
        parts: dict = {}
        total = 0.0
        for op in ops:
            seconds = self._add(op, parts, op.count)
            total += seconds
        return StepPrice(total, parts)

    def _add(self, op, parts: dict, count: float) -> float:
        if isinstance(op, O.Overlap):
            first, second = {}, {}
            a = sum(self._add(child, first, count * child.count) for child in op.first)
            b = sum(self._add(child, second, count * child.count) for child in op.second)
            kept = first if a >= b else second
            for key, seconds in kept.items():
                parts[key] = parts.get(key, 0.0) + seconds
            return max(a, b)
        if isinstance(op, O.MlaModule) and self._module_missing(op):
            return sum(self._add(part, parts, count * part.count) for part in op.parts)
        key = tuple(v for k, v in vars(op).items() if k != "count") + (op.__class__,)
        if key not in self._units:
            self._units[key] = self.unit(replace(op, count=1.0))
        seconds, source = self._units[key]
        key = (op.name, source)
        parts[key] = parts.get(key, 0.0) + seconds * count
        return seconds * count
