"""The HTTP front (uvicorn + starlette, runtime/serving/http_server.py) hit by the real `openai` client,
over the test-only stand-in engine of tests/serving_stub.py (answers known in advance, queue limits,
a failure switch). The same checks against the real engine under torchrun: tests/test_serve_e2e.py."""
from __future__ import annotations

import http.client
import json
import sys
import time
from pathlib import Path

import openai
import pytest

from serving_helpers import ServerProcess, check_drain, client, metrics, raw, wait_for
from serving_stub import stub_token

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "examples" / "tiny_moe"
STUB = [sys.executable, str(ROOT / "tests" / "serving_stub.py"), str(TINY)]
KEY = "sekret"


def expected_ids(prompt_ids, n):
    return [stub_token(prompt_ids, t, 256) for t in range(n)]


def text_of(ids):
    return bytes(ids).decode("utf-8", errors="replace")


@pytest.fixture(scope="module")
def server():
    s = ServerProcess(STUB + ["--api-key", KEY, "--step-s", "0.02", "--max-running", "4", "--max-waiting", "2"])
    yield s
    s.kill()


def running(server) -> float:
    return metrics(server)[("moeplan_requests_running", ())]


def test_models_completion_and_token_ids(server):
    c = client(server, KEY)
    models = c.models.list().data
    assert [m.id for m in models] == ["stub"] and models[0].max_model_len == 256
    prompt = [65, 66, 67]
    r = c.completions.create(model="stub", prompt=prompt, max_tokens=4, extra_body={"return_token_ids": True})
    want = expected_ids(prompt, 4)
    assert r.choices[0].text == text_of(want) and r.choices[0].finish_reason == "length"
    assert r.choices[0].token_ids == want and r.choices[0].prompt_token_ids == prompt
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (3, 4, 7)
    r = c.completions.create(model="stub", prompt="ABC", max_tokens=4)  # text: UTF-8 bytes for TinyMoE
    assert r.choices[0].text == text_of(want)


def test_chat_streaming_with_usage(server):
    c = client(server, KEY)
    stream = c.chat.completions.create(model="stub", messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                       stream=True, stream_options={"include_usage": True},
                                       extra_body={"return_token_ids": True})
    chunks = list(stream)
    prompt = list(b"user: hi\nassistant:")
    want = expected_ids(prompt, 5)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[0].model_extra["prompt_token_ids"] == prompt
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    ids = [i for ch in chunks if ch.choices for i in ch.choices[0].model_extra.get("token_ids", [])]
    assert text == text_of(want) and ids == want
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    assert chunks[-1].usage.prompt_tokens == len(prompt)
    r = c.chat.completions.create(model="stub", messages=[{"role": "user", "content": "hi"}], max_tokens=5)
    assert r.choices[0].message.content == text_of(want) and r.usage.completion_tokens == 5


def test_stop_string_cuts_and_frees_the_slot(server):
    c = client(server, KEY)
    prompt = [60]  # the stub answers '<CJQX_fmt...'
    started = time.monotonic()
    r = c.completions.create(model="stub", prompt=prompt, max_tokens=200, stop=["Q", "zz"])
    assert r.choices[0].text == "<CJ" and r.choices[0].finish_reason == "stop"
    assert r.choices[0].model_extra["stop_reason"] == "Q" and r.usage.completion_tokens == 4
    assert time.monotonic() - started < 4  # 200 tokens would take 4 s: the request was cancelled
    wait_for(lambda: running(server) == 0, 10, "the stopped request left the batch")


