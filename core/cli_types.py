"""Click parameter types for numeric flags: every bad value is a usage error, never a traceback.

Their messages are predicates ("must be a positive number, got 'nan'") that the CLI prefixes
with the flag (`errors.one_line_usage_error`): `error: --slo must be a positive number, got '-1'`.

`float` accepts `nan`, `inf` and negatives, and a time limit of `nan` switched the solver's
limit off; these types refuse such values where click parses the flag, so the command never
sees them. The CLI prints click's usage errors as one `error:` line with exit code 2.
"""
from __future__ import annotations

import math

import click

INT64_MAX = (1 << 63) - 1
SEED_MAX = (1 << 32) - 1  # numpy's legacy seeding and torch.manual_seed both take 0..2**32-1 everywhere


class OneLineType(click.ParamType):
    """Marks our types: their failure messages read after the flag's name."""


class FiniteFloat(OneLineType):
    """A finite float within [low, high]; `positive` excludes 0 (the low bound itself)."""

    name = "number"

    def __init__(self, low: float | None = None, high: float | None = None, positive: bool = False):
        self.low, self.high, self.positive = low, high, positive

    def convert(self, value, param, ctx):
        if isinstance(value, float) and math.isfinite(value):
            number = value
        else:
            try:
                number = float(value)
            except (TypeError, ValueError):
                self.fail(f"must be a number, got {value!r}", param, ctx)
        if not math.isfinite(number):
            self.fail(f"must be a finite number, got {value!r}", param, ctx)
        if self.positive and number <= 0:
            self.fail(f"must be a positive number, got {value!r}", param, ctx)
        if self.low is not None and number < self.low:
            self.fail(f"must be at least {self.low:g}, got {value!r}", param, ctx)
        if self.high is not None and number > self.high:
            self.fail(f"must be at most {self.high:g}, got {value!r}", param, ctx)
        return number


class BoundedInt(OneLineType):
    """An integer within [low, high] (both inclusive)."""

    name = "integer"

    def __init__(self, low: int | None = None, high: int | None = INT64_MAX):
        self.low, self.high = low, high

    def convert(self, value, param, ctx):
        if isinstance(value, int) and not isinstance(value, bool):
            number = value
        else:
            try:
                number = int(str(value).strip(), 10)
            except (TypeError, ValueError):
                self.fail(f"must be a whole number, got {value!r}", param, ctx)
        if self.low == 1 and number < 1:
            self.fail(f"must be a positive integer, got {number}", param, ctx)
        if self.low is not None and number < self.low:
            self.fail(f"must be at least {self.low}, got {number}", param, ctx)
        if self.high is not None and number > self.high:
            self.fail(f"must be at most {self.high}, got {number}", param, ctx)
        return number


class NonEmptyText(OneLineType):
    """A string with something in it besides whitespace (an image name, a URL)."""

    name = "text"

    def convert(self, value, param, ctx):
        text = str(value)
        if not text.strip():
            self.fail("must not be empty", param, ctx)
        if any(ord(c) < 32 for c in text):
            self.fail(f"must not hold control characters, got {text!r}", param, ctx)
        return text


POSITIVE_FLOAT = FiniteFloat(positive=True)
NON_NEGATIVE_FLOAT = FiniteFloat(low=0.0)
FRACTION = FiniteFloat(low=0.0, high=1.0)
OPEN_FRACTION = FiniteFloat(positive=True, high=1.0)
POSITIVE_INT = BoundedInt(low=1)
NON_NEGATIVE_INT = BoundedInt(low=0)
SEED = BoundedInt(low=0, high=SEED_MAX)
ONNX_OPSET = BoundedInt(low=18, high=24)  # torch's dynamo exporter writes 18 and later (checked with onnx 1.x)
NON_EMPTY_TEXT = NonEmptyText()
