"""The runtime's pieces in one process: replica choice, row packing, and single-rank equivalence.

A world of one rank exercises the whole engine (routing, dispatch bookkeeping, expert compute,
combine/merge, KV cache, greedy loop) without a process group; the multi-rank paths run under
torchrun in test_runtime_torchrun.py.
"""
import torch

from moeplan.backends.runtime.counters import Counters, sum_counters
from moeplan.backends.runtime.exchange import pack, unpack
from moeplan.backends.runtime.expert_table import ExpertTable
from moeplan.backends.runtime.tiny_moe import encode, is_expert_tensor
from runtime_fixtures import PROMPTS, load_small, single_rank_engine, small_model_dir


def _table(devices_per_layer, nodes=1, gpus=None):
    gpus = gpus or len(devices_per_layer[0])
    return ExpertTable.from_placement({"topology": {"nodes": nodes, "gpus_per_node": gpus},
                                       "layers": [{"layer": l, "devices": d} for l, d in enumerate(devices_per_layer)]})


def test_primary_slot_follows_the_placement_metric_rule():
    # expert 0 on ranks 1 and 3 (nodes of 2 GPUs: rank 1 on node 0, rank 3 on node 1)
    table = _table([[[1], [0], [2], [0, 3]]] * 2, nodes=2, gpus=2)
    assert table.primary_rank(1, 0, current=3) == 3  # a replica on the current rank
    assert table.primary_rank(1, 0, current=2) == 3  # else the first on the current node
    assert table.primary_rank(1, 0, current=0) == 1  # node 0: rank 1 hosts it
    assert table.primary_rank(1, 1, current=2) == 0  # no replica on node 1: first listed
    dest = table.choose(0, torch.tensor([[0, 1]]), torch.tensor([3]))
    assert dest[0, 0].item() == 1  # MoE layer 0 has no previous device: first listed, as the metric


def test_secondary_slots_prefer_local_then_rotate_over_replicas():
    table = _table([[[0], [1], [2, 0], [3, 0]]], nodes=1, gpus=4)
    dest = table.choose(0, torch.tensor([[1, 0]] * 4), torch.tensor([2] * 4))
    assert dest[:, 1].tolist() == [2, 2, 2, 2]  # local replica wins
    dest = table.choose(0, torch.tensor([[2, 0]] * 4), torch.tensor([1] * 4))
    assert sorted(dest[:, 1].tolist()) == [0, 0, 2, 3] or set(dest[:, 1].tolist()) == {0, 2, 3}


def test_pack_round_trips_hidden_rows_and_int64_metadata_bit_exactly():
    payload = torch.randn(5, 7)
    meta = torch.tensor([[2**40 + 3, -1], [0, 7], [5, 2**62], [1, 1], [-(2**50), 3]])
    p, m = unpack(pack(payload, meta), 7)
    assert torch.equal(p, payload) and torch.equal(m, meta)
    p, m = unpack(pack(torch.zeros(0, 3), torch.zeros(0, 2, dtype=torch.int64)), 3)
    assert p.shape == (0, 3) and m.shape == (0, 2)


def test_expert_tensor_names_are_recognised():
    assert is_expert_tensor("blocks.3.moe.experts.11.w_up.weight") == (3, 11)
    assert is_expert_tensor("blocks.3.moe.gate.weight") is None
    assert is_expert_tensor("blocks.3.moe.shared_experts.0.w_up.weight") is None


def _single_rank_run(model, mode, new_tokens=4):
    fresh = type(model)(model.config).eval()  # TinyMoE's own module, as a bundle builds it
    engine = single_rank_engine(model, fresh, "tiny_moe", mode, model.config.top_k, model.config.max_positions)
    prompts = [encode(p) for p in PROMPTS]
    out = engine.generate(prompts, new_tokens)
    return prompts, out, engine


def _reference(model, prompt, new_tokens):
    ids, gen = list(prompt), []
    with torch.no_grad():
        for _ in range(new_tokens):
            nxt = int(model(torch.tensor([ids]))[0, -1].argmax())
            gen.append(nxt)
            ids.append(nxt)
        return gen, model(torch.tensor([ids[:-1]]))[0]


def test_single_rank_engine_reproduces_the_model_in_both_modes(tmp_path):
    torch.set_num_threads(1)
    model = load_small(small_model_dir(tmp_path))
    for mode in ("coherent", "standard"):
        prompts, out, engine = _single_rank_run(model, mode)
        keys, logits = engine.logits()
        by_key = {int(k): i for i, k in enumerate(keys.tolist())}
        for s, prompt in enumerate(prompts):
            gen, ref = _reference(model, prompt, 4)
            assert out["generated"][s] == gen
            rows = torch.stack([logits[by_key[s * engine.max_len + p]] for p in range(ref.shape[0])])
            assert (rows - ref).abs().max().item() <= 1e-4
        layers = out["counters"]["layers"]
        assert all(l[p]["bytes"] == 0 for l in layers for p in ("dispatch", "combine", "merge", "context"))
        assert all(l["local_slots"] == l["slots"] for l in layers)  # one rank: every slot local


def test_shared_experts_run_on_the_current_rank(tmp_path):
    torch.set_num_threads(1)
    model = load_small(small_model_dir(tmp_path, shared_experts=1))
    prompts, out, _ = _single_rank_run(model, "coherent", new_tokens=3)
    assert out["generated"][0] == _reference(model, prompts[0], 3)[0]


def test_counters_sum_across_ranks():
    a, b = Counters(2), Counters(2)
    a.add(0, "dispatch", 100, 1, 8, 1)
    b.add(0, "dispatch", 50, 2, 8, 1)
    b.add(None, "token_sync", 16, 1, 8, 1)
    total = sum_counters([a.to_dict(), b.to_dict()])
    assert total["layers"][0]["dispatch"] == {"bytes": 150, "messages": 3, "control_bytes": 16, "control_messages": 2}
    assert total["step"]["token_sync_bytes"] == 16


def test_small_ints_pack_four_to_a_word():
    from moeplan.backends.runtime.exchange import pack_small, unpack_small

    values = torch.tensor([[0, 15, 3, 1, 32767], [7, 0, 0, 2, 5]])
    words = pack_small(values)
    assert words.shape == (2, 2) and words.dtype == torch.int64
    assert torch.equal(unpack_small(words, 5), values)
