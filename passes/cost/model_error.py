"""How far apart two predicted times must be before the cost model tells them apart.

`MARGINAL = 0.06`: the calibrated cost model's error on this project's measured runs is about that
wide in the mode plans choose most (standard EP: -6.8 % .. +2.6 % on the demo's own calibration,
-6.3 % .. +5.1 % over three calibrations; docs/cost_model.md, "How close the demo comes"), so
candidates whose predicted times lie within 6 % of the chosen one are a toss-up on the prediction:
the report and compile call such a choice "marginal" rather than present it as a finding.
"""
from __future__ import annotations

MARGINAL = 0.06


def within_error(seconds: list, chosen: float, margin: float = MARGINAL) -> bool:
    """True when every predicted time in `seconds` is within `margin` (relative) of `chosen`."""
    return chosen > 0 and all(abs(s - chosen) <= margin * chosen for s in seconds)
