"""`moeplan diff --fail-on EXPR`: thresholds on how a figure may change from plan A to plan B.

Grammar (whitespace ignored):
    EXPR      := CHECK ("," CHECK)*
    CHECK     := NAME OP SIGNED
    NAME      := a figure name: [A-Za-z_][A-Za-z0-9_.\\[\\]@+-]*  (an alias such as seconds_per_token or
                 a dotted path under predicted, figures.py)
    OP        := ">" | "<" | ">=" | "<="
    SIGNED    := ["+" | "-"] NUMBER ["%" | UNIT]
    UNIT      := s | ms | us  (a time) | B | KB | MB | GB | KiB | MiB | GiB  (bytes) | usd  (a cost) | /s  (a rate)
`seconds_per_token>+5%` crosses when B rose by more than 5 % of A; `seconds_per_token>+2ms` when it
rose by more than 2 ms; `hit_ratio<-0.01` when B fell by more than 0.01 (absolute: the difference
B - A is compared); `cost>+0%` when the cost rose at all.

A figure with a dimension (a time, bytes, a cost, a rate: `dimension`) needs `%` or a unit of that
dimension: `seconds_per_token>5` used to mean "rose by 5 seconds", which nobody means; it is refused
in one line naming both forms. Ratios and fractions (hit_ratio, max_over_mean_load,
gpu_local_fraction, ...) take a plain number.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

NAME = r"[A-Za-z_][A-Za-z0-9_.\[\]@+\-]*?"
UNITS = {  # unit -> (dimension, factor to the figure's own unit: seconds, bytes, US dollars, per second)
    "s": ("time", 1.0), "ms": ("time", 1e-3), "us": ("time", 1e-6),
    "B": ("bytes", 1.0), "KB": ("bytes", 1e3), "MB": ("bytes", 1e6), "GB": ("bytes", 1e9),
    "KiB": ("bytes", 2.0 ** 10), "MiB": ("bytes", 2.0 ** 20), "GiB": ("bytes", 2.0 ** 30),
    "usd": ("cost", 1.0), "/s": ("rate", 1.0),
}
UNIT = "|".join(re.escape(u) for u in sorted(UNITS, key=len, reverse=True))
CHECK = re.compile(rf"^\s*({NAME})\s*(>=|<=|>|<)\s*([+-]?)\s*((?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?)\s*(%|{UNIT})?\s*$")
EXAMPLE_UNIT = {"time": "ms", "bytes": "KB", "cost": "usd", "rate": "/s"}


def dimension(name: str) -> str | None:
    """What a figure measures, read from its name: "rate" (…_per_s, throughput), "time" (seconds,
    latency, TPOT, TTFT, …_s), "bytes", "cost" (…_usd, cost); None for ratios, fractions and counts."""
    n = name.lower()
    last = re.split(r"[.\]]", n.rstrip("]"))[-1] or n
    if n.endswith("_per_s") or last == "throughput":
        return "rate"
    if "seconds" in n or last in ("latency", "tpot", "ttft") or last.endswith("_s") or ".latency_s" in n:
        return "time"
    if "bytes" in n or last == "memory_per_gpu":
        return "bytes"
    if "usd" in n or last == "cost":
        return "cost"
    return None


class FailOnError(ValueError):
    """A --fail-on expression that does not parse; the message says what is wrong, on one line."""


@dataclass(frozen=True)
class Check:
    name: str
    op: str
    threshold: float     # signed: a change (relative when `relative`, else in the figure's own unit) compared with `op`
    relative: bool
    text: str

    def change(self, a: float, b: float) -> float | None:
        """B - A (absolute), or (B - A) / |A| (relative; None when A is 0 and B differs)."""
        if not self.relative:
            return b - a
        if a == 0:
            return 0.0 if b == 0 else None
        return (b - a) / abs(a)

    def crossed(self, a: float, b: float) -> bool:
        delta = self.change(a, b)
        if delta is None:  # from zero: any rise crosses '>', any fall crosses '<'
            return (b > 0) if self.op.startswith(">") else (b < 0)
        limit = self.threshold / 100.0 if self.relative else self.threshold
        return {">": delta > limit, ">=": delta >= limit, "<": delta < limit, "<=": delta <= limit}[self.op]


def parse(expr: str) -> list:
    """[Check] of EXPR; raises FailOnError naming the first bad part."""
    if expr is None or not expr.strip():
        raise FailOnError("--fail-on is empty; give e.g. 'seconds_per_token>+5%,hit_ratio<-0.01'")
    checks = []
    for part in expr.split(","):
        m = CHECK.match(part)
        if not m:
            raise FailOnError(f"--fail-on part {part.strip()!r} is not NAME>CHANGE or NAME<CHANGE (e.g. "
                              "'seconds_per_token>+5%', 'seconds_per_token>+2ms', 'hit_ratio<-0.01')")
        name, op, sign, number, unit = m.groups()
        value = float(number) * (-1 if sign == "-" else 1)
        if not math.isfinite(value):
            raise FailOnError(f"--fail-on part {part.strip()!r}: the threshold must be a finite number")
        kind = dimension(name)
        if unit and unit != "%":
            unit_kind, factor = UNITS[unit]
            if unit_kind != kind:
                what = f"is a {kind}" if kind else "has no unit (a ratio, fraction or count)"
                raise FailOnError(f"--fail-on part {part.strip()!r}: {unit} is a unit of {unit_kind} but {name} {what}; "
                                  + (f"use {EXAMPLE_UNIT[kind]} or %" if kind else "give a plain number or %"))
            value *= factor
        elif not unit and kind is not None:
            raise FailOnError(f"--fail-on part {part.strip()!r}: {name} is a {kind}, so its change needs % or a unit: "
                              f"'{name}{op}{sign or '+'}{number}%' (relative to A) or '{name}{op}{sign or '+'}{number}"
                              f"{EXAMPLE_UNIT[kind]}' (absolute; units {', '.join(u for u, (k, _) in UNITS.items() if k == kind)})")
        checks.append(Check(name, op, value, unit == "%", part.strip()))
    return checks
