"""benchmarks/placement_deployment.py: each corpus case is priced on a production config of its own
architecture with the trace's experts, top-k and layers, and each row reports the faster mode of
the cost model's two predictions on the held-out routing."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from moeplan.passes.analysis.trace.synth_planted import synthesize_trace
from moeplan.passes.cost.by_predicted_time import TIE
from moeplan.passes.optimize.placement.schema import Topology
from moeplan.passes.optimize.placement.policies import PlacementRequest, plan_placement
from moeplan.passes.importers.resolve import import_file
from moeplan.passes.cost.options import parse_workload

BENCH = Path(__file__).parent.parent / "benchmarks"


@pytest.fixture(scope="module")
def deployment():
    import sys

    sys.path.insert(0, str(BENCH))
    return import_file(BENCH / "placement_deployment.py")


def _case(source: dict, groups: int = 0):
    return SimpleNamespace(source=source, deepseek_shaped=groups > 0)


def test_each_case_keeps_its_routing_shape_at_its_architectures_production_width(deployment):
    trace = synthesize_trace(layers=3, experts=16, top_k=2, tokens=64, affinity=0.5, zipf=1.0, seed=0)
    qwen = deployment.deployment_config(_case({"trained": {"arch": "qwen3_moe"}}), trace)
    assert (qwen["model_type"], qwen["hidden_size"], qwen["moe_intermediate_size"]) == ("qwen3_moe", 2048, 768)
    assert (qwen["num_experts"], qwen["num_experts_per_tok"], qwen["num_hidden_layers"]) == (16, 2, 3)
    olmoe = deployment.deployment_config(_case({"trained": {"arch": "olmoe"}}), trace)
    assert (olmoe["model_type"], olmoe["num_experts"], olmoe["num_hidden_layers"]) == ("olmoe", 16, 3)
    drift = deployment.deployment_config(_case({"drift": {}}), trace)  # no architecture: Mixtral's widths
    assert (drift["model_type"], drift["hidden_size"], drift["num_local_experts"], drift["num_hidden_layers"]) == \
        ("mixtral", 4096, 16, 3)
    deepseek = deployment.deployment_config(_case({"drift": {}}, groups=8), trace)
    assert deepseek == json.loads((deployment.CONFIGS / "deepseek-v3.json").read_text())


def test_a_row_reports_the_faster_mode_and_no_call_overhead_is_never_slower(deployment, tmp_path):
    trace = synthesize_trace(layers=2, experts=8, top_k=2, tokens=256, affinity=0.9, zipf=0.5, seed=1)
    shape = deployment.deployment_shape(deployment.deployment_config(_case({"drift": {}}), trace), tmp_path)
    assert shape.top_k == 2 and shape.hidden == 4096 and len(shape.moe_blocks) == 2
    placement = plan_placement(trace, PlacementRequest(Topology(2, 2), "ilp", balance=1.0))
    workload = parse_workload("8x8+2")
    rows = {label: deployment.price(placement, shape, workload, trace, hardware)
            for label, hardware in deployment.profiles().items()}
    assert set(rows) == {"h100-sxm", "h100-sxm, no op overhead"}
    for row in rows.values():
        std, coh = row["standard"]["tokens_per_second"], row["coherent"]["tokens_per_second"]
        # coherent only where it is faster by more than the tie margin, as `--mode auto` decides
        assert row["best_mode"] == ("coherent" if 1 / coh < (1 / std) * (1 - TIE) else "standard")
        assert row["tokens_per_second"] == row[row["best_mode"]]["tokens_per_second"]
        assert np.isclose(row["standard"]["total_bytes_per_token"], rows["h100-sxm"]["standard"]["total_bytes_per_token"])
    for mode in ("standard", "coherent"):
        assert rows["h100-sxm, no op overhead"][mode]["tokens_per_second"] > rows["h100-sxm"][mode]["tokens_per_second"]
