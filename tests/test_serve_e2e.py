"""`moeplan serve` end to end: the real CLI starts a bundle's 2 ranks under torchrun (gloo), rank 0
serves HTTP, and the real `openai` client talks to it.

Two services, each started once and asked many things:
* TinyMoE (small), coherent mode, with --api-key: 16 concurrent greedy requests of different prompt
  lengths (half streamed) equal the source model's single-request greedy generation token for
  token; text and chat answers; a client leaving mid-stream frees its slot; 400/401/404 and 429
  answers with the server still serving; /metrics; SIGTERM drains (503 for new requests, the
  request in flight finishes) and the service exits 0.
* the examples' Qwen3-MoE (transformers' own model, byte-level BPE tokenizer), standard mode: the
  same greedy check against transformers' own forward, a chat answer through its tokenizer; then
  rank 1 is killed: the request in flight ends with an error, /health answers 503, the service
  exits non-zero.
"""
from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from pathlib import Path

import openai
import pytest

from runtime_fixtures import SMALL, contiguous_placement, small_model_dir, write_hf_bundle, write_small_bundle
from serving_helpers import ServerProcess, async_client, check_drain, client, metrics, raw, wait_for

ROOT = Path(__file__).resolve().parents[1]
MOEPLAN = str(Path(sys.executable).parent / "moeplan")
KEY = "test-key"


def serve(bundle: Path, *flags) -> ServerProcess:
    return ServerProcess([MOEPLAN, "serve", str(bundle), "--port", "0", *flags], ready_timeout_s=180)


def greedy_reference(bundle: Path, prompts: list, lengths: list) -> list:
    """The source model's own greedy tokens, one request at a time (planner/launch/torchrun_verify.py)."""
    import json

    import torch

    from moeplan.planner.launch.torchrun_verify import load_reference, reference_generate

    torch.set_num_threads(1)
    model = load_reference(bundle, json.loads((bundle / "plan.json").read_text()))
    return [reference_generate(model, p, n)[0] for p, n in zip(prompts, lengths)]


def concurrent_greedy(url: str, prompts: list, lengths: list, api_key: str = "none") -> list:
    """16 requests at once through the async client; even ones streamed; their generated token ids."""

    async def one(c, i):
        kw = dict(model=None, prompt=prompts[i], max_tokens=lengths[i], temperature=0,
                  extra_body={"ignore_eos": True, "return_token_ids": True})
        if i % 2:
            r = await c.completions.create(**{k: v for k, v in kw.items() if k != "model"}, model=MODEL[url])
            return r.choices[0].token_ids
        ids = []
        stream = await c.completions.create(**{k: v for k, v in kw.items() if k != "model"}, model=MODEL[url],
                                            stream=True)
        async for chunk in stream:
            ids += chunk.choices[0].model_extra.get("token_ids") or []
        return ids

    async def all_():
        c = async_client(url, api_key)
        try:
            return await asyncio.gather(*(one(c, i) for i in range(len(prompts))))
        finally:
            await c.close()

    return asyncio.run(all_())


MODEL: dict = {}  # server url -> served model name


