"""The SLO search (passes/cost/engine/slo_search.py): its choice meets the SLO by the same predictor, no
deployment on fewer GPUs meets it, its memory fits, finalists are priced under the real placement, and
what meets nothing is one line."""
import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moeplan.core.errors import UserError
from moeplan.core.hardware import load_hardware
from moeplan.core.slo import Slo, parse_slo
from moeplan.passes.cost.engine import slo_search as S
from moeplan.passes.cost.engine.model_shape import engine_model
from moeplan.passes.cost.engine.prediction import Routing, predict_serving

CONFIGS = Path(__file__).resolve().parents[1] / "examples" / "configs"
WORKLOAD = "64x1024+64"


def model_of(name):
    return engine_model(json.loads((CONFIGS / f"{name}.json").read_text()), name)


QWEN, H100 = model_of("qwen3-30b-a3b"), load_hardware("h100-sxm")


def run(slo, model=QWEN, **kw):
    kw.setdefault("max_gpus", 8)
    return S.search(model, "sglang", "h100-sxm", H100, WORKLOAD, parse_slo(slo), use_measured=False, **kw)


def every_candidate(model, engine, gpus_limit, workload):
    """Every screened candidate on fewer than `gpus_limit` GPUs, priced by predict_serving directly."""
    out = []
    for gpus, nodes, gpn in S.gpu_counts(8, 64):
        if gpus >= gpus_limit:
            break
        for c in S.screen_candidates(engine, gpus, nodes, gpn, S.parse_workload(workload), False, model.num_experts):
            out.append(c)
    return out


def meets(model, c, slo, workload=WORKLOAD, routing=None):
    dep = c.deployment("sglang", "h100-sxm")
    p = predict_serving(model, dep, workload, routing, profile=H100, use_measured=False)
    ttft = S.queued_ttft(p.ttft_s, p.prefill_s, p.tpot_s, S.parse_workload(workload), p.running_requests)
    return p.fits and slo.met_by(p.tpot_s, ttft), p


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from([8, 12, 20, 40]), st.sampled_from([None, 0.5, 3.0]))
def test_the_choice_meets_the_slo_fits_and_nothing_on_fewer_gpus_does(tpot_ms, ttft_s):
    slo = Slo(tpot_s=tpot_ms / 1e3, ttft_s=ttft_s)
    try:
        result = run(str(slo))
    except UserError as exc:  # then no candidate up to 8 GPUs meets it either
        assert "no deployment up to 8" in str(exc)
        assert not any(meets(QWEN, c, slo)[0] for c in every_candidate(QWEN, "sglang", 16, WORKLOAD))
        return
    chosen = result.chosen.candidate
    ok, p = meets(QWEN, chosen, slo)
    assert ok and p.memory_per_gpu_bytes <= H100.device_memory_bytes
    assert result.prediction.tpot_s == p.tpot_s
    assert not any(meets(QWEN, c, slo)[0] for c in every_candidate(QWEN, "sglang", chosen.gpus, WORKLOAD))
    same_count = [p for p in result.screened if p.candidate.gpus == chosen.gpus and p.meets]
    assert result.chosen.output_tokens_per_s_per_gpu >= max(p.output_tokens_per_s_per_gpu for p in same_count) * (1 - S.TIE)


def test_memory_sets_the_floor_and_counts_below_it_are_not_priced():
    result = S.search(model_of("mixtral-8x7b"), "sglang", "h100-sxm", H100, "256x4096+256", Slo(tpot_s=0.2),
                      max_gpus=16, use_measured=False)
    assert result.memory_floor_gpus == 2 and result.chosen.candidate.gpus >= 2
    assert all(not p.fits and p.tpot_s is None for p in result.screened if p.candidate.gpus < 2)
    assert result.chosen.memory_per_gpu_bytes <= H100.device_memory_bytes


def test_the_search_stops_one_count_past_the_choice_and_the_frontier_is_undominated():
    result = run("tpot=40ms", max_gpus=64)
    assert result.counts_tried[-1] == 2 * result.chosen.candidate.gpus
    frontier = result.frontier()
    for p in frontier:
        assert not any(q.tpot_s < p.tpot_s and q.output_tokens_per_s_per_gpu > p.output_tokens_per_s_per_gpu
                       for q in result.screened if q.fits)
    doc = result.to_json()
    assert doc["slo"] == "tpot=40ms" and doc["chosen"]["meets_slo"] and doc["why"]
    assert json.loads(json.dumps(doc)) == run("tpot=40ms", max_gpus=64).to_json()  # same inputs, same result


def test_finalists_are_priced_under_the_real_placement_with_redundant_slots():
    from moeplan.passes.analysis.trace.format import load_trace
    from moeplan.passes.optimize.placement.policies import PlacementRequest, plan_placement
    from moeplan.passes.optimize.placement.schema import Topology

    trace = load_trace(Path(__file__).resolve().parents[1] / "examples" / "ci" / "mixtral-8x7b.trace.npz")
    placements = {}

    def route(c):
        request = PlacementRequest(topology=Topology(c.nodes, c.gpus_per_node), policy="eplb",
                                   redundant=c.redundant_experts)
        placements[c] = plan_placement(trace, request)
        return Routing.placed(trace, placements[c])

    mixtral = model_of("mixtral-8x7b")
    result = S.search(mixtral, "sglang", "h100-sxm", H100, WORKLOAD, Slo(tpot_s=0.03), max_gpus=8, route=route,
                      use_measured=False, finalists=2)
    chosen = result.chosen
    assert chosen.routing == "trace" and set(placements) == {p.candidate for p in result.finalists}
    assert {p.candidate.redundant_experts // p.candidate.moe_ep for p in result.finalists} <= {0, 1, 2}
    ok, p = meets(mixtral, chosen.candidate, Slo(tpot_s=0.03),
                  routing=Routing.placed(trace, placements[chosen.candidate]))
    assert ok and p.tpot_s == chosen.tpot_s and p.max_over_mean_load > 1.0


def test_nothing_meets_is_one_line_naming_the_closest():
    with pytest.raises(UserError, match=r"no deployment up to 8 h100-sxm GPUs meets --slo tpot=1us .* the best is 8 GPUs") as exc:
        run("tpot=1us")
    assert "\n" not in str(exc.value)
    with pytest.raises(UserError, match="holds the model"):
        S.search(model_of("deepseek-v3"), "sglang", "h100-sxm", H100, WORKLOAD, Slo(tpot_s=1), max_gpus=8,
                 use_measured=False)


def test_engines_search_the_layouts_they_can_run():
    assert S.attention_choices("trtllm", 16, 8) == [1, 16]
    assert S.attention_choices("sglang", 8, 8) == [1, 2, 4, 8]
    assert S.attention_choices("vllm", 16, 8) == [2, 4, 8, 16]
    assert S.gpu_counts(8, 64) == [(1, 1, 1), (2, 1, 2), (4, 1, 4), (8, 1, 8), (16, 2, 8), (32, 4, 8), (64, 8, 8)]
    assert S.running_choices(512, 16) == [512, 256, 128] and S.running_choices(8, 8) == [8]
    with pytest.raises(UserError, match="does not apply to --target sglang"):
        run("5")
