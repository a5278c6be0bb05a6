"""The MoE layer in a few kernels (issue 39 item 2), counted by runtime/op_counter.py: a block's routed
experts launch the same kernels whether the batch touches one expert or all of them (grouped GEMMs,
vectorised permutation), for the transformers experts backend and for TinyMoE's."""
from __future__ import annotations

import pytest
import torch

from moeplan.runtime.op_counter import OpCounter
from runtime_fixtures import hf_model_dir, load_small, single_rank_engine, small_model_dir


def test_the_counter_counts_kernels_not_views():
    x = torch.ones(4, 4)
    with OpCounter() as ops:
        y = (x @ x).view(16).reshape(4, 4) + 1
    assert y.shape == (4, 4)
    assert ops.by_op == {"aten.mm.default": 1, "aten.add.Tensor": 1}


def _adapters(kind, tmp_path):
    if kind == "mixtral":
        directory, model = hf_model_dir(tmp_path, "mixtral")
        import transformers

        fresh = transformers.MixtralForCausalLM(model.config).eval()
        engine = single_rank_engine(model, fresh, "transformers", "standard", 2)
    else:
        directory = small_model_dir(tmp_path)
        model, fresh = load_small(directory), load_small(directory)
        engine = single_rank_engine(model, fresh, "tiny_moe", "standard", 2)
    return engine.model.adapters


@pytest.mark.parametrize("kind", ["mixtral", "tiny_moe"])
def test_a_moe_blocks_kernel_count_does_not_grow_with_the_experts_it_touches(kind, tmp_path):
    adapter = next(a for a in _adapters(kind, tmp_path) if a is not None)
    experts = len(adapter.local)
    D = 32  # both models' hidden size (runtime_fixtures)
    torch.manual_seed(0)
    n, counts = 16, {}
    adapter.local_expert_output(torch.randn(n, D), adapter.local_slots(torch.zeros(n, 2, dtype=torch.long)),
                                torch.rand(n, 2))  # a first call may stack the experts' weights once
    for touched in (1, 2, experts):
        h, weights = torch.randn(n, D), torch.rand(n, 2)
        ids = torch.stack([torch.arange(n) % touched, (torch.arange(n) + 1) % touched], 1)
        slots = adapter.local_slots(ids)
        with OpCounter() as ops, torch.no_grad():
            out = adapter.local_expert_output(h, slots, weights)
        assert out.shape == h.shape
        assert ops.by_op.get("aten._grouped_mm.default", 0) >= 2  # up (or gate and up) and down projections
        counts[touched] = ops.total
    assert len(set(counts.values())) == 1, counts