def prompts_of(vocab: int) -> tuple:
    """16 prompts of 2..31 tokens with different contents, and 16 output lengths of 6..18."""
    prompts = [[(7 * i + 3 * j + 1) % (vocab - 1) + 1 for j in range(2 + (i * 11) % 30)] for i in range(16)]
    return prompts, [6 + (i * 5) % 13 for i in range(16)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve_tiny")
    placement = contiguous_placement(SMALL["num_layers"], SMALL["num_experts"], 1, 2, replicate=(0,))
    bundle = write_small_bundle(root / "bundle", small_model_dir(root), placement, "coherent")
    server = serve(bundle, "--api-key", KEY, "--max-sequences", "16", "--max-waiting", "0")
    MODEL[server.url] = "small_moe"
    yield bundle, server
    server.kill()


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    import transformers

    root = tmp_path_factory.mktemp("serve_qwen")
    source = ROOT / "examples" / "qwen3_moe"
    model = transformers.AutoModelForCausalLM.from_pretrained(source, dtype="float32")
    bundle = write_hf_bundle(root / "bundle", source, model, contiguous_placement(4, 8, 1, 2))
    server = serve(bundle, "--mode", "standard")
    MODEL[server.url] = "qwen3_moe"
    yield bundle, server
    server.kill()


def running(server) -> float:
    return metrics(server)[("moeplan_requests_running", ())]


def test_coherent_greedy_under_concurrency_equals_the_source_model(tiny):
    bundle, server = tiny
    prompts, lengths = prompts_of(SMALL["vocab_size"])
    assert concurrent_greedy(server.url, prompts, lengths, KEY) == greedy_reference(bundle, prompts, lengths)


def test_text_and_chat_answers(tiny):
    bundle, server = tiny
    c = client(server, KEY)
    assert [m.id for m in c.models.list().data] == ["small_moe"]
    r = c.completions.create(model="small_moe", prompt="hello world", max_tokens=8, temperature=0,
                             extra_body={"return_token_ids": True})
    choice = r.choices[0]
    assert choice.prompt_token_ids == list(b"hello world") and len(choice.token_ids) == 8
    assert choice.text == bytes(choice.token_ids).decode("utf-8", errors="replace")
    assert choice.token_ids == greedy_reference(bundle, [list(b"hello world")], [8])[0]
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (11, 8) and choice.finish_reason == "length"
    chunks = list(c.chat.completions.create(model="small_moe", messages=[{"role": "user", "content": "Hi"}],
                                            max_tokens=5, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[-1].usage.completion_tokens == 5
    whole = c.chat.completions.create(model="small_moe", messages=[{"role": "user", "content": "Hi"}], max_tokens=5,
                                      temperature=0)
    assert whole.choices[0].message.content == "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    seeded = [c.completions.create(model="small_moe", prompt="abc", max_tokens=6, temperature=0.9, seed=11,
                                   extra_body={"return_token_ids": True}).choices[0].token_ids for _ in range(2)]
    assert seeded[0] == seeded[1]


def test_client_leaving_mid_stream_frees_its_slot(tiny):
    _, server = tiny
    c = client(server, KEY)
    stream = c.completions.create(model="small_moe", prompt=[5, 6], max_tokens=60, stream=True,
                                  extra_body={"ignore_eos": True})
    next(iter(stream))
    assert running(server) == 1
    stream.close()
    wait_for(lambda: running(server) == 0, 10, "the abandoned request left the batch")


def test_bad_requests_and_keys_get_openai_errors(tiny):
    _, server = tiny
    c = client(server, KEY)
    for kwargs, param in ((dict(model="gpt-4"), "model"), (dict(temperature=-1), "temperature"),
                          (dict(max_tokens=500), "max_tokens"), (dict(top_p=2), "top_p")):
        with pytest.raises(openai.BadRequestError) as err:
            c.completions.create(**{"model": "small_moe", "prompt": "x", "max_tokens": 2, **kwargs})
        assert err.value.body["param"] == param and err.value.body["code"] == 400
    status, _, body = raw(server, "POST", "/v1/completions", b'{"prompt": "x",', {"Authorization": f"Bearer {KEY}"})
    assert status == 400 and '"BadRequestError"' in body
    with pytest.raises(openai.AuthenticationError):
        client(server, "wrong-key").completions.create(model="small_moe", prompt="x", max_tokens=2)
    assert raw(server, "POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})[0] == 401
    assert raw(server, "GET", "/v1/embeddings", None, {"Authorization": f"Bearer {KEY}"})[0] == 404
    assert c.completions.create(model="small_moe", prompt="x", max_tokens=2).usage.completion_tokens == 2


def test_full_queue_gets_429(tiny):
    """--max-sequences 16 --max-waiting 0: 16 long requests fill the service, the 17th is refused."""
    _, server = tiny
    c = client(server, KEY)
    streams = [c.completions.create(model="small_moe", prompt=[1 + i, 2], max_tokens=60, stream=True,
                                    extra_body={"ignore_eos": True}) for i in range(16)]
    try:
        with pytest.raises(openai.RateLimitError) as err:
            c.completions.create(model="small_moe", prompt="x", max_tokens=2)
        assert int(err.value.response.headers["retry-after"]) >= 1
    finally:
        for s in streams:
            s.close()
    wait_for(lambda: running(server) == 0, 5, "the closed streams left the batch")
    assert c.completions.create(model="small_moe", prompt="x", max_tokens=2).usage.completion_tokens == 2


def test_metrics(tiny):
    _, server = tiny
    m = metrics(server)
    assert m[("moeplan_prompt_tokens_total", ())] > 0 and m[("moeplan_generation_tokens_total", ())] > 0
    assert m[("moeplan_time_to_first_token_seconds_count", ())] > 0
    assert m[("moeplan_inter_token_latency_seconds_count", ())] > 0
    assert m[("moeplan_request_refused_total", (("code", "429"),))] >= 1
    exchanged = {labels: v for (name, labels), v in m.items() if name == "moeplan_exchange_bytes_total"}
    assert any(v > 0 for v in exchanged.values()) and {dict(l)["kind"] for l in exchanged} >= {"dispatch", "merge"}
    assert 0 <= m[("moeplan_gpu_local_fraction", ())] <= 1
    assert ("moeplan_expert_cache_hits_total", ()) in m and ("moeplan_requests_waiting", ()) in m


def test_sigterm_drains_and_exits_zero(tiny):
    _, server = tiny
    check_drain(server, client(server, KEY), "small_moe",
                dict(prompt=[3, 4], max_tokens=50, extra_body={"ignore_eos": True}))
    assert server.stdout == [f"serving on {server.url}\n"]  # exactly one line on stdout


@pytest.mark.slow
def test_standard_mode_transformers_model(qwen):
    bundle, server = qwen
    prompts, lengths = prompts_of(384)
    assert concurrent_greedy(server.url, prompts, lengths) == greedy_reference(bundle, prompts, lengths)
    c = client(server)
    r = c.chat.completions.create(model="qwen3_moe", messages=[{"role": "user", "content": "The object"}],
                                  max_tokens=12, temperature=0, extra_body={"return_token_ids": True})
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(bundle / "model" / "tokenizer.json"))
    assert r.model_extra["prompt_token_ids"] == tokenizer.encode("user: The object\nassistant:").ids
    assert r.choices[0].message.content == tokenizer.decode(r.choices[0].token_ids)


@pytest.mark.slow
def test_a_killed_rank_ends_requests_with_an_error_and_the_service_exits(qwen):
    _, server = qwen
    c = client(server)
    stream = c.completions.create(model="qwen3_moe", prompt="The", max_tokens=200, stream=True,
                                  extra_body={"ignore_eos": True})
    next(iter(stream))
    rank1 = [pid for pid in _descendants(server.proc.pid) if _env(pid).get("RANK") == "1"]
    assert len(rank1) == 1
    killed = time.monotonic()
    os.kill(rank1[0], signal.SIGKILL)
    with pytest.raises(openai.APIError):
        for _ in stream:
            pass
    statuses = []
    wait_for(lambda: statuses.append(_health(server)) or statuses[-1] == 503, 10, "/health answers 503")
    assert server.wait(30) != 0 and time.monotonic() - killed < 30
    assert "error: the service stopped" in "".join(server.stderr)


def _health(server):
    try:
        return raw(server, "GET", "/health", timeout_s=2)[0]
    except OSError:
        return None


def _descendants(pid: int) -> list:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            children = [int(c) for c in Path(f"/proc/{p}/task/{p}/children").read_text().split()]
        except OSError:
            children = []
        out += children
        todo += children
    return out


def _env(pid: int) -> dict:
    try:
        data = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(item.split("=", 1) for item in data.decode(errors="replace").split("\0") if "=" in item)
