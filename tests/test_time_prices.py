"""The ILP's load cap chosen in the hardware profile's time units (issue 12, item 4 third point):
prices follow the profile, the priced objective counts what it says, and a dearer load never
buys a looser cap."""
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from moeplan.passes.cost.cost_model import COHERENT, STANDARD, ModelShape, Workload
from moeplan.passes.analysis.trace.synth_planted import synthesize_trace
from moeplan.passes.optimize.placement.schema import Topology
from moeplan.passes.optimize.placement.policies import PlacementRequest
from moeplan.passes.cost.time_prices import TimePrices, choose_load_cap, device_loads, priced_objective, time_prices
from moeplan.core.hardware import load_hardware

SHAPE = ModelShape(hidden=128, top_k=2, num_blocks=4, moe_blocks=(0, 1, 2, 3), attention_flops=1e5, expert_flops=5e4,
                   expert_bytes=1e5)
WORKLOAD = Workload((32,) * 8, 8)


@settings(max_examples=30, deadline=None)
@given(st.sampled_from(["cpu-gloo", "h100-sxm", "a100-sxm"]), st.sampled_from([2, 4, 8]), st.floats(1.5, 100.0),
       st.sampled_from([STANDARD, COHERENT]))
def test_prices_follow_the_profile(name, world, factor, mode):
    profile = load_hardware(name)
    base = time_prices(profile, SHAPE, WORKLOAD, world, 2, 16, mode)
    slow_links = replace(profile, bandwidth_bytes_per_s={k: v / factor for k, v in profile.bandwidth_bytes_per_s.items()})
    slow_compute = replace(profile, flops_per_s=profile.flops_per_s / factor)
    assert time_prices(slow_links, SHAPE, WORKLOAD, world, 2, 16, mode).remote_visit_s > base.remote_visit_s
    assert time_prices(slow_links, SHAPE, WORKLOAD, world, 2, 16, mode).load_excess_s == base.load_excess_s
    assert time_prices(slow_compute, SHAPE, WORKLOAD, world, 2, 16, mode).load_excess_s > base.load_excess_s
    assert base.free_excess == max(0.0, world / profile.parallel_ranks - 1)
    assert base.load_weight == pytest.approx(base.load_excess_s / base.remote_visit_s)


@pytest.fixture(scope="module")
def planted():
    return synthesize_trace(layers=4, experts=8, top_k=2, tokens=600, affinity=0.8, zipf=1.0, seed=3)


def test_the_priced_objective_counts_remote_slots_and_excess_load(planted):
    topo = Topology(1, 2)
    everywhere = np.ones((4, 8, 2), dtype=bool)  # every expert on both devices: nothing remote, loads split evenly
    loads = device_loads(planted, everywhere)
    assert loads.sum() == pytest.approx(planted.expert_loads().sum()) and np.allclose(loads[:, 0], loads[:, 1])
    prices = TimePrices(remote_visit_s=1.0, load_excess_s=1.0, free_excess=0.0)
    assert priced_objective(planted, everywhere, topo, prices, COHERENT)["objective_s"] == pytest.approx(0.0)
    halves = np.zeros((4, 8, 2), dtype=bool)
    halves[:, :4, 0] = halves[:, 4:, 1] = True
    j = priced_objective(planted, halves, topo, prices, COHERENT)
    excess = np.abs(device_loads(planted, halves)[:, 0] - device_loads(planted, halves)[:, 1]).sum() / 2 / planted.num_tokens
    assert j["excess_slots_per_token"] == pytest.approx(excess)
    assert j["objective_s"] == pytest.approx(j["remote_slots_per_token"] + excess)
    free = priced_objective(planted, halves, topo, replace(prices, free_excess=10.0), COHERENT)
    assert free["excess_slots_per_token"] == 0.0  # within the free share: no price


def test_a_dearer_load_never_buys_a_looser_cap(planted):
    request = PlacementRequest(topology=Topology(1, 2), policy="ilp", time_limit=20)
    cheap = {COHERENT: TimePrices(remote_visit_s=1.0, load_excess_s=0.0, free_excess=0.0)}
    dear = {COHERENT: TimePrices(remote_visit_s=1.0, load_excess_s=1e3, free_excess=0.0)}
    (loose, b_loose), rows_cheap = (lambda c: (c[0][COHERENT], c[1]))(choose_load_cap(planted, request, cheap))
    (tight, b_tight), rows_dear = (lambda c: (c[0][COHERENT], c[1]))(choose_load_cap(planted, request, dear))
    assert b_tight <= b_loose
    for rows, b in ((rows_cheap, b_loose), (rows_dear, b_tight)):
        best = min(rows, key=lambda r: r[COHERENT]["objective_s"])
        assert best["balance"] == b and best["chosen_for"] == [COHERENT]
    cheap_rows = {r["balance"]: r[COHERENT] for r in rows_cheap}
    assert cheap_rows[b_loose]["remote_slots_per_token"] == min(r["remote_slots_per_token"] for r in cheap_rows.values())
    dear_rows = {r["balance"]: r[COHERENT] for r in rows_dear}
    assert dear_rows[b_tight]["excess_slots_per_token"] <= min(r["excess_slots_per_token"] for r in dear_rows.values()) + 1e-3
