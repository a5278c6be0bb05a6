"""The runtime's pieces in one process: replica choice, row packing, and single-rank equivalence.

A world of one rank exercises the whole engine (routing, dispatch bookkeeping, expert compute,
combine/merge, KV cache, greedy loop) without a process group; the multi-rank paths run under
torchrun in test_runtime_torchrun.py.
"""
import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from moeplan.runtime.counters import Counters, sum_counters
from moeplan.runtime.ep.exchange import pack, unpack
from moeplan.runtime.ep.expert_table import ExpertTable, heaviest_first
from tiny_moe_naming import encode, is_expert_tensor
from runtime_fixtures import PROMPTS, load_small, single_rank_engine, small_model_dir, static_run


def _table(devices_per_layer, nodes=1, gpus=None):
    gpus = gpus or len(devices_per_layer[0])
    return ExpertTable.from_placement({"topology": {"nodes": nodes, "gpus_per_node": gpus},
                                       "layers": [{"layer": l, "devices": d} for l, d in enumerate(devices_per_layer)]})


def test_primary_slot_follows_the_placement_metric_rule():
    # expert 0 on ranks 1 and 3 (nodes of 2 GPUs: rank 1 on node 0, rank 3 on node 1)
    table = _table([[[1], [0], [2], [0, 3]]] * 2, nodes=2, gpus=2)
    assert table.primary(1, [0, 0, 0, 1], [3, 2, 0, 2]).tolist() == [
        3,  # a replica on the current rank
        3,  # else the first on the current node
        1,  # node 0: rank 1 hosts it
        0]  # no replica on node 1: first listed
    assert table.primary(1, [-1, 0], [2, -1]).tolist() == [2, 1]  # no expert: stays; no current rank: first listed
    dest = table.choose(0, np.array([[0, 1]]), np.array([3]))
    assert dest[0, 0] == 1  # MoE layer 0 has no previous device: first listed, as the metric


def test_secondary_slots_prefer_local_then_rotate_over_replicas():
    table = _table([[[0], [1], [2, 0], [3, 0]]], nodes=1, gpus=4)
    dest = table.choose(0, np.array([[1, 0]] * 4), np.array([2] * 4))
    assert dest[:, 1].tolist() == [2, 2, 2, 2]  # local replica wins
    dest = table.choose(0, np.array([[2, 0]] * 4), np.array([1] * 4))
    assert dest[:, 1].tolist() == [0, 2, 3, 0]  # rotates over the copies in the order the tokens come


def test_only_slots_that_leave_the_rank_take_a_turn():
    # expert 0 on ranks 0, 2, 3 of one node; tokens current on 2 use it locally and do not advance the rotation
    table = _table([[[0], [1], [0, 2], [0, 3]]] * 2, nodes=1, gpus=4)
    dest = table.choose(0, np.array([[1, 0], [2, 0], [1, 0], [2, 0]]), np.array([1, 2, 1, 1]))
    assert dest[:, 1].tolist() == [0, 2, 2, 3]


def test_a_placement_that_leaves_an_expert_without_a_rank_is_refused():
    with pytest.raises(ValueError, match="no replica of experts \\[1\\]"):
        ExpertTable.from_placement({"topology": {"nodes": 1, "gpus_per_node": 2}, "num_experts": 3,
                                    "layers": [{"layer": 0, "devices": [[0], [2]]}]})


