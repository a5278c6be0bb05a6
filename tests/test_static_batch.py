"""One generation loop (issue 39): `moeplan run`'s static batch goes through the service's batch worker
(`runtime/serving/static_batch.py`), and Lambda's decode shares the service's stop rule and sampler.

In one process, world of one: a run's prompts arriving as one batch give the tokens the service
(`serving.ranks.serve_bundle`, rank 0's scheduler) gives the same prompts submitted as requests, in
both modes; the batch records every processed token once and nothing when the engine does not
record; a batch too long for the model stops in one line before any rank joins. Multi-rank runs
(prompt sync, bytes against the cost model, --verify) are tests/test_runtime_torchrun.py,
test_context_exchange.py and test_offload_runtime.py.
"""
from __future__ import annotations

import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moeplan.runtime.bundle_io import load_bundle
from moeplan.runtime.counters import Counters
from moeplan.runtime.ep.engine import Engine
from moeplan.runtime.ep.exchange import Exchanger
from moeplan.runtime.lambda_ import decode
from moeplan.runtime.serving.contract import GenerationRequest, SamplingParams
from moeplan.runtime.serving.ranks import serve_bundle
from moeplan.runtime.serving.scheduler import Limits, Scheduler
from moeplan.runtime.serving.static_batch import run_batch
from moeplan.runtime.serving.worker import BatchWorker
from runtime_fixtures import SMALL, contiguous_placement, small_model_dir, write_small_bundle

PROMPTS = [[5, 9, 11, 3, 40, 2, 17], [7, 7, 1], [60, 12, 33, 33, 8], [4], [21, 22, 23, 24, 25, 26, 27, 28, 29]]
NEW_TOKENS = 5
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    root = tmp_path_factory.mktemp("static-batch")
    placement = contiguous_placement(SMALL["num_layers"], SMALL["num_experts"], 1, 1)
    return write_small_bundle(root / "bundle", small_model_dir(root, max_positions=64), placement)


def static_batch(root, mode: str, record: bool = True) -> tuple:
    """(run_batch's results, the engine, the worker's steps) of PROMPTS as `moeplan run`'s ranks run them."""
    _, table, _, model, _ = load_bundle(root, 0, 1, CPU, mode)
    counters = Counters(model.num_layers)
    engine = Engine(model, table, Exchanger(0, 1, counters, CPU), counters, 0, 1, mode, CPU, model.top_k,
                    record=record)
    worker = BatchWorker(engine, model.kind, tokens_to_rank0=False)
    try:
        return run_batch(worker, PROMPTS, NEW_TOKENS), engine, worker.steps
    finally:
        worker.close()


def service_tokens(root, mode: str) -> dict:
    """{prompt index: tokens} the in-process service gives PROMPTS submitted as greedy requests,
    the later ones while the first run."""
    tokens, finished = {}, {}

    def front(client, plan, codec):
        done = threading.Event()

        def sink_of(i):
            def sink(event):
                if event.token_id >= 0:
                    tokens.setdefault(i, []).append(event.token_id)
                if event.finish_reason:
                    finished[i] = event.finish_reason
                    if len(finished) == len(PROMPTS):
                        done.set()
            return sink

        for i, p in enumerate(PROMPTS):
            client.submit(GenerationRequest(f"r{i}", tuple(p), NEW_TOKENS, SamplingParams(temperature=0.0), (), True),
                          sink_of(i))
        assert done.wait(120)
        return 0

    assert serve_bundle(root, front, mode=mode) == 0
    assert set(finished.values()) == {"length"}
    return tokens


