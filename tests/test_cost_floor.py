"""`--policy auto`'s early stop (issue 38 item 5): the placement floor is a lower bound on every
placement's predicted time (attention at context included), the stop never loses more than the model's
error, the vectorised cost model replays each rank's own replica choice, and slots with no expert move nothing."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from moeplan.core.hardware import load_hardware
from moeplan.passes.analysis.trace.format import Trace
from moeplan.passes.cost.attention_context import AttentionContext
from moeplan.passes.cost.by_predicted_time import MODEL_ERROR, TIE, choose_placement
from moeplan.passes.cost.cost_model import COHERENT, STANDARD, ModelShape, Workload, expected, predict, routing_from_trace
from moeplan.passes.cost.placement_floor import expected_floor, floor_seconds_per_token
from moeplan.passes.optimize.placement.policies import PlacementRequest
from moeplan.passes.optimize.placement.schema import Topology
from moeplan.runtime.ep.expert_table import ExpertTable

PROFILES = {name: load_hardware(name) for name in ("cpu-gloo", "h100-sxm", "h100-pcie5")}


def _hosts(rng, layers: int, experts: int, world: int, density: float) -> np.ndarray:
    """bool [L, E, W]: random copies, every expert hosted at least once."""
    hosts = rng.random((layers, experts, world)) < density
    for l, e in zip(*np.nonzero(~hosts.any(axis=2))):
        hosts[l, e, rng.integers(world)] = True
    return hosts


def _routing(rng, workload: Workload, layers: int, experts: int, k: int, none_share: float = 0.0) -> dict:
    tokens = sum(len(s) for s in workload.steps())
    ids = np.stack([np.stack([rng.permutation(experts)[:k] for _ in range(layers)]) for _ in range(tokens)])
    ids[rng.random(ids.shape) < none_share] = -1
    return routing_from_trace(ids, workload)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(sorted(PROFILES)), st.integers(1, 3), st.integers(1, 2), st.integers(2, 10), st.integers(1, 3),
       st.integers(0, 2), st.lists(st.integers(1, 6), min_size=1, max_size=5), st.integers(1, 4),
       st.floats(0.05, 0.9), st.sampled_from([0.0, 0.1]), st.integers(0, 10 ** 6))
def test_no_placement_is_predicted_below_the_floor(name, per_node, nodes, experts, layers, dense_blocks, prompts, new,
                                                  density, none_share, seed):
    profile = PROFILES[name]
    if nodes > 1 and profile.message_latency_s.get("other_node") is None:
        nodes = 1  # a one-machine profile prices one node only
    rng = np.random.default_rng(seed)
    world, k = per_node * nodes, int(rng.integers(1, min(experts, 4) + 1))
    blocks = layers + dense_blocks
    shape = ModelShape(hidden=int(rng.integers(4, 64)), top_k=k, num_blocks=blocks,
                       moe_blocks=tuple(sorted(rng.choice(blocks, layers, replace=False).tolist())),
                       attention_flops=float(10 ** rng.uniform(3, 10)), expert_flops=float(10 ** rng.uniform(3, 10)),
                       dense_mlp_flops=float(10 ** rng.uniform(3, 9)), head_flops=float(10 ** rng.uniform(3, 9)),
                       moe_dense_flops=float(10 ** rng.uniform(2, 8)), expert_bytes=float(10 ** rng.uniform(3, 9)),
                       attention_bytes=float(10 ** rng.uniform(3, 9)),
                       attention_context=AttentionContext(float(10 ** rng.uniform(1, 7)), float(10 ** rng.uniform(0, 6)))
                       if rng.random() < 0.7 else None,
                       # a service's GPU ranks replay captured decode steps (gathered where the architecture's MoE
                       # blocks can: not DBRX's), as `predict` prices them
                       architecture=str(rng.choice(["", "Qwen3MoeForCausalLM", "DbrxForCausalLM"])),
                       decode_graphs=bool(rng.random() < 0.5))
    workload = Workload(tuple(prompts), new)
    routing = _routing(rng, workload, layers, experts, k, none_share)
    hosts = _hosts(rng, layers, experts, world, density)
    for mode in (STANDARD, COHERENT):
        floor = floor_seconds_per_token(world, shape, mode, workload, routing, profile, per_node)
        predicted = predict(hosts, per_node, shape, mode, workload, routing, profile).summary(workload.prompt_tokens)
        assert 0 < floor <= predicted["seconds_per_token"] * (1 + 1e-12), mode


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 3), st.integers(1, 3), st.integers(2, 9), st.integers(1, 4), st.integers(1, 40),
       st.floats(0.1, 0.9), st.integers(0, 10 ** 6))
def test_choosing_per_rank_in_one_call_is_each_rank_choosing_its_own_tokens(per_node, nodes, experts, k, tokens, density,
                                                                           seed):
    """The cost model replays a step's ranks in one call; the runtime's ranks call `choose` on their own
    tokens, in the order they hold them: the ranks each slot goes to are the same."""
    rng = np.random.default_rng(seed)
    world, k = per_node * nodes, min(k, experts)
    layers = 2
    table = ExpertTable(_hosts(rng, layers, experts, world, density), per_node)
    ids = np.stack([rng.permutation(experts)[:k] for _ in range(tokens)])
    current = rng.integers(0, world, tokens)
    for layer in range(layers):
        together = table.choose_per_rank(layer, ids, current)
        for r in range(world):
            mine = current == r
            assert np.array_equal(together[mine], table.choose(layer, ids[mine], current[mine])), (layer, r)


def test_a_slot_with_no_expert_makes_no_row():
    """Tokens that chose one expert and a -1 ("none") in their second slot compute as top-1 tokens do."""
    rng = np.random.default_rng(0)
    layers, experts, world = 2, 6, 4
    workload = Workload((3, 5), 3)
    top1 = _routing(rng, workload, layers, experts, 1)
    with_none = {t: np.concatenate([ids, np.full((layers, 1), -1)], axis=1) for t, ids in top1.items()}
    hosts = _hosts(rng, layers, experts, world, 0.4)
    shape = ModelShape(hidden=8, top_k=2, num_blocks=2, moe_blocks=(0, 1), attention_flops=1e4, expert_flops=1e4)
    for mode in (STANDARD, COHERENT):
        one = predict(hosts, 2, ModelShape(**{**shape.__dict__, "top_k": 1}), mode, workload, top1)
        two = predict(hosts, 2, shape, mode, workload, with_none)
        assert one.tokens_per_rank == two.tokens_per_rank
        assert [l[p]["messages"] for l in one.layers for p in l] == [l[p]["messages"] for l in two.layers for p in l]


def _planted_trace(seed: int) -> Trace:
    from moeplan.passes.analysis.trace.synth_planted import synthesize_trace

    return synthesize_trace(layers=4, experts=8, top_k=2, tokens=600, affinity=0.6, zipf=1.2, seed=seed)


@pytest.mark.parametrize("hardware", ["cpu-gloo", "h100-sxm"])
def test_the_early_stop_loses_at_most_the_models_error(hardware):
    """Against trying every candidate: stopped at MODEL_ERROR, the choice is within that error of the best of
    all and the candidates not tried are named; stopped at no error beyond the tie rule, the choice is the
    same; the floor lies below every price."""
    trace = _planted_trace(1)
    shape = ModelShape(hidden=64, top_k=2, num_blocks=4, moe_blocks=(0, 1, 2, 3), attention_flops=2e6, expert_flops=3e6,
                       expert_bytes=4e5, attention_bytes=2e5)
    profile, workload = PROFILES[hardware], Workload((16,) * 4, 4)
    request = PlacementRequest(topology=Topology(1, 2), effort=0.2)
    _, every, no_stop = choose_placement(trace, request, shape, profile, workload, "auto", error=None)
    assert no_stop["skipped"] == []
    best_of_all = min(r["seconds_per_token"] for r in every)
    families = {r["label"].split("@")[0] for r in every}
    for error in (MODEL_ERROR, 0.0):
        choice, rows, stop = choose_placement(trace, request, shape, profile, workload, "auto", error=error)
        chosen = next(r for r in rows if r["chosen"])
        assert chosen["seconds_per_token"] * (1 - max(error, TIE)) <= best_of_all
        assert stop["floor_seconds_per_token"] <= best_of_all
        assert [r["label"] for r in rows] == [r["label"] for r in every][:len(rows)]  # the same order, cut short
        tried = {r["label"].split("@")[0] for r in rows}
        assert tried | set(stop["skipped"]) == families and not tried & set(stop["skipped"])
        if error == 0.0:
            assert chosen["label"] == next(r["label"] for r in every if r["chosen"])
        else:  # the rule: a stop once the floor is within the error of the best so far (contiguous, tried first)
            assert bool(stop["skipped"]) == (stop["floor_seconds_per_token"] >= rows[0]["seconds_per_token"] * (1 - error))
            assert stop["skipped"]  # on this trace the floor is within 10 % of contiguous: nothing else is tried
        for m in (STANDARD, COHERENT):  # the floor holds for the placement chosen too
            floor = expected_floor(request.topology.devices, shape, m, workload, trace.experts, profile)
            assert floor <= expected(choice.hosts(), 2, shape, m, workload, trace.experts, profile)["seconds_per_token"]


def test_a_deferred_bound_is_the_bound_a_direct_solve_records():
    """--policy auto leaves the ILP's bound to the placement it keeps: computed then, it is the same."""
    from dataclasses import replace

    from moeplan.passes.optimize.placement.policies import finish_placement, plan_placement

    trace = _planted_trace(2)
    request = PlacementRequest(topology=Topology(1, 2), effort=0.2, balance=0.2)
    direct = plan_placement(trace, request)
    later = plan_placement(trace, replace(request, bound=False))
    assert "bound" not in later.metrics and "gap" not in later.metrics
    finish_placement(later)
    assert later.deferred_bound is None
    assert ({k: v for k, v in later.metrics.items() if k != "solve_seconds"}
            == {k: v for k, v in direct.metrics.items() if k != "solve_seconds"})
    assert later.to_json() == direct.to_json()


def test_compile_states_the_stop_its_error_and_where_the_error_comes_from():
    from moeplan.passes.cost.options import _stop_note

    stop = {"error": MODEL_ERROR, "floor_seconds_per_token": 0.0546, "best_seconds_per_token": 0.0573,
            "skipped": ["eplb", "ilp+64"]}
    note = _stop_note({"auto_stop": stop})
    assert "54.60 ms/token" in note and "(10 %" not in note and "(10%" in note
    assert "docs/cost_model.md 'How close the demo comes'" in note and note.endswith("not tried: eplb, ilp+64")
    assert _stop_note({"auto_stop": {**stop, "skipped": []}}) == "" and _stop_note({}) == ""
