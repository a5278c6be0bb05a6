"""Sizing: solver invariants (hypothesis), ODS vs the exact monolithic optimum, infeasibility
messages, and the simulator on a hand-computed case."""
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moeplan.passes.optimize.serverless import billing as sc
from moeplan.passes.optimize.serverless import sizing
from moeplan.passes.optimize.serverless.sim import simulate
from moeplan.core.errors import UserError
from moeplan.core.platforms import load_platform


def make_facts(layers=2, experts=4, *, platform=None, param_bytes=200_000, d=512, token_bytes=1024.0):
    p = platform or load_platform(runtime_memory_mb=100, memory_options_mb=[128, 256, 512, 1024, 1769, 3072],
                                  max_replicas=4)
    lf = sc.LayerFacts(num_experts=experts, top_k=2, expert_param_bytes=param_bytes, expert_fixed_bytes=10_000.0,
                       expert_token_bytes=token_bytes, d_in=d, d_out=d, dense_param_bytes=300_000,
                       tokens_grid=(1, 64, 4096), threads=(1, 2),
                       expert_s_per_token=((4e-5, 6e-6, 4e-6), (3e-5, 4e-6, 2.5e-6)),
                       dense_s_per_token=(2e-5, 5e-6, 4e-6), mb_per_vcpu=p.mb_per_vcpu, max_vcpus=p.max_vcpus)
    return sc.ServerlessFacts(platform=p, layers=(lf,) * layers, head_param_bytes=100_000,
                              head_s_per_token=1e-7, tail_s_per_token=1e-6, tail_param_bytes=100_000)


loads_st = st.integers(1, 3).flatmap(lambda L: st.integers(2, 5).flatmap(
    lambda E: st.lists(st.lists(st.integers(0, 3000), min_size=E, max_size=E), min_size=L, max_size=L)))


def check_invariants(facts, loads, res, slo):
    p = facts.platform
    assert len(res.layers) == len(loads)
    for e, dec in enumerate(res.layers):
        assert dec.method in (sc.PIPELINED_S3, sc.S3, sc.DIRECT)
        assert len(dec.experts) == len(loads[e])  # exactly one (memory, replicas) choice per expert
        for ch, d in zip(dec.experts, loads[e]):
            assert ch.memory_mb in p.memory_options_mb
            assert 1 <= ch.replicas <= p.max_replicas
            r = math.ceil(d / ch.replicas) if d else 0
            assert float(sc.memory_need_mb(p, facts.layers[e], r)) <= ch.memory_mb + 1e-9  # memory fits
            if dec.method == sc.DIRECT:
                assert r * facts.layers[e].d_in <= p.payload_limit_bytes  # payload respected
    assert res.latency <= slo + 1e-6


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(loads=loads_st, slack=st.floats(1.0, 2.0))
def test_ods_solutions_satisfy_every_constraint(loads, slack):
    loads = np.array(loads)
    facts = make_facts(layers=loads.shape[0], experts=loads.shape[1])
    fastest = sizing.fastest_latency(facts, loads, sizing.DEFAULT_METHODS, sizing.DEFAULT_BETAS, 4096)
    slo = fastest * slack + 1e-9
    res = sizing.ods(facts, loads, slo, batch_tokens=4096, time_limit_s=5)
    check_invariants(facts, loads, res, slo)
    exact = sizing.solve_monolithic(facts, loads, slo, batch_tokens=4096, time_limit_s=5, formulation="frontier")
    check_invariants(facts, loads, exact, slo)
    assert exact.cost <= res.cost * (1 + 1e-9)  # the monolithic frontier MILP is the exact optimum


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(loads=st.lists(st.integers(1, 2000), min_size=2, max_size=3), slack=st.floats(1.0, 1.5))
def test_pair_and_frontier_formulations_agree(loads, slack):
    loads = np.array([loads])
    facts = make_facts(layers=1, experts=loads.shape[1])
    fastest = sizing.fastest_latency(facts, loads, (sc.S3,), (), 4096)
    modes = [[(sc.S3, 0)]]
    a = sizing.size_layers(facts, loads, fastest * slack + 1e-9, modes, batch_tokens=4096, formulation="pairs")
    b = sizing.size_layers(facts, loads, fastest * slack + 1e-9, modes, batch_tokens=4096, formulation="frontier")
    assert a.cost == pytest.approx(b.cost, rel=1e-6)


