"""Dense-stage partitioning (HyPAD): merging, the exact DP, the latency search, the benchmark."""
import itertools
import json
import math

import pytest

from moeplan.passes.optimize.serverless import partition as P
from moeplan.core.errors import UserError
from moeplan.core.platforms import load_platform


def unit(name, segment, params=1 << 20, peak=2000.0, secs=2e-5, width=512):
    return P.DenseUnit((name,), segment, params, peak, width, width, (secs, secs / 1.6), (1, 2))


def chain(rng_seed=0, n=7, segments=3):
    import random

    rnd = random.Random(rng_seed)
    seg = sorted(rnd.randrange(segments) for _ in range(n))
    return [unit(f"u{k}", seg[k], params=rnd.choice([1 << 16, 64 << 20, 300 << 20]), peak=rnd.choice([500.0, 8000.0, 30000.0]),
                 secs=rnd.choice([1e-6, 3e-5, 1e-4])) for k in range(n)]


def contiguous_partitions(n):
    for cuts in itertools.product((0, 1), repeat=n - 1):
        groups, cur = [], [0]
        for k, c in enumerate(cuts, start=1):
            if c:
                groups.append(cur)
                cur = [k]
            else:
                cur.append(k)
        yield groups + [cur]


@pytest.mark.parametrize("seed", range(4))
def test_the_vertical_split_is_the_cheapest_contiguous_partition(seed):
    platform = load_platform()
    units = chain(seed)
    model = P.CostModel(units, platform, 4096, P.fine_memory_options(platform))
    dp = model.cost(P.vertical_split(model))
    brute = min(P.evaluate(units, platform, 4096, g, P.fine_memory_options(platform)).cost_per_request_usd
                for g in contiguous_partitions(len(units)))
    assert dp == pytest.approx(brute, rel=1e-12)


def test_simplify_merges_neighbours_within_five_percent_and_only_inside_a_segment():
    a, b, c = unit("a", 0, params=100 << 20), unit("b", 0, params=103 << 20), unit("c", 1, params=104 << 20)
    d = unit("d", 1, params=200 << 20)
    merged = P.simplify([a, b, c, d], tokens=16)
    assert [m.names for m in merged] == [("a", "b"), ("c",), ("d",)]
    assert merged[0].param_bytes == (203 << 20) and merged[0].s_per_token == pytest.approx((4e-5, 2 * 2e-5 / 1.6))


def test_hypad_is_no_dearer_than_a_single_function_and_meets_its_latency():
    platform = load_platform()
    for seed in range(3):
        units = chain(seed, n=9, segments=4)
        single = P.evaluate(units, platform, 4096, [list(range(len(units)))])
        ours = P.hypad(units, platform, 4096)
        assert ours.cost_per_request_usd <= single.cost_per_request_usd + 1e-15
        assert ours.latency_s <= single.latency_s + 1e-9 and ours.latency_limit_s == pytest.approx(single.latency_s)


