"""The continuous-batching engine's pieces in one process: step plans on the wire, sampling, the
cache rows, rank 0's queue and admission (EngineClient), and the capacity decision.

The multi-rank behaviour (lockstep, exactness, faults, idle CPU) runs under real torchrun in
tests/test_serving_engine.py.
"""
from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moeplan.runtime.bundle_io import BundleError
from moeplan.runtime.serving.contract import (FINISH_ABORT, FINISH_ERROR, FINISH_LENGTH, FINISH_STOP,
                                                       GenerationRequest, InvalidRequest, Overloaded, RequestTooLong,
                                                       SamplingParams, Unavailable)
from moeplan.runtime.serving.scheduler import Limits, Scheduler
from moeplan.runtime.serving.engine_start import limits_for
from moeplan.runtime.serving.row_cache import RowCache
from moeplan.runtime.serving.sampler import Sampler, filtered_probs
from moeplan.runtime.serving.step_plan import HEARTBEAT, STEP, STOP, Admission, StepPlan


# --- step plans ------------------------------------------------------------------------------------
admissions = st.builds(Admission, seq=st.integers(0, 2**40), owner=st.integers(0, 63),
                       prompt=st.lists(st.integers(0, 2**31), min_size=1, max_size=20).map(tuple),
                       seed=st.integers(0, 2**62), temperature=st.floats(0, 10, allow_nan=False),
                       top_p=st.floats(1e-6, 1, allow_nan=False), top_k=st.integers(0, 1000))


@given(kind=st.sampled_from([STEP, HEARTBEAT, STOP]), admit=st.lists(admissions, max_size=5),
       depart=st.lists(st.integers(0, 2**40), max_size=8), gather=st.booleans(), number=st.integers(0, 2**40))
def test_a_step_plan_round_trips_through_its_wire_form_exactly(kind, admit, depart, gather, number):
    plan = StepPlan(kind, admit, depart, gather, number)
    header, payload = plan.encode()
    assert header.dtype == payload.dtype == torch.int64
    assert StepPlan.decode(header, payload) == plan  # floats bit for bit


# --- sampling --------------------------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31), top_p=st.floats(0.05, 1.0), top_k=st.integers(0, 12),
       temperature=st.floats(0.1, 3.0))
def test_filtered_probabilities_keep_the_smallest_top_p_prefix_within_top_k(seed, top_p, top_k, temperature):
    logits = torch.randn(12, generator=torch.Generator().manual_seed(seed)) * 3
    probs = filtered_probs(logits, temperature, top_p, top_k)
    assert abs(float(probs.sum()) - 1) < 1e-5 and probs[int(logits.argmax())] > 0
    kept = probs > 0
    if 0 < top_k < 12:
        assert int(kept.sum()) <= top_k + int((logits == torch.topk(logits, top_k).values[-1]).sum()) - 1
    base = torch.softmax(logits / temperature, -1)
    if top_k == 0:
        order = torch.argsort(base, descending=True)
        mass = torch.cumsum(base[order], 0)
        needed = int((mass < top_p).sum()) + 1  # the smallest prefix reaching top_p
        assert int(kept.sum()) <= needed + 1 and float(base[kept].sum()) >= min(top_p, 1.0) - 1e-5


def test_greedy_is_argmax_and_a_seeded_token_does_not_depend_on_its_row():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    s = Sampler()
    greedy = s.sample(logits, [(0.0, 1.0, 0, 7)] * 4, [0] * 4)
    assert greedy == logits.argmax(-1).tolist()
    params = (0.8, 0.9, 20, 1234)
    alone = s.sample(logits[2:3], [params], [5])
    crowd = s.sample(logits[[0, 2, 3]], [(0.0, 1.0, 0, 0), params, (1.0, 1.0, 0, 9)], [1, 5, 2])
    assert crowd[1] == alone[0]
    draws = {tuple(s.sample(logits, [(1.0, 1.0, 0, seed)] * 4, [0] * 4)) for seed in range(20)}
    assert len(draws) > 1  # seeds change the samples


# --- cache rows ------------------------------------------------------------------------------------
def _rows(seqs, lengths, width, layers=2, heads=2, dim=3):
    """A TinyMoE-style cache whose entry [b, h, col, :] = seq * 1000 + position (0 on padding)."""
    cache = RowCache("tiny_moe")
    blocks = []
    for _ in range(layers):
        k = torch.zeros(len(seqs), heads, width, dim)
        for b, (s, n) in enumerate(zip(seqs, lengths)):
            k[b, :, width - n:, :] = (s * 1000 + torch.arange(n, dtype=torch.float32))[None, :, None]
        blocks.append({"k": k.clone(), "v": -k.clone()})
    cache.cache, cache.seqs, cache.lengths, cache.width = blocks, list(seqs), list(lengths), width
    return cache


