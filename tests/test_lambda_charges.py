"""The one billing rule (runtime/lambda_/charges.py): Lambda duration rounded up to the billing
granularity and priced per GB-s, request fees, S3 requests and EXPRESS executions, and every cost
path of the planner pricing an invocation through it (the sizing, the partition, the simulator, the
request cost model, a local run's recorded bill)."""
import math
import re
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moeplan.core.platforms import load_platform
from moeplan.runtime.lambda_.charges import (billed_gb_seconds, billed_seconds, breakdown_text, charges_usd,
                                             express_gb_seconds, invocation_usd, request_charges_usd)

ROOT = Path(__file__).resolve().parents[1]
PLATFORM = load_platform()
PRICES = PLATFORM.to_dict()
GRANULARITY = st.sampled_from([0.001, 0.1, 0.0005, 1.0])
SECONDS = st.floats(0.0, 900.0, allow_nan=False)


def test_billing_rounds_up_to_the_millisecond_and_prices_gb_seconds():
    g = PLATFORM.billing_granularity_s
    assert billed_seconds(0.1231, g) == pytest.approx(0.124)
    assert billed_seconds(0.124, g) == pytest.approx(0.124)  # an exact multiple is not rounded a step up
    assert billed_seconds(0.0, g) == 0.0 and math.copysign(1.0, billed_seconds(0.0, g)) == 1.0  # never -0.0
    assert invocation_usd(0.5, 1024, g, PLATFORM.price_per_gb_s, PLATFORM.price_per_request) == \
        pytest.approx(0.5 * 1.0 * 0.0000166667 + 0.0000002)


@settings(max_examples=300, deadline=None)
@given(seconds=SECONDS, granularity=GRANULARITY)
def test_billed_duration_is_the_least_whole_number_of_granules_not_below_the_duration(seconds, granularity):
    billed = billed_seconds(seconds, granularity)
    granules = billed / granularity
    assert abs(granules - round(granules)) < 1e-6 * max(1.0, granules)  # a whole number of granules
    assert billed >= seconds - 1e-9 * granularity * (1 + 1e-6)  # never below (less the 1e-9 of a granule forgiven)
    assert billed < seconds + granularity  # and the least such number
    assert billed == math.ceil(seconds / granularity - 1e-9) * granularity  # the ceil it is written as
    assert billed_seconds(seconds, 0.0) == seconds  # no granularity: billed as measured


@settings(max_examples=200, deadline=None)
@given(a=SECONDS, b=SECONDS, granularity=GRANULARITY, memory=st.sampled_from(PLATFORM.memory_options_mb))
def test_billing_is_monotone_and_gb_seconds_scale_with_memory(a, b, granularity, memory):
    lo, hi = sorted((a, b))
    assert billed_seconds(lo, granularity) <= billed_seconds(hi, granularity)
    assert billed_gb_seconds(lo, memory, granularity) == pytest.approx(billed_seconds(lo, granularity) * memory / 1024)
    assert billed_gb_seconds(lo, 2 * memory, granularity) == pytest.approx(2 * billed_gb_seconds(lo, memory, granularity))


@settings(max_examples=100, deadline=None)
@given(seconds=st.lists(SECONDS, min_size=1, max_size=20), granularity=GRANULARITY,
       memory=st.sampled_from(PLATFORM.memory_options_mb))
def test_arrays_are_billed_as_each_element_alone(seconds, granularity, memory):
    """The sizing prices grids of candidates at once: an array must bill as its elements one by one."""
    together = invocation_usd(np.asarray(seconds), np.full(len(seconds), memory), granularity,
                              PLATFORM.price_per_gb_s, PLATFORM.price_per_request)
    alone = [invocation_usd(s, memory, granularity, PLATFORM.price_per_gb_s, PLATFORM.price_per_request) for s in seconds]
    assert together.tolist() == alone


@settings(max_examples=100, deadline=None)
@given(gb_s=st.floats(0, 1e4), invocations=st.floats(0, 1e4), puts=st.floats(0, 1e4), gets=st.floats(0, 1e4),
       runs=st.lists(st.floats(0, 300), max_size=5), http=st.integers(0, 3))
def test_charges_add_up_to_their_total_and_the_request_fees_are_all_but_the_durations(gb_s, invocations, puts, gets,
                                                                                      runs, http):
    prices = dict(PRICES, http_request_price=PLATFORM.http_api_request_price)
    express = express_gb_seconds(runs, prices)
    usd = charges_usd(prices, gb_s=gb_s, invocations=invocations, s3_puts=puts, s3_gets=gets, executions=len(runs),
                      express_gb_s=express, http_requests=http)
    parts = [v for k, v in usd.items() if k != "total"]
    assert usd["total"] == pytest.approx(sum(parts)) and min(parts) >= 0
    assert usd["s3_requests"] == pytest.approx(puts * PLATFORM.s3_put_price + gets * PLATFORM.s3_get_price)
    durations = gb_s * PLATFORM.price_per_gb_s + express * PLATFORM.express_price_per_gb_s
    assert request_charges_usd(usd, len(runs), prices) == pytest.approx(usd["total"] - durations, abs=1e-12)
    assert express == pytest.approx(sum(math.ceil(t / 0.1 - 1e-9) * 0.1 for t in runs) * 64 / 1024)


def test_breakdown_text_names_each_charge_and_leaves_out_the_free_ones():
    usd = charges_usd(dict(PRICES), gb_s=2.0, invocations=10, s3_puts=3, s3_gets=0, executions=1, express_gb_s=0.0625)
    text = breakdown_text(usd)
    assert text.startswith("Lambda duration $0.00003333, Lambda requests $0.00000200, S3 requests $0.00001500, ")
    assert "Step Functions $0.00000204" in text and "API Gateway" not in text


@settings(max_examples=50, deadline=None)
@given(seconds=st.floats(0.001, 60), memory=st.sampled_from(PLATFORM.memory_options_mb), replicas=st.integers(1, 8))
def test_the_sizing_and_the_request_cost_model_bill_an_invocation_alike(seconds, memory, replicas):
    """The sizing's expert cost (vectorised) and the request cost model's bill price one invocation the same."""
    from moeplan.passes.optimize.serverless import billing as sc
    from moeplan.runtime.lambda_.request_cost import _Bill

    bill = _Bill(PRICES)
    bill.invoke(seconds, memory, replicas)
    usd = charges_usd(PRICES, gb_s=bill.gb_s, invocations=bill.invocations, s3_puts=0, s3_gets=0, executions=0,
                      express_gb_s=0.0)
    assert float(sc.expert_cost(PLATFORM, memory, replicas, seconds)) == pytest.approx(usd["total"], rel=1e-12)


# what the rule is written as elsewhere: a ceil of a duration over a granularity, a price per GB-s
# multiplied in, MB turned to GB beside a price
COPIES = (re.compile(r"ceil\([^)\n]*granularity|ceil\((\w+\.)?(seconds|t) */"), re.compile(r"\* *[\w.\[\]\"']*price_per_gb_s"),
          re.compile(r"price_per_gb_s[\"'\]]* *\*"), re.compile(r"/ *1024(\.0)?\b[^\n]*price"))


def test_the_billing_rule_is_written_once():
    found = []
    for folder in ("runtime", "core", "passes", "backends", "planner", "api", "benchmarks"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path.name == "charges.py":
                continue
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if any(p.search(line) for p in COPIES):
                    found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not found, "the billing rule belongs in runtime/lambda_/charges.py:\n" + "\n".join(found)