def test_infeasible_slo_names_the_constraint_and_the_closest_feasible_value():
    facts = make_facts()
    loads = np.full((2, 4), 500)
    fastest = sizing.fastest_latency(facts, loads, sizing.DEFAULT_METHODS, sizing.DEFAULT_BETAS, 4096)
    with pytest.raises(UserError) as err:
        sizing.ods(facts, loads, fastest * 0.5, batch_tokens=4096)
    msg = str(err.value)
    assert "SLO" in msg and f"--slo {math.ceil(fastest * 1000) / 1000:.3f}" in msg
    # and that value is indeed feasible
    sizing.ods(facts, loads, math.ceil(fastest * 1000) / 1000, batch_tokens=4096)


def test_payload_infeasible_for_direct_only():
    facts = make_facts(d=4096)
    loads = np.array([[20_000, 1, 1, 1], [1, 1, 1, 1]])  # 20000/4 replicas * 4 KB = 20 MB > 6 MB
    with pytest.raises(UserError) as err:
        sizing.ods(facts, loads, 1e6, methods=(sc.DIRECT,), batch_tokens=20_003)
    assert "payload" in str(err.value) and "closest feasible" in str(err.value)
    # with the S3 methods allowed it is feasible
    res = sizing.ods(facts, loads, 1e6, batch_tokens=20_003)
    assert res.layers[0].method != sc.DIRECT


def test_memory_infeasible_names_the_largest_option():
    facts = make_facts(param_bytes=4 * 1024 ** 3)
    with pytest.raises(UserError, match="memory constraint cannot be met.*largest memory option is 3072"):
        sizing.ods(facts, np.full((2, 4), 10), 1e6, batch_tokens=80)


def hand_facts():
    p = load_platform(s3_bandwidth_bytes_per_s=1e6, s3_latency_s=0.01, warm_start_s=0.02, billing_granularity_s=0,
                      price_per_gb_s=1e-5, price_per_request=0, runtime_memory_mb=0, memory_options_mb=[1769],
                      max_replicas=2)
    lf = sc.LayerFacts(num_experts=1, top_k=1, expert_param_bytes=100_000, expert_fixed_bytes=0.0,
                       expert_token_bytes=0.0, d_in=100, d_out=100, dense_param_bytes=0, tokens_grid=(1, 1000),
                       threads=(1,), expert_s_per_token=((1e-3, 1e-3),), dense_s_per_token=(0.0, 0.0))
    return sc.ServerlessFacts(platform=p, layers=(lf,))


def test_simulator_matches_a_hand_computed_case():
    facts = hand_facts()
    plan = [sizing.LayerDecision(sc.S3, 0, (sizing.ExpertChoice(1769, 1, 10),))]
    sim = simulate(facts, plan, np.array([[10]]), batch_tokens=10)
    t_head = 100_000 / 1e6 + 0.01 + 0.02                    # load weights + S3 round trip + warm start
    t_rep = t_head + 2 * 0.01 + 10 * (200 / 1e6 + 1e-3)      # method 2: 0.162 s
    assert sim.moe_cost == pytest.approx(t_rep * 1769 / 1024 * 1e-5)
    layer = max(t_rep, 0.03) + 0.01 + 10 * 100 / 1e6       # + t_S3 (download all outputs)
    assert sim.layer_latency[0] == pytest.approx(layer)
    assert sim.latency == pytest.approx(layer + 0.03)      # + T_head of the embedding function
    assert sim.throughput == pytest.approx(10 / sim.latency)


def test_simulator_invokes_more_replicas_when_real_loads_overflow_memory():
    p = load_platform(runtime_memory_mb=0, memory_options_mb=[1], max_replicas=8)
    facts = make_facts(layers=1, experts=1, platform=p, param_bytes=0, token_bytes=0.0, d=1024)
    # 1 MB holds (1 MB - 10 KB fixed) / 2 KB per token ~ 507 tokens per replica
    plan = [sizing.LayerDecision(sc.S3, 0, (sizing.ExpertChoice(1, 1, 100),))]
    sim = simulate(facts, plan, np.array([[2000]]), batch_tokens=2000)
    assert sim.overflows == [(0, 0, "memory", 4)]
