"""`--slo`'s one grammar (core/slo.py): what it reads, what it refuses in one line, and both targets' forms."""
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moeplan.core.errors import UserError
from moeplan.core.slo import KEYS, Slo, format_seconds, parse_slo

durations = st.floats(min_value=1e-6, max_value=1e4, allow_nan=False, allow_infinity=False)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(KEYS), durations, min_size=1))
def test_the_canonical_text_reads_back_to_the_same_limits(limits):
    slo = Slo(**{f"{k}_s": v for k, v in limits.items()})
    assert parse_slo(str(slo)) == slo


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=30))
def test_any_string_is_an_slo_or_one_line_error(text):
    try:
        slo = parse_slo(text)
    except UserError as exc:
        assert "\n" not in str(exc) and "--slo" in str(exc)
        return
    values = [v for _, v in slo.terms()]
    assert values and all(math.isfinite(v) and v > 0 for v in values)


@settings(max_examples=200, deadline=None)
@given(durations, st.sampled_from(["s", "ms", "us", ""]))
def test_units_scale_the_number(number, unit):
    text = f"{number!r}{unit}"
    scale = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "": 1.0}[unit]
    assert parse_slo(f"tpot={text}").tpot_s == pytest.approx(number * scale, rel=1e-12)


def test_the_engine_and_lambda_forms():
    assert parse_slo("tpot=35ms,ttft=2s") == Slo(tpot_s=0.035, ttft_s=2.0)
    assert parse_slo(" TTFT = 1.5s ") == Slo(ttft_s=1.5)
    assert parse_slo("5") == Slo(latency_s=5.0) == parse_slo("latency=5s") == parse_slo(5)
    assert parse_slo("5").for_lambda() == 5.0
    assert str(parse_slo("tpot=0.035")) == "tpot=35ms"
    assert format_seconds(2.0) == "2s"


@pytest.mark.parametrize("text, words", [
    ("", "needs a value"), ("tpot", "not a duration"), ("tpot=", "not a duration"), ("tpot=-1ms", "positive finite"),
    ("speed=3", "KEY=DURATION"), ("tpot=3ms,tpot=4ms", "twice"), ("nan", "positive finite"), ("-1", "must be a positive"), ("1e999", "finite"),
    ("tpot=3h", "not a duration"), ("0", "positive"),
])
def test_bad_strings_are_one_line(text, words):
    with pytest.raises(UserError, match=words) as exc:
        parse_slo(text)
    assert "\n" not in str(exc.value)


def test_each_target_refuses_the_other_form():
    with pytest.raises(UserError, match="does not apply to --target lambda"):
        parse_slo("tpot=35ms").for_lambda()
    with pytest.raises(UserError, match="does not apply to --target sglang"):
        parse_slo("5").for_engine("sglang")