def test_client_disconnect_mid_stream_frees_its_slot(server):
    host, port = server.host_port
    conn = http.client.HTTPConnection(host, port, timeout=10)
    conn.request("POST", "/v1/completions", body=json.dumps({"prompt": "x", "max_tokens": 200, "stream": True}),
                 headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.readline().startswith(b"data: ")
    assert running(server) == 1
    conn.sock.close()  # the client goes away mid-stream
    conn.close()
    wait_for(lambda: running(server) == 0, 10, "the abandoned stream's request was cancelled")
    # a non-streaming request whose client times out is cancelled too
    c = client(server, KEY, timeout=0.3)
    with pytest.raises(openai.APITimeoutError):
        c.completions.create(model="stub", prompt="x", max_tokens=200)
    wait_for(lambda: running(server) == 0, 10, "the timed-out request was cancelled")


def test_errors_are_openai_shaped_and_the_server_goes_on(server):
    c = client(server, KEY)
    with pytest.raises(openai.BadRequestError) as err:
        c.completions.create(model="other-model", prompt="x", max_tokens=2)
    assert err.value.body["param"] == "model" and err.value.body["code"] == 400
    with pytest.raises(openai.BadRequestError) as err:
        c.completions.create(model="stub", prompt="x", max_tokens=2, temperature=-1)
    assert err.value.body["type"] == "BadRequestError" and "temperature" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model="stub", messages=[], max_tokens=2)
    with pytest.raises(openai.BadRequestError) as err:
        c.completions.create(model="stub", prompt="x", max_tokens=300)
    assert "context" in err.value.body["message"]
    auth = {"Authorization": f"Bearer {KEY}"}
    status, _, body = raw(server, "POST", "/v1/chat/completions", b"{not json", auth)
    assert status == 400 and json.loads(body)["error"]["code"] == 400
    status, _, body = raw(server, "GET", "/v2/nothing", None, auth)
    assert status == 404 and json.loads(body)["error"]["type"] == "NotFoundError"
    status, _, _ = raw(server, "GET", "/v1/completions", None, auth)
    assert status == 405
    status, _, body = raw(server, "POST", "/v1/completions", b"x" * (9 << 20), auth)
    assert status == 413
    r = c.completions.create(model="stub", prompt=[1], max_tokens=1)  # still serving
    assert r.usage.completion_tokens == 1


def test_api_key(server):
    with pytest.raises(openai.AuthenticationError) as err:
        client(server, "wrong").models.list()
    assert err.value.status_code == 401 and err.value.body["code"] == 401
    for headers in ({}, {"Authorization": "Bearer"}, {"Authorization": f"Basic {KEY}"}):  # missing or malformed
        assert raw(server, "POST", "/v1/completions", {"prompt": "x"}, headers)[0] == 401
    assert raw(server, "GET", "/health")[0] == 200  # probes and scrapers need no key
    assert raw(server, "GET", "/metrics")[0] == 200


def test_full_queue_answers_429_with_retry_after(server):
    """4 running + 2 waiting fill the stand-in; the 7th request is refused, not queued."""
    c = client(server, KEY)
    streams = [c.completions.create(model="stub", prompt="x", max_tokens=250, stream=True) for _ in range(6)]
    try:
        with pytest.raises(openai.RateLimitError) as err:
            c.completions.create(model="stub", prompt="x", max_tokens=2)
        assert err.value.response.headers["retry-after"] == "2" and err.value.body["code"] == 429
    finally:
        for s in streams:
            s.close()
    wait_for(lambda: running(server) == 0, 10, "closed streams left the batch")
    m = metrics(server)
    assert m[("moeplan_request_refused_total", (("code", "429"),))] >= 1
    assert m[("moeplan_exchange_bytes_total", (("kind", "dispatch"), ("layer", "0")))] > 0
    assert m[("moeplan_time_to_first_token_seconds_count", ())] >= 3
    assert m[("moeplan_inter_token_latency_seconds_count", ())] > 0


def test_sigterm_drains_then_exits_zero():
    s = ServerProcess(STUB + ["--step-s", "0.02"])
    try:
        check_drain(s, client(s), "stub", dict(prompt=[1, 2], max_tokens=60))
    finally:
        s.kill()


def test_engine_failure_ends_requests_with_an_error_and_exits_nonzero():
    s = ServerProcess(STUB + ["--step-s", "0.02", "--fail-after-s", "1.5"])
    try:
        c = client(s)
        stream = c.completions.create(model="stub", prompt="x", max_tokens=200, stream=True)
        with pytest.raises(openai.APIError) as err:
            for _ in stream:
                pass
        assert "rank 1 is down" in str(err.value)
        assert raw(s, "GET", "/health")[0] == 503 if s.proc.poll() is None else True
        assert s.wait(10) == 1
    finally:
        s.kill()
