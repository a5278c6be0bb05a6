"""The typed plan sections (core/plan_sections.py): attribute access, every key kept, plan.json bytes unchanged."""
import json
from pathlib import Path

import pytest

from moeplan.core.plan import Plan
from moeplan.core.plan_sections import Communication, Placement, Predicted

ROOT = Path(__file__).resolve().parents[1]


def test_a_section_keeps_every_key_it_was_given_in_order_and_adds_none():
    doc = {"mode": "coherent", "target_specific": {"x": 1}, "capacity": None, "gating": "dynamic"}
    comm = Communication.from_json(doc)
    assert comm.mode == "coherent" and comm.capacity is None and comm.expert_cache is None
    assert list(comm.to_json()) == list(doc) and comm.to_json() == doc  # the explicit null is kept, nothing added
    assert comm["target_specific"] == {"x": 1} and comm.extra == {"target_specific": {"x": 1}}
    assert "expert_cache" not in comm and comm.get("expert_cache", 7) == 7 and {**comm} == doc
    assert comm == doc and Communication.from_json({}) == {} and Communication.from_json({}).to_json() == {}
    with pytest.raises(KeyError):
        comm["expert_cache"]


def test_plans_become_typed_and_read_back_byte_for_byte():
    plan = Plan(target="torchrun", model={}, topology={"nodes": 1, "gpus_per_node": 2},
                placement={"policy": "ilp", "layers": []}, communication={"mode": "standard"},
                predicted={"max_over_mean_load": 1.0000000123, "own": [1, 2]})
    assert isinstance(plan.placement, Placement) and isinstance(plan.predicted, Predicted)
    assert plan.placement.policy == "ilp" and plan.communication.mode == "standard"
    assert plan.as_written().predicted.max_over_mean_load == 1.0 and plan.predicted["own"] == [1, 2]
    assert Plan.from_json(plan.to_json()).to_json() == plan.to_json()


def test_a_written_plan_reads_back_byte_for_byte():
    text = (ROOT / "examples" / "ci" / "plan.json").read_text()
    plan = Plan.from_json(text)
    assert plan.to_json() == text and isinstance(plan.communication, Communication)
    assert plan.placement.layers == json.loads(text)["placement"]["layers"]