def test_a_tight_latency_limit_buys_parallelism_or_memory_and_an_impossible_one_is_refused():
    platform = load_platform()
    units = [unit(f"u{k}", k // 2, secs=2e-4) for k in range(6)]
    free = P.hypad(units, platform, 8192, latency_limit_s=math.inf)
    tight = P.hypad(units, platform, 8192, latency_limit_s=0.6 * free.latency_s)
    assert tight.latency_s <= 0.6 * free.latency_s and tight.steps
    assert tight.cost_per_request_usd > free.cost_per_request_usd
    assert any(s.eta > 1 or s.memory_mb > free.slices[0].memory_mb for s in tight.slices)
    with pytest.raises(UserError, match="latency limit"):
        P.hypad(units, platform, 8192, latency_limit_s=1e-3)


def test_a_cut_whose_tensor_exceeds_the_payload_limit_goes_through_s3():
    platform = load_platform()
    units = [unit("a", 0), unit("b", 0)]
    small = P.CostModel(units, platform, 1000, payload_cuts=True)
    big = P.CostModel(units, platform, platform.payload_limit_bytes // 512 + 1, payload_cuts=True)
    default = P.CostModel(units, platform, 1000)  # as the bundle: every cut through S3
    assert default._out_time(0, 1000) >= platform.s3_latency_s and default._in_time(1, 1000) >= platform.s3_latency_s
    assert small._out_time(0, small.tokens) == pytest.approx(1000 * 512 / platform.f2f_bandwidth_bytes_per_s)
    assert small._in_time(1, small.tokens) == 0.0
    assert big._out_time(0, big.tokens) >= platform.s3_latency_s and big._in_time(1, big.tokens) >= platform.s3_latency_s


def test_benchmark_prints_the_table_as_json_for_a_profiled_model(tmp_path, capsys):
    from pathlib import Path

    from runtime_fixtures import small_model_dir

    from moeplan.passes.importers.resolve import import_file

    bench = import_file(Path(__file__).parent.parent / "benchmarks" / "partition.py")
    model = small_model_dir(tmp_path)
    assert bench.main(["--model", str(model), "--batch-tokens", "1024", "--profile-budget", "0",
                       "--cache-dir", str(tmp_path / "cache"), "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    schemes = {(r["memory_grid"], r["scheme"]) for r in result["rows"]}
    assert ("14 options", "HyPAD") in schemes and ("1 MB steps", "per stage") in schemes
    assert result["ratio_vs_single"] >= 1.0 - 1e-9 and result["target_ratio"] == 2.58
    assert isinstance(result["target_met"], bool)
    for r in result["ratios"].values():   # the floor caps every partition, HyPAD included
        assert r["max_possible_ratio_vs_single"] >= r["ratio_vs_single"] - 1e-9
        assert r["mopar_accounting"]["ratio"] >= 1.0 - 1e-9
    assert result["compute_floor_usd"] > 0 and "mopar_accounting" in result


# -- the compute floor and MOPAR's accounting ---------------------------------------------------

from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402


@st.composite
def floor_cases(draw):
    """Random units (thread counts above and below the vCPU share), a random contiguous slicing,
    tokens, payload cuts, with or without waits; memory and eta are drawn per slice in the test."""
    n = draw(st.integers(1, 7))
    segments = sorted(draw(st.lists(st.integers(0, 3), min_size=n, max_size=n)))
    threads = draw(st.sampled_from([(1,), (1, 2), (1, 2, 4, 8)]))
    units = [P.DenseUnit((f"u{k}",), segments[k], draw(st.integers(0, 400 << 20)), draw(st.floats(0, 4e4)),
                         draw(st.integers(0, 8192)), draw(st.integers(0, 8192)),
                         tuple(draw(st.floats(1e-8, 1e-3)) for _ in threads), threads) for k in range(n)]
    cuts = draw(st.lists(st.booleans(), min_size=n - 1, max_size=n - 1))
    bounds = [0] + [k + 1 for k, c in enumerate(cuts) if c] + [n]
    groups = [(a, b - 1) for a, b in zip(bounds, bounds[1:])]
    return units, groups, draw(st.integers(1, 20000)), draw(st.booleans()), draw(st.booleans()), draw(st.data())


@settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(floor_cases())
def test_no_partition_memory_or_eta_costs_less_than_the_compute_floor(case):
    from dataclasses import replace

    units, groups, tokens, payload, bare, data = case
    platform = replace(load_platform(), max_vcpus=data.draw(st.sampled_from([6.0, 1.5])))
    if bare:  # no waits, no rounding, no runtime: the floor is reached, so any slack in it shows
        platform = replace(platform, s3_latency_s=0.0, warm_start_s=0.0, s3_bandwidth_bytes_per_s=1e30,
                           f2f_bandwidth_bytes_per_s=1e30, billing_granularity_s=0.0, runtime_memory_mb=0.0)
    model = P.CostModel(units, platform, tokens, P.fine_memory_options(platform), payload_cuts=payload)
    slices = []
    for first, last in groups:
        eta = data.draw(st.integers(1, 8))
        need = model.min_memory(first, last, eta)
        if need is None:  # a slice over 10,240 MB cannot be deployed at all
            return
        at_threads = [t * int(platform.mb_per_vcpu) for t in units[first].threads if t * platform.mb_per_vcpu >= need]
        memory = data.draw(st.sampled_from(at_threads) if at_threads and data.draw(st.booleans())
                           else st.integers(need, 10240))
        slices.append(P.Slice(first, last, memory, eta))
    # billed_seconds forgives 1e-9 of a 1 ms granule per invocation: the only slack the bound needs
    assert P.compute_floor(units, platform, tokens) <= model.cost(slices) * (1 + 1e-9)


def test_the_floor_is_reached_by_compute_alone_at_its_best_thread_count():
    """Without waits or rounding, one unit at its best threads' memory costs the floor exactly."""
    from dataclasses import replace

    platform = replace(load_platform(), s3_latency_s=0.0, warm_start_s=0.0, s3_bandwidth_bytes_per_s=1e30,
                       billing_granularity_s=0.0, runtime_memory_mb=0.0)
    u = P.DenseUnit(("u",), 0, 0, 0.0, 0, 0, (4e-5, 1e-5), (1, 2))   # 2 threads are cheaper per vCPU-s
    model = P.CostModel([u], platform, 1000, P.fine_memory_options(platform))
    best = model.cost([P.Slice(0, 0, 2 * int(platform.mb_per_vcpu))])
    assert P.compute_floor([u], platform, 1000) == pytest.approx(best, rel=1e-12)


def test_hypad_on_the_example_model_is_no_cheaper_than_the_floor(tmp_path):
    from pathlib import Path

    from moeplan.passes.analysis.profile.operators import profile_model
    from moeplan.passes.importers import load_model

    loaded = load_model(str(Path(__file__).parent.parent / "examples" / "tiny_moe"))
    prof = profile_model(loaded.ir, loaded.module, budget_s=0, cache_dir=str(tmp_path), onnx_path=loaded.onnx_path)
    platform, tokens = load_platform(), 10240
    units = P.units_from_profile(loaded.ir, prof, tokens, loaded.module)
    floor = P.compute_floor(units, platform, tokens)
    for options in (None, P.fine_memory_options(platform)):
        ours = P.hypad(units, platform, tokens, memory_options=options)
        single = P.evaluate(units, platform, tokens, [list(range(len(units)))], options)
        assert floor <= ours.cost_per_request_usd <= single.cost_per_request_usd + 1e-15


def test_mopar_accounting_drops_the_runtime_and_ignores_memory_in_time():
    platform = load_platform()
    units = [unit("a", 0, params=100 << 20), unit("b", 0, params=1 << 20, secs=1e-4)]
    lam = P.CostModel(units, platform, 1000, P.fine_memory_options(platform))
    mop = P.CostModel(units, platform, 1000, P.fine_memory_options(platform), accounting="mopar")
    assert lam.need_mb(0, 1) == pytest.approx(platform.runtime_memory_mb + (101 << 20) / P.MB + 1000 * 3024 / P.MB)
    assert mop.need_mb(0, 1) == pytest.approx(((100 << 20) + 1000 * 3024) / P.MB)   # the largest unit alone
    small, big = (mop.invocations(P.Slice(0, 1, m)) for m in (256, 4096))
    assert small == big                                  # time does not depend on memory
    assert lam.invocations(P.Slice(0, 1, 256)) > lam.invocations(P.Slice(0, 1, 4096))
    with pytest.raises(ValueError):
        P.CostModel(units, platform, 1000, accounting="openfaas")
