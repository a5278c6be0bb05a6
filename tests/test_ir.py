"""ModelIR: JSON round-trip is exact for any IR, `source` stays out of equality, totals add up."""
import dataclasses
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moeplan.core.ir import DENSE_KINDS, DTYPE_BYTES, DenseStage, ModelIR, MoEStage

names = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789._", min_size=1, max_size=24)
counts = st.integers(min_value=0, max_value=10**13)
small = st.integers(min_value=1, max_value=512)
dtypes = st.sampled_from(sorted(DTYPE_BYTES))

dense_stages = st.builds(
    DenseStage,
    name=names, kind=st.sampled_from(DENSE_KINDS), params=counts, param_bytes=counts,
    flops_per_token=counts, activation_bytes_per_token=counts, dtype=dtypes, source=names,
)


@st.composite
def moe_stages(draw):
    experts = draw(small)
    return MoEStage(
        name=draw(names), moe_index=draw(st.integers(0, 100)), params=draw(counts),
        param_bytes=draw(counts), flops_per_token=draw(counts),
        activation_bytes_per_token=draw(counts), dtype=draw(dtypes), hidden_size=draw(small),
        num_experts=experts, top_k=draw(st.integers(1, experts)), expert_params=draw(counts),
        expert_param_bytes=draw(counts), expert_flops_per_token=draw(counts),
        router_params=draw(counts), shared_experts=draw(st.integers(0, 8)),
        shared_expert_params=draw(counts), source=draw(names),
    )


model_irs = st.builds(
    ModelIR,
    name=names, architecture=names, hidden_size=small, vocab_size=small, dtype=dtypes,
    stages=st.lists(st.one_of(dense_stages, moe_stages()), max_size=12).map(tuple),
    source_format=st.sampled_from(["torch", "onnx", "hf-config", "hf", ""]),
)


@settings(max_examples=80, deadline=None)
@given(model_irs)
def test_json_round_trip_is_exact(ir):
    back = ModelIR.from_json(ir.to_json())
    assert back == ir
    # Equality ignores `source`; the round trip must still keep it (weight extraction needs it).
    assert back.to_dict() == ir.to_dict()
    assert [s.source for s in back.stages] == [s.source for s in ir.stages]
    assert back.to_json() == ir.to_json()


@settings(max_examples=30, deadline=None)
@given(model_irs)
def test_totals_are_sums_over_stages(ir):
    assert ir.total_params == sum(s.params for s in ir.stages)
    assert ir.total_param_bytes == sum(s.param_bytes for s in ir.stages)
    assert len(ir.moe_stages) + len(ir.dense_stages) == len(ir.stages)
    assert ir.dense_params == sum(s.params for s in ir.dense_stages) + sum(
        s.router_params + s.shared_expert_params for s in ir.moe_stages
    )


def _tiny_ir(source="blocks.0.moe"):
    moe = MoEStage(
        name="blocks.0.moe", moe_index=0, params=10, param_bytes=40, flops_per_token=8,
        activation_bytes_per_token=16, dtype="float32", hidden_size=4, num_experts=2, top_k=1,
        expert_params=4, expert_param_bytes=16, expert_flops_per_token=8, router_params=2,
        source=source,
    )
    return ModelIR(name="m", architecture="A", hidden_size=4, vocab_size=8, dtype="float32", stages=(moe,))


def test_source_is_not_part_of_equality():
    assert _tiny_ir("torch.module.path") == _tiny_ir("onnx_node_17")


def test_other_ir_versions_are_refused():
    data = _tiny_ir().to_dict()
    data["version"] = 99
    with pytest.raises(ValueError, match="version"):
        ModelIR.from_dict(data)


def test_stage_type_tag_selects_the_class():
    data = json.loads(_tiny_ir().to_json())
    assert data["stages"][0]["type"] == "moe"
    stage = ModelIR.from_dict(data).stages[0]
    assert isinstance(stage, MoEStage) and stage.is_moe
    assert dataclasses.replace(stage, top_k=2) != stage
