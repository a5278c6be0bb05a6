"""Dense-stage partitioning (HyPAD): merging, the exact DP, the latency search, the benchmark."""
import itertools
import json
import math

import pytest

from moeplan.passes.optimize import partition as P
from moeplan.planner.errors import UserError
from moeplan.planner.platforms import load_platform


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
    import importlib.util
    from pathlib import Path

    from runtime_fixtures import small_model_dir

    spec = importlib.util.spec_from_file_location("bench_partition", Path(__file__).parent.parent / "benchmarks" / "partition.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    model = small_model_dir(tmp_path)
    assert bench.main(["--model", str(model), "--batch-tokens", "1024", "--profile-budget", "0",
                       "--cache-dir", str(tmp_path / "cache"), "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    schemes = {(r["memory_grid"], r["scheme"]) for r in result["rows"]}
    assert ("14 options", "HyPAD") in schemes and ("1 MB steps", "per stage") in schemes
    assert result["ratio_vs_single"] >= 1.0 - 1e-9 and result["target_ratio"] == 2.58
    assert isinstance(result["target_met"], bool)
