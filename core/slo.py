"""`--slo`: the one grammar of a latency objective, for every target that takes one.

    SLO   := SECONDS | TERM ("," TERM)*
    TERM  := KEY "=" VALUE
    KEY   := "tpot" | "ttft" | "latency"
    VALUE := NUMBER ["s" | "ms" | "us"]          (no unit: seconds)

`--slo 5` (a bare number) is the Lambda target's form: the end-to-end latency limit per batch, in
seconds; it is the same as `latency=5s`. The serving-engine targets (sglang, vllm, trtllm) take `tpot`
(time per output token, the mean decode step) and `ttft` (time to the first token), e.g.
`tpot=35ms,ttft=2s`. Every bad string is one line saying what is wrong and how to write it.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

from moeplan.core.cli_types import OneLineType
from moeplan.core.errors import UserError

KEYS = ("tpot", "ttft", "latency")
UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6}
EXAMPLE = "e.g. --slo tpot=35ms,ttft=2s (serving engines) or --slo 5 (lambda: seconds per batch)"
_VALUE = re.compile(r"^\s*([+-]?(?:[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?|nan|inf|infinity))\s*(s|ms|us)?\s*$",
                    re.IGNORECASE)


@dataclass(frozen=True)
class Slo:
    """Limits in seconds; None where the objective does not bound it."""

    tpot_s: float | None = None
    ttft_s: float | None = None
    latency_s: float | None = None

    def __str__(self) -> str:
        """The canonical text, which `parse_slo` reads back to an equal Slo."""
        return ",".join(f"{key}={format_seconds(value)}" for key, value in self.terms())

    def terms(self) -> list:
        """[(key, seconds)] of the bounded limits, in KEYS order."""
        return [(key, getattr(self, f"{key}_s")) for key in KEYS if getattr(self, f"{key}_s") is not None]

    def met_by(self, tpot_s: float, ttft_s: float) -> bool:
        """Whether a serving prediction's TPOT and TTFT are within the limits."""
        return (self.tpot_s is None or tpot_s <= self.tpot_s) and (self.ttft_s is None or ttft_s <= self.ttft_s)

    def for_lambda(self) -> float:
        """The Lambda target's latency limit per batch (seconds); one line where the SLO names another."""
        if self.latency_s is None or self.tpot_s is not None or self.ttft_s is not None:
            raise UserError(f"--slo {self} does not apply to --target lambda: give its end-to-end latency limit per "
                            f"batch, e.g. --slo 5 or --slo latency=5s (tpot and ttft apply to sglang, vllm, trtllm)")
        return self.latency_s

    def for_engine(self, target: str) -> Slo:
        """Self where it bounds TPOT or TTFT only; one line otherwise."""
        if self.latency_s is not None or (self.tpot_s is None and self.ttft_s is None):
            raise UserError(f"--slo {self} does not apply to --target {target}: give tpot and/or ttft, e.g. "
                            f"--slo tpot=35ms,ttft=2s (a latency per batch applies to --target lambda)")
        return self


def format_seconds(seconds: float) -> str:
    """The shortest spelling `parse_seconds` reads back to exactly `seconds`: 0.035 -> '35ms', 2.0 -> '2s'."""
    spellings = [f"{seconds / UNITS[unit]:.{digits}g}{unit}" for digits in range(1, 18) for unit in UNITS]
    exact = [s for s in spellings if float(s.rstrip("smu")) * UNITS[s.lstrip("0123456789.e+-")] == seconds]
    return min(exact, key=len) if exact else f"{seconds!r}s"


def _shown(text: str) -> str:
    """User text as an error line shows it: quoted with escapes where it is not printable."""
    return text if text.isprintable() else repr(text)


def parse_seconds(text: str, term: str) -> float:
    """A VALUE (seconds); `term` is the text the user wrote, for the error line."""
    match = _VALUE.match(text)
    if not match:
        raise UserError(f"--slo {_shown(term)} is not a duration: write a positive number with s, ms or us "
                        f"(no unit: seconds), {EXAMPLE}")
    seconds = float(match.group(1)) * UNITS[(match.group(2) or "s").lower()]
    if not (math.isfinite(seconds) and seconds > 0):
        raise UserError(f"--slo must be a positive finite duration, got {_shown(term)!r}; {EXAMPLE}")
    return seconds


def parse_slo(text) -> Slo:
    """The grammar above -> Slo; a one-line UserError for anything else. An Slo or a number (the Python
    API's `slo=5`) is taken as is."""
    if isinstance(text, Slo):
        return text
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        text = repr(float(text))
    if not isinstance(text, str) or not text.strip():
        raise UserError(f"--slo needs a value, {EXAMPLE}")
    if "=" not in text:
        return Slo(latency_s=parse_seconds(text, text.strip()))
    limits = {}
    for term in text.split(","):
        key, sep, value = term.partition("=")
        key = key.strip().lower()
        if not sep or key not in KEYS:
            raise UserError(f"--slo term '{_shown(term.strip())}' is not KEY=DURATION with KEY one of {', '.join(KEYS)}, {EXAMPLE}")
        if key in limits:
            raise UserError(f"--slo names {key} twice; give each of {', '.join(KEYS)} at most once, {EXAMPLE}")
        limits[key] = parse_seconds(value, term.strip())
    return Slo(**{f"{key}_s": value for key, value in limits.items()})


class SloType(OneLineType):
    """`--slo` for click: the text parsed to an Slo (failures read after the flag's name)."""

    name = "slo"

    def convert(self, value, param, ctx):
        try:
            return parse_slo(value)
        except UserError as exc:
            self.fail(str(exc).removeprefix("--slo "), param, ctx)