def _row_values(cache):
    out = {}
    for b, (s, n) in enumerate(zip(cache.seqs, cache.lengths)):
        for block in cache.cache:
            k = block["k"][b, 0, cache.width - n:, 0].tolist()
            assert k == [s * 1000 + p for p in range(n)] and block["v"][b, 0, cache.width - n:, 0].tolist() == [-x for x in k]
        out[s] = n
    return out


@given(lengths=st.lists(st.integers(1, 9), min_size=1, max_size=6), joining=st.lists(st.integers(1, 9), max_size=4),
       leave=st.sets(st.integers(0, 9)))
def test_rows_leave_and_join_keeping_every_remaining_token(lengths, joining, leave):
    cache = _rows(list(range(len(lengths))), lengths, max(lengths))
    cache.leave(leave)
    assert cache.width == (max(cache.lengths) if cache.lengths else 0)
    if joining:
        seqs = list(range(10, 10 + len(joining)))
        cache.join(_rows(seqs, joining, max(joining)))
    expected = {s: n for s, n in enumerate(lengths) if s not in leave} | {10 + i: n for i, n in enumerate(joining)}
    if cache.seqs:
        assert _row_values(cache) == expected
        mask = cache.decode_mask()
        assert mask.sum(1).tolist() == [n + 1 for n in cache.lengths]
    else:
        assert not expected


# --- rank 0's queue --------------------------------------------------------------------------------
def client(max_sequences=2, max_waiting=1, world=1, coherent=True, context=32):
    return Scheduler("m", Limits(context, max_sequences, max_waiting), vocab_size=50, world=world,
                         coherent=coherent, num_layers=2)


def req(rid, prompt=(1, 2, 3), n=4, **kw):
    sampling = {k: kw.pop(k) for k in ("temperature", "top_p", "top_k", "seed") if k in kw}
    return GenerationRequest(rid, tuple(prompt), n, SamplingParams(**{"temperature": 0.0, **sampling}), **kw)


@pytest.mark.parametrize("bad, error", [
    (req("a", prompt=()), InvalidRequest), (req("a", prompt=(1, 99)), InvalidRequest),
    (req("a", n=0), InvalidRequest), (req("a", temperature=-1.0), InvalidRequest),
    (req("a", top_p=0.0), InvalidRequest), (req("a", top_k=-2), InvalidRequest),
    (req("a", prompt=tuple(range(1, 30)), n=4), RequestTooLong)])
def test_submit_refuses_what_cannot_run_before_queueing_it(bad, error):
    c = client()
    with pytest.raises(error):
        c.submit(bad, lambda e: None)
    assert c.idle()


def test_the_queue_holds_running_plus_waiting_and_cancel_aborts_a_waiting_request():
    c, events = client(max_sequences=1, max_waiting=1), []
    c.submit(req("a"), events.append)
    c.submit(req("b"), events.append)
    with pytest.raises(Overloaded) as over:
        c.submit(req("c"), events.append)
    assert over.value.retry_after_s >= 1
    with pytest.raises(InvalidRequest):
        c.submit(req("a"), events.append)  # an id in flight
    plan = c.next_plan(None)
    assert plan.kind == STEP and [a.seq for a in plan.admit] == [0]  # one running at most
    c.cancel("b")
    c.on_tokens({0: 5})
    plan = c.next_plan(None)
    assert [(e.request_id, e.token_id, e.finish_reason) for e in events] == [("a", 5, None), ("b", -1, FINISH_ABORT)]
    assert plan.kind == STEP and not plan.admit and not plan.depart


def test_tokens_become_events_in_order_and_finished_sequences_leave_next_step():
    c, events = client(max_sequences=4, max_waiting=4), []
    c.submit(req("len", n=2), events.append)
    c.submit(req("stop", n=5, stop_token_ids=(9,)), events.append)
    c.submit(req("ignore", n=2, stop_token_ids=(9,), ignore_eos=True), events.append)
    plan = c.next_plan(None)
    assert [a.seq for a in plan.admit] == [0, 1, 2]
    c.on_tokens({0: 4, 1: 9, 2: 9})
    plan = c.next_plan(None)
    assert sorted(plan.depart) == [1]
    c.on_tokens({0: 7, 2: 3})
    assert sorted(c.next_plan(0.01).depart) == [0, 2]
    got = [(e.request_id, e.token_id, e.finish_reason) for e in events]
    assert got == [("len", 4, None), ("stop", -1, FINISH_STOP), ("ignore", 9, None), ("len", 7, FINISH_LENGTH),
                   ("ignore", 3, FINISH_LENGTH)]
    assert c.idle()


