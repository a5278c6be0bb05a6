"""Hugging Face Mixtral and Qwen2-MoE (tiny, random weights, built from config) under the runtime.

The runtime runs transformers' own modules and replaces only the routed experts: in one process
through the engine (both modes) the logits and greedy tokens must be transformers' own, and a
2-rank torchrun run of each bundle verifies in both modes with the predicted locality.
"""
import pytest
import torch

from moeplan.runtime.model.library_model import build_transformers, decoder_layers
from moeplan.runtime.model.moe_adapter import find_containers, join_expert_state, split_expert_state
from moeplan.planner.pipeline.run import run_modes
from runtime_fixtures import contiguous_placement, hf_model_dir, single_rank_engine, static_run, write_hf_bundle

PROMPTS = [[5, 9, 11, 3, 40, 2], [7, 7, 1], [60, 12, 33, 33, 8]]


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe"])
def test_hf_model_through_the_engine_matches_transformers(tmp_path, kind):
    torch.set_num_threads(1)
    directory, model = hf_model_dir(tmp_path, kind)
    state = {k: v.detach() for k, v in model.state_dict().items()}
    containers = find_containers(*reversed(decoder_layers(model)))
    assert [c.layer for c in containers] == ([0, 2] if kind == "qwen2_moe" else [0, 1, 2])
    split = split_expert_state(state, containers)
    assert all(t.shape[0] != 8 or "experts" not in k for k, t in split.items() if k.endswith(("gate_up_proj", "down_proj")))
    joined = join_expert_state(split, containers)
    assert joined.keys() == state.keys() and all(torch.equal(joined[k], state[k]) for k in state)
    for mode in ("coherent", "standard"):
        engine = single_rank_engine(model, build_transformers(directory), "transformers", mode, 2)
        out = static_run(engine, PROMPTS, 3)
        keys, logits = engine.recorded_logits()
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
                rows = torch.stack([logits[by_key[s * out["max_len"] + p]] for p in range(ref.shape[0])])
                assert (rows - ref).abs().max().item() <= 1e-4


@pytest.mark.parametrize("kind", ["mixtral", pytest.param("qwen2_moe", marks=pytest.mark.slow)])
def test_hf_bundle_two_ranks_verifies(tmp_path, kind):
    directory, model = hf_model_dir(tmp_path, kind)
    layers = len(find_containers(*reversed(decoder_layers(model))))
    bundle = write_hf_bundle(tmp_path / "bundle", directory, model, contiguous_placement(layers, 8, 1, 2))
    assert "transformers==" in (bundle / "requirements.txt").read_text()
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join("ids: " + " ".join(map(str, p)) for p in PROMPTS) + "\n")
    reports = run_modes(str(bundle), 2, str(prompts), 3, ("coherent", "standard"), True, None, 240)
    for mode, report in reports.items():
        assert report["verified"], (mode, report)
    for report in reports.values():
        assert report["locality_matches_prediction"]
    assert reports["coherent"]["gpu_local_fraction"] == pytest.approx(reports["coherent"]["predicted_gpu_local_fraction"], abs=1e-12)
