"""The request cost model the Lambda front functions run (runtime/lambda_/request_cost.py,
standard library only) agrees with the sizing cost model it mirrors (serverless/billing.py)."""
import math

from hypothesis import given, settings
from hypothesis import strategies as st

from moeplan.runtime.lambda_.request_cost import _expert_loads, _expert_u, _replica_seconds
from moeplan.passes.optimize.serverless import billing as sc
from moeplan.core.platforms import load_platform

PLATFORM = load_platform()
LAYER = sc.LayerFacts(num_experts=8, top_k=2, expert_param_bytes=3_000_000, expert_fixed_bytes=1e5, expert_token_bytes=2e3,
                      d_in=512, d_out=512, dense_param_bytes=1_000_000, tokens_grid=(8, 64, 512, 2048), threads=(1, 2),
                      expert_s_per_token=((2e-5, 1.5e-5, 1.2e-5, 1.1e-5), (1.2e-5, 9e-6, 7e-6, 6.5e-6)),
                      dense_s_per_token=(1e-4, 8e-5, 6e-5, 5e-5))


def spec_layer(method: str, beta: int) -> dict:
    return {"method": method, "beta": beta, "top_k": LAYER.top_k, "d_in": LAYER.d_in, "d_out": LAYER.d_out,
            "param_bytes": LAYER.expert_param_bytes, "tokens_grid": list(LAYER.tokens_grid), "threads": list(LAYER.threads),
            "s_per_token": [list(r) for r in LAYER.expert_s_per_token], "mb_per_vcpu": LAYER.mb_per_vcpu,
            "max_vcpus": LAYER.max_vcpus, "experts": []}


@settings(max_examples=200, deadline=None)
@given(method=st.sampled_from(sorted(sc.METHOD_IDS)), memory=st.sampled_from(PLATFORM.memory_options_mb),
       rows=st.integers(1, 5000), beta=st.integers(1, 512))
def test_replica_seconds_equal_the_sizing_models(method, memory, rows, beta):
    p = PLATFORM.to_dict()
    mine = _replica_seconds(p, spec_layer(method, beta), memory, rows, weights=True)
    theirs = float(sc.replica_time(PLATFORM, LAYER, sc.METHOD_IDS[method], memory, rows, beta))
    assert math.isclose(mine, theirs, rel_tol=1e-9)
    assert math.isclose(_expert_u(spec_layer(method, beta), memory, rows), float(LAYER.u(memory, rows)), rel_tol=1e-9)
    # warm containers skip the weights' download and its S3 round trip, nothing else
    warm = _replica_seconds(p, spec_layer(method, beta), memory, rows, weights=False)
    assert math.isclose(theirs - warm, LAYER.expert_param_bytes / PLATFORM.s3_bandwidth_bytes_per_s + PLATFORM.s3_latency_s,
                        rel_tol=1e-9)


@settings(max_examples=100, deadline=None)
@given(shares=st.lists(st.floats(0.0, 1.0), min_size=2, max_size=16), tokens=st.integers(1, 10_000),
       replicas=st.integers(1, 8))
def test_expected_loads_cover_every_tokens_choices(shares, tokens, replicas):
    total = sum(shares)
    if total <= 0:
        return
    layer = {"top_k": 2, "experts": [{"share": s / total, "replicas": replicas} for s in shares]}
    loads = _expert_loads(layer, tokens)
    for (prob, g, rows), x in zip(loads, layer["experts"]):
        pick = min(1.0, 2 * x["share"])
        assert 0.0 <= prob <= 1.0 and (prob == 0) == (pick == 0)
        if prob:
            assert 1 <= g <= replicas and g * rows >= tokens * pick / prob - 1e-6  # every expected row is served