def _pieces(tokens, stops=(), n=4, ahead=True):
    """(pieces a Generation yields, events) for a request whose tokens the engine sends: all of them before the
    front reads any (`ahead`), or each read before the next is sent."""
    import asyncio

    from moeplan.runtime.serving.generation import Generation

    async def run():
        c = client(max_sequences=1, max_waiting=1)
        generation = Generation(c, req("a", n=n), lambda ids: "".join(chr(97 + i) for i in ids), stops)
        generation.submit()
        c.next_plan(None)
        pieces, stream = [], generation.pieces()
        for t in tokens:
            c.on_tokens({0: t})
            if not ahead:
                piece = await anext(stream, None)
                if piece is None:  # a stop string ended it
                    return pieces
                pieces.append(piece)
        async for piece in stream:
            pieces.append(piece)
        return pieces

    return asyncio.run(run())


@pytest.mark.parametrize("tokens, stops, text, reason", [((1, 2, 3, 4), (), "bcde", FINISH_LENGTH),
                                                         ((1, 2, 3, 4), ("cd",), "b", FINISH_STOP)])
def test_events_the_engine_sent_ahead_of_the_front_make_one_piece_saying_what_each_would(tokens, stops, text, reason):
    ahead, in_step = _pieces(tokens, stops), _pieces(tokens, stops, ahead=False)
    assert len(ahead) == 1 and len(in_step) == len(tokens) - (reason == FINISH_STOP)  # the stop's token ends it
    assert ahead[0].text == "".join(p.text for p in in_step) == text
    assert ahead[0].token_ids == [i for p in in_step for i in p.token_ids]
    assert ahead[0].finish_reason == in_step[-1].finish_reason == reason
    assert ahead[0].stop_reason == in_step[-1].stop_reason == (stops[0] if stops else None)


def test_standard_mode_owners_balance_and_prefill_stays_within_its_budget():
    c = Scheduler("m", Limits(4096, 8, 8, max_prefill_tokens=100), vocab_size=50, world=3, coherent=False,
                      num_layers=1)
    for i in range(6):
        c.submit(req(f"r{i}", prompt=(1,) * 30, n=4), lambda e: None)
    plan = c.next_plan(None)
    # 3 x 30 padded tokens fit in 100, a 4th would not; a step's admissions stay on one rank while it runs fewer
    # than PREFILL_SLACK (2) sequences more than the least-loaded one
    assert [a.owner for a in plan.admit] == [0, 0, 1]
    plan = c.next_plan(None)
    assert [a.owner for a in plan.admit] == [2, 2, 2]  # loads 2, 1, 3: within the slack of each other


@settings(max_examples=60, deadline=None)
@given(world=st.integers(2, 4), events=st.lists(st.tuples(st.integers(0, 5), st.integers(0, 3)), min_size=1,
                                                 max_size=30), sequences=st.sampled_from([2, 5, 9, 64]))
def test_a_steps_admissions_share_a_rank_while_loads_stay_within_the_slack(world, events, sequences):
    """Any arrivals and finishes: each admission goes to its step's earlier admissions' rank only while that rank
    runs fewer than PREFILL_SLACK sequences more than the least-loaded one and fewer than its share of the service's
    sequences, else to the least-loaded rank; no rank ever runs more than its share (a GPU rank's KV pools hold
    that many rows)."""
    from moeplan.runtime.serving.scheduler import PREFILL_SLACK, rank_rows

    share = rank_rows(sequences, world)
    c = Scheduler("m", Limits(4096, sequences, 64), vocab_size=50, world=world, coherent=False, num_layers=1)
    load, owner_of, n = [0] * world, {}, 0
    for arrivals, finishing in events:
        for _ in range(arrivals):
            c.submit(req(f"r{n}", n=64), lambda e: None)
            n += 1
        plan = c.next_plan(0.0)
        if plan is None or plan.kind != STEP:
            continue
        for seq in plan.depart:
            load[owner_of.pop(seq)] -= 1
        previous = None
        for a in plan.admit:
            least = min(load)
            if previous is not None and load[previous] < least + PREFILL_SLACK and load[previous] < share:
                assert a.owner == previous
            else:
                assert load[a.owner] == least
            load[a.owner] += 1
            assert load[a.owner] <= share
            owner_of[a.seq], previous = a.owner, a.owner
        running = sorted(owner_of)
        c.on_tokens(dict.fromkeys(running, 1))
        for seq in running[:finishing]:  # the oldest finish: cancelled, they leave the next step
            c.cancel(next(r for r, live in c._by_id.items() if live.seq == seq))