@pytest.mark.parametrize("mode", ["coherent", "standard"])
def test_a_runs_batch_gives_the_services_tokens_for_the_same_prompts(bundle, mode):
    torch.set_num_threads(1)
    out, engine, steps = static_batch(bundle, mode)
    assert steps == NEW_TOKENS  # one prefill step, then a decode step per further token
    assert out["generated"] == service_tokens(bundle, mode)
    assert all(len(g) == NEW_TOKENS for g in out["generated"].values())
    # every processed token's logits and routing once: the prompts and every generated token but the last
    keys, logits = engine.recorded_logits()
    processed = sorted(s * out["max_len"] + p for s, prompt in enumerate(PROMPTS)
                       for p in range(len(prompt) + NEW_TOKENS - 1))
    assert sorted(keys.tolist()) == processed and logits.shape[0] == len(processed)
    routing = engine.recorded_routing()
    assert len(routing) == len(engine.model.adapters)
    assert all(sorted(k.tolist()) == processed for k, _, _ in routing.values())
    # the logits recorded at each sequence's last position pick the token generated next (greedy)
    by_key = {int(k): i for i, k in enumerate(keys.tolist())}
    for s, prompt in enumerate(PROMPTS):
        for t in range(1, NEW_TOKENS):
            row = logits[by_key[s * out["max_len"] + len(prompt) + t - 1]]
            assert int(row.argmax()) == out["generated"][s][t]


def test_an_engine_that_does_not_record_keeps_nothing(bundle):
    out, engine, _ = static_batch(bundle, "standard", record=False)
    keys, logits = engine.recorded_logits()
    assert keys.numel() == 0 and logits.numel() == 0 and engine.recorded_routing() == {}
    assert len(out["generated"]) == len(PROMPTS)


def test_a_batch_longer_than_the_models_positions_stops_in_one_line_before_any_rank_joins(bundle, tmp_path, capsys):
    from moeplan.runtime.serve import main

    prompts = tmp_path / "p.txt"
    prompts.write_text("ids: " + " ".join(["3"] * 60) + "\n")
    code = main(["--bundle", str(bundle), "--prompts", str(prompts), "--new-tokens", "8", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err
    assert err == ("error: rank 0: prompt + new tokens = 68 exceeds the model's 64 positions; give shorter prompts "
                   "or fewer --new-tokens")
    assert not (tmp_path / "o").exists()


# --- the stop rule, shared by the service's scheduler and Lambda's decode ------------------------------
def scheduler_stream(picks: list, stops: tuple, max_tokens: int, ignore_eos: bool) -> tuple:
    """(emitted tokens, finish reason) of one request fed `picks` by the service's scheduler."""
    c = Scheduler("m", Limits(4096, 4, 4), vocab_size=50, world=1, coherent=False, num_layers=1)
    events = []
    c.submit(GenerationRequest("a", (1, 2), max_tokens, SamplingParams(temperature=0.0), stops, ignore_eos),
             events.append)
    for t in picks:
        c.next_plan(None)
        c.on_tokens({0: t})
        if events[-1].finish_reason:
            break
    return [e.token_id for e in events if e.token_id >= 0], events[-1].finish_reason


def lambda_stream(picks: list, stops: tuple, max_tokens: int) -> tuple:
    """(emitted tokens, finish reason) of one sequence of a Lambda execution whose logits pick `picks`."""
    doc = decode.initial_state("r", [[1, 2]], {"max_tokens": max_tokens, "temperature": 0.0,
                                               "stop_token_ids": list(stops)})
    for t in picks:
        rows = decode.step_rows(doc)
        logits = torch.zeros(rows["seq"].numel(), 50)
        logits[:, t] = 1.0
        doc = decode.advance(doc, dict(rows, logits=logits))
        if doc["done"]:
            break
    return doc["tokens"][0], doc["finished"][0]


@settings(max_examples=60, deadline=None)
@given(picks=st.lists(st.integers(0, 49), min_size=12, max_size=12), stops=st.sets(st.integers(0, 49), max_size=4),
       max_tokens=st.integers(1, 10))
def test_the_service_and_lambda_stop_a_sequence_alike(picks, stops, max_tokens):
    stops = tuple(sorted(stops))
    assert scheduler_stream(picks, stops, max_tokens, False) == lambda_stream(picks, stops, max_tokens)
    emitted, finish = lambda_stream(picks, stops, max_tokens)
    first_stop = next((i for i, t in enumerate(picks) if t in stops), None)
    if first_stop is not None and first_stop < max_tokens:
        assert (emitted, finish) == (picks[:first_stop], "stop")  # the stop id itself is not emitted
    else:
        assert (emitted, finish) == (picks[:max_tokens], "length")
    assert scheduler_stream(picks, stops, max_tokens, True) == (picks[:max_tokens], "length")  # ignore_eos
