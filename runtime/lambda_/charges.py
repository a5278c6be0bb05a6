"""What AWS charges for a Lambda deployment's work: the one billing rule every cost figure uses.

Why one module, in the runtime: the rule (Lambda duration rounded up to the billing granularity,
1 ms, and billed per GB-second of configured memory; a fee per request; S3 PUT and GET fees; Step
Functions EXPRESS executions, a fee per execution and duration in 100 ms steps of 64 MB) prices the
sizing's candidates (passes/optimize/serverless/billing.py, partition.py, sim.py), the request cost
model the front function states per answer (request_cost.py), the report, and what a local run
recorded (planner/launch/lambda_cloud.py: LocalCloud.bill). Written once, they cannot disagree; in
the runtime so that the front, which has only the bundle, runs the same lines. Standard library
only. Prices and granularities come from the platform (core/platform_data/aws_lambda.yaml, with
their sources).

`billed_seconds` and `billed_gb_seconds` take floats or numpy arrays (the sizing prices whole
grids of candidates at once): `(1e-9 - x) // 1` is `-ceil(x - 1e-9)` for both, and the 1e-9 of a
granule forgiven keeps a duration computed as an exact multiple from being rounded up a step.
"""
from __future__ import annotations

MB_PER_GB = 1024.0


def billed_seconds(seconds, granularity: float):
    """Duration as billed: `seconds` rounded up to a multiple of `granularity` (0: not rounded)."""
    if granularity <= 0:
        return seconds
    return -((1e-9 - seconds / granularity) // 1) * granularity + 0.0  # + 0.0: never -0.0


def billed_gb_seconds(seconds, memory_mb, granularity: float):
    """GB-s billed for one invocation of `seconds` at `memory_mb` of configured memory."""
    return billed_seconds(seconds, granularity) * memory_mb / MB_PER_GB


def lambda_usd(gb_s, invocations, price_per_gb_s: float, price_per_request: float):
    """Dollars of Lambda: billed GB-s at the duration price plus each invocation's request fee."""
    return gb_s * price_per_gb_s + invocations * price_per_request


def invocation_usd(seconds, memory_mb, granularity: float, price_per_gb_s: float, price_per_request: float):
    """Dollars of one invocation of `seconds` at `memory_mb` (duration and request fee)."""
    return lambda_usd(billed_gb_seconds(seconds, memory_mb, granularity), 1, price_per_gb_s, price_per_request)


def express_gb_seconds(execution_seconds, prices) -> float:
    """GB-s billed for EXPRESS executions lasting `execution_seconds` (an iterable) each."""
    step, memory = float(prices["express_billing_granularity_s"]), float(prices["express_memory_mb"])
    return sum(billed_seconds(float(t), step) for t in execution_seconds) * memory / MB_PER_GB


def charges_usd(prices, *, gb_s: float, invocations: float, s3_puts: float, s3_gets: float, executions: int,
                express_gb_s: float, http_requests: int = 0) -> dict:
    """Dollars by what AWS bills them for, and their total. `prices`: a mapping with the platform's
    price_per_gb_s, price_per_request, s3_put_price, s3_get_price, express_request_price,
    express_price_per_gb_s and (with `http_requests`) http_request_price."""
    usd = {"lambda_duration": gb_s * prices["price_per_gb_s"],
           "lambda_requests": invocations * prices["price_per_request"],
           "s3_requests": s3_puts * prices["s3_put_price"] + s3_gets * prices["s3_get_price"],
           "express": executions * prices["express_request_price"] + express_gb_s * prices["express_price_per_gb_s"],
           "http": http_requests * prices.get("http_request_price", 0.0)}
    usd["total"] = sum(usd.values())
    return usd


def request_charges_usd(usd: dict, executions: int, prices) -> float:
    """The per-request fees of a `charges_usd` breakdown: everything but the billed durations."""
    return usd["lambda_requests"] + usd["s3_requests"] + executions * prices["express_request_price"] + usd["http"]


CHARGE_LABELS = {"lambda_duration": "Lambda duration", "lambda_requests": "Lambda requests", "s3_requests": "S3 requests",
                 "express": "Step Functions", "http": "API Gateway"}


def breakdown_text(usd: dict) -> str:
    """'Lambda duration $a, Lambda requests $b, ...' of a `charges_usd` breakdown (charges of $0 left out)."""
    return ", ".join(f"{label} ${usd[key]:.8f}" for key, label in CHARGE_LABELS.items() if usd.get(key))
