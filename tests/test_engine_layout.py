"""The engine targets' deployment record (core/engine_layout.py, plan.json `deployment`): what it holds, the
layouts it refuses, and the plan it reads back from."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moeplan.core.engine_layout import (attention_dp_for, engine_deployment, layout_problems, moe_a2a_for,
                                        per_attention_replica, plan_layout_problems)
from moeplan.core.errors import UserError
from moeplan.core.plan import Plan
from moeplan.core.plan_sections import Deployment


def _plan(target="sglang", nodes=2, gpus=8, deployment=None, ep=None, redundant=16):
    record = deployment or engine_deployment(target, nodes, gpus, attention_dp=nodes * gpus, moe_ep=nodes * gpus,
                                             redundant_experts=redundant, max_running_requests=256)
    return Plan(target=target, model={}, topology={"nodes": nodes, "gpus_per_node": gpus}, placement={},
                communication={"ep_size": ep or nodes * gpus, "redundant": redundant}, predicted={},
                deployment={**record, "kubernetes": True, "image": "img"})


def test_the_record_is_a_typed_section_that_reads_back_byte_for_byte():
    plan = _plan()
    assert isinstance(plan.deployment, Deployment)
    assert (plan.deployment.attention_tp, plan.deployment.attention_dp) == (1, 16)
    assert (plan.deployment.moe_ep, plan.deployment.moe_tp, plan.deployment.redundant_experts) == (16, 1, 16)
    assert plan.deployment.max_running_requests == 256 and plan.deployment.moe_a2a == "deepep"
    assert plan.deployment.chosen_by == "flags" and plan.deployment.hardware is None
    assert plan.deployment.get("kubernetes") is True and plan.deployment["image"] == "img"
    assert Plan.from_json(plan.to_json()).to_json() == plan.to_json()
    assert plan_layout_problems(Plan.from_json(plan.to_json())) == []
    # other targets' settings keep their bytes: no key is added to a deployment that did not have it
    assert Plan(target="lambda", model={}, topology={}, placement={}, communication={}, predicted={},
                deployment={"payload_limit_bytes": 6}).to_dict()["deployment"] == {"payload_limit_bytes": 6}


def test_auto_attention_is_tp_inside_a_node_and_dp_across_nodes():
    assert attention_dp_for("auto", 1, 8) == 1 and attention_dp_for("auto", 4, 8) == 32
    assert attention_dp_for("tp", 4, 8) == 1 and attention_dp_for("dp", 1, 8) == 8
    assert moe_a2a_for(8, 8) == "allgather" and moe_a2a_for(16, 8) == "deepep"
    with pytest.raises(UserError, match="--attention must be one of"):
        attention_dp_for("pp", 1, 8)


@pytest.mark.parametrize("target,nodes,gpus,dp,running,message", [
    ("sglang", 1, 8, 3, None, "attention tp 2 x dp 3 must equal the 8 GPUs"),
    ("sglang", 1, 8, 8, 4, "leaves attention replicas idle: give at least 8"),
    ("trtllm", 1, 8, 2, None, "TensorRT-LLM runs attention data parallel on every rank or on none"),
    ("vllm", 4, 2, 2, None, "attention tp 4 exceeds the node's 2 GPUs"),
    ("vllm", 3, 8, 4, None, "attention tp 6 does not divide the node's 8 GPUs"),
])
def test_layouts_the_engine_cannot_run_are_one_line(target, nodes, gpus, dp, running, message):
    with pytest.raises(UserError, match=message):
        engine_deployment(target, nodes, gpus, attention_dp=dp, moe_ep=nodes * gpus, redundant_experts=0,
                          max_running_requests=running)


def test_a_record_that_disagrees_with_the_plan_is_named():
    record = engine_deployment("sglang", 2, 8, attention_dp=16, moe_ep=16, redundant_experts=16)
    assert plan_layout_problems(_plan(deployment=record, ep=8)) == ["deployment moe_ep 16 is not the placement's 8 EP ranks"]
    assert "redundant_experts 16 is not the placement's 0" in plan_layout_problems(_plan(deployment=record, redundant=0))[0]
    assert layout_problems("sglang", 1, 8, {"attention_tp": 8}) == [
        "the sglang deployment lacks attention_dp, moe_ep, moe_tp, redundant_experts, max_running_requests, moe_a2a, "
        "hardware, chosen_by"]


@settings(max_examples=60, deadline=None)
@given(nodes=st.integers(1, 8), gpus=st.sampled_from([1, 2, 4, 8]), attention=st.sampled_from(["auto", "tp", "dp"]),
       running=st.none() | st.integers(1, 4096))
def test_every_flag_layout_covers_the_gpus_once_for_attention_and_for_the_experts(nodes, gpus, attention, running):
    dp = attention_dp_for(attention, nodes, gpus)
    try:
        record = engine_deployment("sglang", nodes, gpus, attention_dp=dp, moe_ep=nodes * gpus, redundant_experts=0,
                                   max_running_requests=running)
    except UserError as exc:  # only too few requests for the replicas is refused
        assert running is not None and running < dp and "idle" in str(exc)
        return
    assert record["attention_tp"] * record["attention_dp"] == nodes * gpus == record["moe_ep"] * record["moe_tp"]
    per = per_attention_replica(running, dp)
    assert per is None if running is None else 1 <= per * dp <= running
