"""Work budgets for the placement ILP, so the same inputs give the same placement on any machine.

Why: a wall-clock deadline cuts a solve at a point that depends on how busy the machine is, so
the same trace gave different placements (and different bundle bytes) on a loaded and an idle
machine. Every limit that shapes the answer therefore counts work instead: coordinate sweeps,
exchange moves, branch-and-bound nodes, simplex iterations, LP size for the bound. Each is a
base figure times `effort` (default 1.0; 2.0 does about twice the work, 0.5 half). The wall-clock
time limit stays only as a safety net: when it is what stopped the solve, `timed_out` records it
and the placement says its bytes may not be reproducible.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

DEFAULT_EFFORT = 1.0


@dataclass
class WorkBudget:
    effort: float = DEFAULT_EFFORT
    deadline: float = math.inf  # time.perf_counter() value: the safety net only
    timed_out: bool = False
    mip_variables: int = 0  # variables of the step MIPs run so far (what the replica MIP budget meters)

    def scaled(self, base: float, least: int = 1) -> int:
        """A work count: `base` x effort, at least `least`."""
        return max(least, int(round(base * self.effort)))

    def expired(self) -> bool:
        """True once the safety deadline has passed (and from then on); records that it did."""
        if not self.timed_out and time.perf_counter() >= self.deadline:
            self.timed_out = True
        return self.timed_out

    def seconds_left(self) -> float:
        """Time limit to hand a solver: what is left of the safety net (never shapes a normal run)."""
        return max(self.deadline - time.perf_counter(), 0.01)

    def record(self, result) -> None:
        """Note a solver result that was stopped by its (safety) time limit."""
        if getattr(result, "status", None) == "time_limit":
            self.timed_out = True
