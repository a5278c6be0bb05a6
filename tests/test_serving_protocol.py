"""The serving front's protocol layer without HTTP: request parsing (property-tested: any body is a
request or a 400, never another error), admission against the model and context, incremental text
with stop strings (property-tested against cutting the whole decoded text), response and chunk
shapes read back by the `openai` package's own types, the chat template against transformers'
apply_chat_template, and /metrics read back by prometheus_client's parser."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moeplan.runtime.serving import prompt_check
from moeplan.runtime.serving.api_errors import ApiError, from_engine
from moeplan.runtime.serving.api_request import CHAT, COMPLETIONS, parse_body, parse_request
from moeplan.runtime.serving.api_response import DONE, ResponseWriter, sse
from moeplan.runtime.serving.chat_prompt import FALLBACK, ChatFormat
from moeplan.runtime.serving.contract import Overloaded, RequestTooLong, Unavailable
from moeplan.runtime.serving.prometheus import ServingMetrics
from moeplan.runtime.serving.served_model import ServedModel
from moeplan.runtime.serving.text_stream import TextStream

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "examples" / "tiny_moe"
QWEN = ROOT / "examples" / "qwen3_moe"

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-2 ** 70, max_value=2 ** 70) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12)
FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
          "seed", "stop", "stream", "stream_options", "ignore_eos", "return_token_ids", "stop_token_ids", "n",
          "logprobs", "echo", "add_generation_prompt", "continue_final_message", "response_format", "tool_choice",
          "presence_penalty", "logit_bias"]
plausible_values = (json_values | st.integers(min_value=-3, max_value=300) | st.floats(min_value=-1, max_value=3)
                    | st.lists(st.integers(min_value=-2, max_value=300), max_size=5)
                    | st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "bot"]),
                                                      "content": st.text(max_size=10) | json_values}), max_size=3)
                    | st.fixed_dictionaries({"include_usage": json_values}))
bodies = st.dictionaries(st.sampled_from(FIELDS), plausible_values, max_size=8)


@pytest.fixture(scope="module")
def tiny():
    return ServedModel.from_model_dir(TINY, "tiny")


def _admit(endpoint, body, served, max_context=64):
    api = parse_request(endpoint, body)
    ids = prompt_check.prompt_ids(api, served)
    return api, prompt_check.generation_request(api, served, ids, "r1", max_context)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(endpoint=st.sampled_from([COMPLETIONS, CHAT]), body=bodies | json_values)
def test_any_json_body_is_a_request_or_a_400(endpoint, body):
    served = ServedModel.from_model_dir(TINY, "tiny")
    try:
        api, request = _admit(endpoint, json.dumps(body).encode(), served)
    except ApiError as exc:
        assert exc.status == 400 and exc.message and exc.body()["error"]["code"] == 400
        return
    assert 1 <= request.max_tokens and len(request.prompt_ids) + request.max_tokens <= 64
    assert all(0 <= i < served.vocab_size for i in request.prompt_ids)
    assert api.temperature >= 0 and 0 < api.top_p <= 1 and api.top_k >= 0


@settings(max_examples=200, deadline=None)
@given(raw=st.binary(max_size=40))
def test_any_bytes_are_a_request_or_a_400(raw):
    try:
        parse_request(COMPLETIONS, raw)
    except ApiError as exc:
        assert exc.status == 400


def test_defaults_and_fields(tiny):
    api, req = _admit(COMPLETIONS, {"prompt": "abc"}, tiny)
    assert (api.max_tokens, api.temperature, api.top_p, api.top_k, api.stream) == (16, 1.0, 1.0, 0, False)
    assert req.prompt_ids == tuple(b"abc") and req.max_tokens == 16 and req.stop_token_ids == ()
    api, req = _admit(COMPLETIONS, {"prompt": [5, 9, 11], "temperature": 0, "top_k": -1, "seed": 3, "stop": "x",
                                    "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True,
                                    "return_token_ids": True, "max_tokens": 4, "unknown_field": {"a": 1}}, tiny)
    assert req.prompt_ids == (5, 9, 11) and req.sampling.temperature == 0.0 and req.sampling.top_k == 0
    assert req.sampling.seed == 3 and api.stop == ("x",) and api.include_usage and api.return_token_ids
    api, req = _admit(COMPLETIONS, {"prompt": ["one prompt"], "n": 1, "logprobs": None, "echo": False}, tiny)
    assert req.prompt_ids == tuple(b"one prompt")
    # chat without max_tokens: what the context leaves after the prompt
    api, req = _admit(CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}, tiny)
    assert req.prompt_ids == tuple(b"user: hi\nassistant:") and req.max_tokens == 64 - len(req.prompt_ids)
    _, req = _admit(CHAT, {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 3,
                           "max_tokens": 9}, tiny)
    assert req.max_tokens == 3


@pytest.mark.parametrize("endpoint, body, param", [
    (COMPLETIONS, {}, "prompt"),
    (COMPLETIONS, {"prompt": ""}, "prompt"),
    (COMPLETIONS, {"prompt": ["a", "b"]}, "prompt"),
    (COMPLETIONS, {"prompt": [1, 256]}, "prompt"),
    (COMPLETIONS, {"prompt": "a", "n": 2}, "n"),
    (COMPLETIONS, {"prompt": "a", "n": True}, "n"),
    (COMPLETIONS, {"prompt": "a", "stream": 1}, "stream"),
    (COMPLETIONS, {"prompt": "a", "temperature": -0.5}, "temperature"),
    (COMPLETIONS, {"prompt": "a", "top_p": 0}, "top_p"),
    (COMPLETIONS, {"prompt": "a", "top_k": -2}, "top_k"),
    (COMPLETIONS, {"prompt": "a", "max_tokens": 0}, "max_tokens"),
    (COMPLETIONS, {"prompt": "a", "max_tokens": 64}, "max_tokens"),
    (COMPLETIONS, {"prompt": "a", "max_tokens": 2.5}, "max_tokens"),
    (COMPLETIONS, {"prompt": "a", "stop": [""]}, "stop"),
    (COMPLETIONS, {"prompt": "a", "stream_options": {"include_usage": True}}, "stream_options"),
    (COMPLETIONS, {"prompt": "a", "model": "other"}, "model"),
    (COMPLETIONS, {"prompt": "a", "logprobs": 2}, "logprobs"),
    (COMPLETIONS, {"prompt": "a", "presence_penalty": 0.5}, "presence_penalty"),
    (COMPLETIONS, {"prompt": "a", "stop_token_ids": [300]}, "stop_token_ids"),
    (CHAT, {"messages": []}, "messages"),
    (CHAT, {"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content"),
    (CHAT, {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}}, "response_format"),
    (CHAT, {"messages": [{"role": "user", "content": "x" * 80}]}, "messages"),
])
def test_bad_requests_name_the_field(tiny, endpoint, body, param):
    with pytest.raises(ApiError) as err:
        _admit(endpoint, body, tiny)
    assert err.value.status == 400 and err.value.param == param, err.value.message


def test_bodies_that_are_not_json_objects():
    for raw in (b"{bad", b"[1, 2]", b"\xff\xfe", b"NaN", b"[" * 100000 + b"]" * 100000, b""):
        with pytest.raises(ApiError) as err:
            parse_body(raw)
        assert err.value.status == 400


def test_engine_refusals_map_to_statuses():
    assert from_engine(Overloaded("full", retry_after_s=2.2)).headers() == {"Retry-After": "3"}
    assert from_engine(Overloaded("full")).status == 429
    assert from_engine(RequestTooLong("long")).status == 400
    assert from_engine(Unavailable("draining")).status == 503


def _byte_decode(ids):
    return bytes(i % 256 for i in ids).decode("utf-8", errors="replace")


def _reference(text: str, stops) -> tuple:
    """What a stream must give: it stops at the first token that completes a stop string, so only the
    text up to the first completion counts; there, the earliest stop string (the longest at one start)."""
    ends = [text.find(s) + len(s) for s in stops if s and text.find(s) >= 0]
    if not ends:
        return text, None
    seen = text[:min(ends)]
    at, _, stop = min((seen.find(s), -len(s), s) for s in stops if s and seen.find(s) >= 0)
    return text[:at], stop


@settings(max_examples=300, deadline=None)
@given(ids=st.lists(st.sampled_from(list(b"ab \n") + [0xC3, 0xA9, 0xE2, 0x82, 0xAC, 0xFF]), max_size=30),
       stops=st.lists(st.text(alphabet="ab \né€", min_size=1, max_size=4), max_size=3))
def test_text_stream_equals_cutting_the_whole_text(ids, stops):
    stream = TextStream(_byte_decode, tuple(stops))
    out, stop = [], None
    for i in ids:
        delta, stop = stream.push(i)
        out.append(delta)
        if stop is not None:
            break
    else:
        delta, stop = stream.finish()
        out.append(delta)
    want, want_stop = _reference(_byte_decode(ids), stops)
    if want_stop is not None:  # the stream stopped at the first token completing the stop string
        assert "".join(out) == want and stop == want_stop
    else:
        assert "".join(out) == want and stop is None


@settings(max_examples=100, deadline=None)
@given(ids=st.lists(st.integers(min_value=0, max_value=383), max_size=20))
def test_text_stream_with_a_real_tokenizer(ids):
    codec = ServedModel.from_model_dir(QWEN, "q").codec
    stream = TextStream(codec.decode)
    text = "".join(stream.push(i)[0] for i in ids) + stream.finish()[0]
    assert text == codec.decode(ids)


def test_text_stream_holds_back_a_possible_stop_start():
    stream = TextStream(_byte_decode, ("END",))
    assert stream.push(ord("x")) == ("x", None)
    assert stream.push(ord("E")) == ("", None)  # may begin "END"
    assert stream.push(ord("N")) == ("", None)
    assert stream.push(ord("o")) == ("ENo", None)  # it did not
    assert stream.push(ord("E")) == ("", None)
    assert stream.push(ord("N")) == ("", None)
    assert stream.push(ord("D")) == ("", "END")


def test_response_shapes_read_back_by_the_openai_types():
    from openai.types import Completion
    from openai.types.chat import ChatCompletion, ChatCompletionChunk

    w = ResponseWriter(COMPLETIONS, "cmpl-1", 7, "m", [1, 2], return_token_ids=True, include_usage=False)
    body = w.response("hi", [5, 6], "length", None)
    c = Completion.model_validate(body)
    assert c.choices[0].text == "hi" and c.usage.total_tokens == 4 and body["choices"][0]["prompt_token_ids"] == [1, 2]
    w = ResponseWriter(CHAT, "chatcmpl-1", 7, "m", [1, 2], return_token_ids=True, include_usage=True)
    body = w.response("hi", [5], "stop", "\n")
    chat = ChatCompletion.model_validate(body)
    assert chat.choices[0].message.content == "hi" and body["prompt_token_ids"] == [1, 2]
    assert body["choices"][0]["token_ids"] == [5] and chat.usage.completion_tokens == 1
    first, last, usage = w.chunk("", []), w.chunk("x", [5], "length"), w.usage_chunk(1)
    for chunk in (first, last, usage):
        ChatCompletionChunk.model_validate(chunk)
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""} and first["prompt_token_ids"] == [1, 2]
    assert "prompt_token_ids" not in last and last["usage"] is None and usage["choices"] == []
    assert usage["usage"]["total_tokens"] == 3
    assert sse({"a": "é"}) == "data: {\"a\":\"é\"}\n\n".encode() and DONE == b"data: [DONE]\n\n"


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_the_models_own_chat_template_as_transformers_applies_it(tmp_path):
    from transformers import AutoTokenizer

    model = tmp_path / "model"
    shutil.copytree(QWEN, model, ignore=shutil.ignore_patterns("*.safetensors", "build.py"))
    (model / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": CHATML, "eos_token": "<|endoftext|>", "tokenizer_class": "PreTrainedTokenizerFast"}))
    served = ServedModel.from_model_dir(model, "q")
    assert served.chat.source == "tokenizer_config.json" and served.eos_token_ids == (0,)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    want = AutoTokenizer.from_pretrained(model).apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert served.chat.render(messages) == want
    (model / "chat_template.jinja").write_text("{{ raise_exception('roles must alternate') }}")
    served = ServedModel.from_model_dir(model, "q")
    assert served.chat.source == "chat_template.jinja"
    with pytest.raises(ApiError) as err:
        served.chat.render(messages)
    assert err.value.status == 400 and "roles must alternate" in err.value.message


def test_fallback_chat_format():
    chat = ChatFormat(None, {}, FALLBACK)
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    assert chat.render(msgs) == "system: S\nuser: U\nassistant:"
    assert chat.render(msgs, add_generation_prompt=False) == "system: S\nuser: U"
    assert chat.render(msgs + [{"role": "assistant", "content": "A"}], continue_final_message=True) == \
        "system: S\nuser: U\nassistant: A"


def test_metrics_read_back_by_prometheus_client():
    from prometheus_client.parser import text_string_to_metric_families

    m = ServingMetrics('model "x"')
    for v in (0.003, 0.2, 50.0):
        m.ttft.observe(v)
    m.itl.observe(0.004)
    m.prompt_tokens, m.generation_tokens = 12, 30
    m.request_finished("length")
    m.request_refused(429)
    text = m.render({"running": 2, "waiting": 1, "exchange_bytes": {(0, "dispatch"): 100, (0, "combine"): 50,
                                                                        (None, "token_sync"): 8},
                     "expert_cache": {"hits": 4, "misses": 2, "prefetches": 3, "prefetch_hits": 1, "host_computed": 1},
                     "gpu_local_fraction": 0.75, "steps": 9})
    families = {f.name: f for f in text_string_to_metric_families(text)}
    value = lambda name, **labels: next(s.value for s in families[name].samples
                                        if all(s.labels.get(k) == v for k, v in labels.items()) and s.name.startswith(name))
    assert value("moeplan_requests_running") == 2 and value("moeplan_requests_waiting") == 1
    ttft = families["moeplan_time_to_first_token_seconds"]
    buckets = {s.labels["le"]: s.value for s in ttft.samples if s.name.endswith("_bucket")}
    assert buckets["0.005"] == 1 and buckets["0.25"] == 2 and buckets["+Inf"] == 3
    assert families["moeplan_time_to_first_token_seconds"].samples[-1].value == 3  # _count
    assert value("moeplan_prompt_tokens") == 12 and value("moeplan_generation_tokens") == 30
    assert value("moeplan_exchange_bytes", layer="0", kind="dispatch") == 100
    assert value("moeplan_exchange_bytes", layer="all", kind="token_sync") == 8
    assert value("moeplan_expert_cache_hits") == 4 and value("moeplan_expert_cache_misses") == 2
    assert value("moeplan_expert_cache_prefetches") == 3 and value("moeplan_expert_cache_prefetch_hits") == 1
    assert value("moeplan_expert_cache_host_computed") == 1
    assert value("moeplan_gpu_local_fraction") == 0.75
    assert value("moeplan_request_refused", code="429") == 1
    assert all(s.labels["model_name"] == 'model "x"' for f in families.values() for s in f.samples)
