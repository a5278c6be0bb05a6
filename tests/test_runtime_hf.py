"""Hugging Face Mixtral and Qwen2-MoE (tiny, random weights, built from config) under the runtime.

The runtime's HF adapter must reproduce transformers' own forward pass (RoPE, grouped-query
attention, router, fused experts split per expert, Qwen2-MoE's gated shared expert and dense
blocks): in one process through the engine, and through a 2-rank torchrun run of each.
"""
import pytest
import torch

from moeplan.backends.runtime.counters import Counters
from moeplan.backends.runtime.engine import Engine
from moeplan.backends.runtime.exchange import Exchanger
from moeplan.backends.runtime.expert_table import ExpertTable
from moeplan.backends.runtime.hf_moe import HFMoEArch, fuse_experts, moe_blocks, split_experts
from moeplan.planner.pipeline.run import run_bundle
from runtime_fixtures import contiguous_placement, hf_model_dir, write_hf_bundle

PROMPTS = [[5, 9, 11, 3, 40, 2], [7, 7, 1], [60, 12, 33, 33, 8]]


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe"])
def test_hf_model_through_the_engine_matches_transformers(tmp_path, kind):
    torch.set_num_threads(1)
    directory, model = hf_model_dir(tmp_path, kind)
    config = model.config.to_dict()
    state = {k: v.detach() for k, v in model.state_dict().items()}
    assert fuse_experts(split_experts(state)).keys() == state.keys()
    arch = HFMoEArch(config, split_experts(state))
    moe_layers = len(moe_blocks(config))
    assert moe_layers == (2 if kind == "qwen2_moe" else 3)
    for mode in ("coherent", "standard"):
        table = ExpertTable.from_placement(contiguous_placement(moe_layers, 8, 1, 1))
        counters = Counters(arch.num_layers)
        engine = Engine(arch, table, Exchanger(0, 1, counters, torch.device("cpu")), counters, 0, 1, mode,
                        torch.device("cpu"))
        out = engine.generate(PROMPTS, 3)
        keys, logits = engine.logits()
        by_key = {int(k): i for i, k in enumerate(keys.tolist())}
        with torch.no_grad():
            for s, prompt in enumerate(PROMPTS):
                ids, gen = list(prompt), []
                for _ in range(3):
                    nxt = int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
                    gen.append(nxt)
                    ids.append(nxt)
                ref = model(input_ids=torch.tensor([ids[:-1]])).logits[0]
                assert out["generated"][s] == gen
                rows = torch.stack([logits[by_key[s * engine.max_len + p]] for p in range(ref.shape[0])])
                assert (rows - ref).abs().max().item() <= 1e-4


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe"])
def test_hf_bundle_two_ranks_verifies(tmp_path, kind):
    directory, model = hf_model_dir(tmp_path, kind)
    moe_layers = len(moe_blocks(model.config.to_dict()))
    bundle = write_hf_bundle(tmp_path / "bundle", directory, model, contiguous_placement(moe_layers, 8, 1, 2))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(" ".join(map(str, p)) for p in PROMPTS) + "\n")
    report = run_bundle(str(bundle), 2, str(prompts), 3, "coherent", True, None, 240)
    assert report["verified"], report
    assert report["gpu_local_fraction"] == pytest.approx(report["predicted_gpu_local_fraction"], abs=1e-12)