def _reference_choice(copies, per_node, layer, experts, current):
    """The rule as its docstring states it, token by token and slot by slot (a test oracle)."""
    turns, out = {}, []
    for row, cur in zip(experts, current):
        first = -1 if layer == 0 else cur
        ranks = copies[row[0]]
        same = [r for r in ranks if first >= 0 and r // per_node == first // per_node]
        dest = [first if first in ranks else (same or ranks)[0]]
        for e in row[1:]:
            ranks = copies[e]
            if cur in ranks:
                dest.append(cur)
                continue
            pool = [r for r in ranks if r // per_node == cur // per_node] or ranks
            turn = turns.get(e, 0)
            turns[e] = turn + 1
            dest.append(pool[turn % len(pool)])
        out.append(dest)
    return out


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_the_vectorised_rule_equals_the_rule_stated_slot_by_slot(data):
    nodes, gpus = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 3))
    world, experts, k = nodes * gpus, data.draw(st.integers(1, 6)), data.draw(st.integers(1, 4))
    hosts = np.array(data.draw(st.lists(st.lists(st.booleans(), min_size=world, max_size=world),
                                        min_size=experts, max_size=experts)), dtype=bool)
    hosts[np.arange(experts), data.draw(st.lists(st.integers(0, world - 1), min_size=experts, max_size=experts))] = True
    table = ExpertTable(np.stack([hosts, hosts[::-1]]), gpus)
    n = data.draw(st.integers(0, 12))
    ids = np.array(data.draw(st.lists(st.lists(st.integers(0, experts - 1), min_size=k, max_size=k), min_size=n, max_size=n)),
                   dtype=np.int64).reshape(n, k)
    current = np.array(data.draw(st.lists(st.integers(0, world - 1), min_size=n, max_size=n)), dtype=np.int64)
    for layer, h in ((0, hosts), (1, hosts[::-1])):
        copies = [list(np.flatnonzero(h[e])) for e in range(experts)]
        assert table.choose(layer, ids, current).tolist() == _reference_choice(copies, gpus, layer, ids.tolist(), current.tolist())
    if n:
        assert table.primary(1, ids[:, 0], current).tolist() == table.choose(1, ids, current)[:, 0].tolist()


def test_heaviest_first_orders_slots_by_weight_and_keeps_ties_in_router_order():
    ids, weights = heaviest_first(np.array([[3, 1, 2], [5, 6, 7]]), np.array([[0.1, 0.7, 0.2], [0.3, 0.3, 0.4]]))
    assert ids.tolist() == [[1, 2, 3], [7, 5, 6]] and weights[0].tolist() == [0.7, 0.2, 0.1]


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
    out = static_run(engine, prompts, new_tokens)
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
        keys, logits = engine.recorded_logits()
        by_key = {int(k): i for i, k in enumerate(keys.tolist())}
        for s, prompt in enumerate(prompts):
            gen, ref = _reference(model, prompt, 4)
            assert out["generated"][s] == gen
            rows = torch.stack([logits[by_key[s * out["max_len"] + p]] for p in range(ref.shape[0])])
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


_EXCHANGES = st.lists(st.tuples(st.sampled_from([(0, "dispatch"), (1, "combine"), (None, "token_sync")]),
                                st.integers(0, 10 ** 6), st.integers(0, 8)), max_size=12)


@given(_EXCHANGES, _EXCHANGES)
def test_what_a_capture_counted_is_what_each_replay_adds(before, traced):
    """runtime/model/graph_decode.py: the counts traced after a snapshot (`since`), added once more (`add_counts`),
    equal counting those exchanges twice; `restore` puts the snapshot back."""
    def count(counters, exchanges):
        for (layer, phase), nbytes, messages in exchanges:
            counters.add(layer, phase, nbytes, messages, 8, 1)

    replayed, twice = Counters(2), Counters(2)
    count(replayed, before), count(twice, before)
    snap = replayed.snapshot()
    count(replayed, traced), count(twice, traced), count(twice, traced)
    replayed.add_counts(replayed.since(snap))
    assert replayed.to_dict() == twice.to_dict()
    replayed.restore(snap)
    assert replayed.to_dict() == snap and replayed.to_dict() is not snap


def test_small_ints_pack_four_to_a_word():
    from moeplan.runtime.ep.exchange import pack_small, unpack_small

    values = torch.tensor([[0, 15, 3, 1, 32767], [7, 0, 0, 2, 5]])
    words = pack_small(values)
    assert words.shape == (2, 2) and words.dtype == torch.int64
    assert torch.equal(unpack_small(words, 5), values)