def test_an_idle_loop_sleeps_until_a_submit_or_sends_heartbeats():
    c = client()
    assert c.next_plan(0.05).kind == HEARTBEAT
    woke = []
    t = threading.Thread(target=lambda: woke.append(c.next_plan(None)))
    t.start()
    c.submit(req("a"), lambda e: None)
    t.join(5)
    assert woke and woke[0].kind == STEP and woke[0].admit


def test_a_failed_engine_ends_every_request_with_an_error_and_refuses_new_ones():
    c, events = client(max_sequences=1, max_waiting=2), []
    c.started()
    c.submit(req("a"), events.append)
    c.next_plan(None)
    c.submit(req("b"), events.append)
    assert c.healthy()
    c.fail("RuntimeError: peer gone")
    assert {(e.request_id, e.finish_reason, e.error) for e in events} == {("a", FINISH_ERROR, "RuntimeError: peer gone"),
                                                                           ("b", FINISH_ERROR, "RuntimeError: peer gone")}
    assert not c.healthy() and c.failed_event.is_set()
    with pytest.raises(Unavailable):
        c.submit(req("c"), events.append)


def test_drain_refuses_new_requests_and_shutdown_aborts_what_is_left():
    c, events = client(max_sequences=1, max_waiting=2), []
    c.submit(req("a"), events.append)
    c.drain()
    with pytest.raises(Unavailable):
        c.submit(req("b"), events.append)
    assert c.next_plan(None).admit  # in-flight work still runs
    c.shutdown()
    assert c.next_plan(None).kind == STOP
    assert [(e.request_id, e.finish_reason) for e in events] == [("a", FINISH_ABORT)]


# --- capacity --------------------------------------------------------------------------------------
def test_limits_come_from_the_plans_capacity_and_options_only_lower_them():
    plan = {"communication": {"capacity": {"fits": True, "max_sequences": 12, "max_context": 100}}}
    limits = limits_for(plan, 256, None, None)
    assert (limits.max_sequences, limits.max_context, limits.max_waiting) == (12, 100, 48)
    assert limits_for(plan, 64, 3, 0) == Limits(64, 3, 0)
    with pytest.raises(BundleError, match="exceeds the plan's capacity"):
        limits_for(plan, 256, 13, None)
    full = {"communication": {"capacity": {"fits": False, "device_memory_bytes": 10, "device_memory_source": "x"}}}
    with pytest.raises(BundleError, match="holds no sequence"):
        limits_for(full, 256, None, None)


# --- replica choice (ExpertTable.choose, on every step's routing) -----------------------------------
@settings(max_examples=80, deadline=None)
@given(data=st.data(), nodes=st.integers(1, 2), gpus=st.integers(1, 4), experts=st.integers(2, 8),
       k=st.integers(1, 2), n=st.integers(0, 12))
def test_every_slot_goes_to_a_rank_holding_its_expert_by_the_metrics_rule(data, nodes, gpus, experts, k, n):
    from moeplan.runtime.ep.expert_table import ExpertTable

    world = nodes * gpus
    layers = []
    for layer in range(2):
        hosts = [data.draw(st.sets(st.integers(0, world - 1), min_size=1, max_size=world)) for _ in range(experts)]
        layers.append({"layer": layer, "devices": [[e for e in range(experts) if d in hosts[e]] for d in range(world)]})
    table = ExpertTable.from_placement({"topology": {"nodes": nodes, "gpus_per_node": gpus}, "layers": layers})
    k = min(k, experts)
    ids = torch.tensor([data.draw(st.permutations(range(experts)))[:k] for _ in range(n)], dtype=torch.int64).reshape(n, k)
    current = torch.tensor([data.draw(st.integers(0, world - 1)) for _ in range(n)], dtype=torch.int64)
    for layer in range(2):
        dest = table.choose(layer, ids, current)
        for i in range(n):
            for s in range(k):
                ranks = np.flatnonzero(table.hosts[layer][int(ids[i, s])]).tolist()
                assert int(dest[i, s]) in ranks
                if len(ranks) == 1:
                    assert int(dest[i, s]) == ranks[0]
                if layer > 0 and int(current[i]) in ranks:
                    assert int(dest[i, s]) == int(current[i])  # a replica on the token's rank serves it
