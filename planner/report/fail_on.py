"""`moeplan diff --fail-on EXPR`: thresholds on how a figure may change from plan A to plan B.

Grammar (whitespace ignored):
    EXPR      := CHECK ("," CHECK)*
    CHECK     := NAME OP SIGNED
    NAME      := a figure name: [A-Za-z_][A-Za-z0-9_.\\[\\]@+-]*  (an alias such as seconds_per_token or
                 a dotted path under predicted, figures.py)
    OP        := ">" | "<" | ">=" | "<="
    SIGNED    := ["+" | "-"] NUMBER ["%"]
`seconds_per_token>+5%` crosses when B rose by more than 5 % of A; `hit_ratio<-0.01` when B fell by
more than 0.01 (absolute: the difference B - A is compared); `cost>+0%` when the cost rose at all.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

NAME = r"[A-Za-z_][A-Za-z0-9_.\[\]@+\-]*?"
CHECK = re.compile(rf"^\s*({NAME})\s*(>=|<=|>|<)\s*([+-]?)\s*((?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?)\s*(%?)\s*$")


class FailOnError(ValueError):
    """A --fail-on expression that does not parse; the message says what is wrong, on one line."""


@dataclass(frozen=True)
class Check:
    name: str
    op: str
    threshold: float     # signed: a change (relative when `relative`) compared with `op`
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
                              "'seconds_per_token>+5%', 'hit_ratio<-0.01')")
        name, op, sign, number, pct = m.groups()
        value = float(number) * (-1 if sign == "-" else 1)
        if not math.isfinite(value):
            raise FailOnError(f"--fail-on part {part.strip()!r}: the threshold must be a finite number")
        checks.append(Check(name, op, value, pct == "%", part.strip()))
    return checks
