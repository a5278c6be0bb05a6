"""Request bodies of `POST /v1/completions` and `POST /v1/chat/completions` -> one checked ApiRequest.

Fields and defaults follow vLLM's `CompletionRequest` and `ChatCompletionRequest`
(vllm-project/vllm at 002032ee2b18, `vllm/entrypoints/openai/completion/protocol.py` and
`vllm/entrypoints/openai/chat_completion/protocol.py`) and SGLang 0.5.23
(`python/sglang/srt/entrypoints/openai/protocol.py`):
* completions: `prompt` a string or a list of token ids (or a one-element list of either),
  `max_tokens` default 16;
* chat: `messages` ([{role, content}], content a string or a list of `{"type": "text"}` parts),
  `max_completion_tokens` (or the older `max_tokens`), default: what the context leaves;
  `add_generation_prompt` (default true) and `continue_final_message` as vLLM;
* both: `model` (optional, as vLLM; when given it must be the served one), `temperature` (default
  1, 0 greedy), `top_p` (0, 1], `top_k` (0 or -1 off), `seed` (int64), `stop` (a string or up to 16),
  `stream`, `stream_options.include_usage`, and vLLM's `ignore_eos`, `stop_token_ids`,
  `return_token_ids`.
Fields this server does not implement are refused with 400 when set to anything but their
neutral value (n > 1, logprobs, echo, penalties, logit_bias, tools, response formats other than
text, beam search, ...), never silently ignored; fields it does not know are ignored, as OpenAI's
own clients send extras.

Any body gives an ApiRequest or an ApiError(400) (property-tested), never another exception.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass

from .api_errors import ApiError, bad_request
from .contract import SamplingParams

COMPLETIONS, CHAT = "completions", "chat"
INT64 = (-(2 ** 63), 2 ** 63 - 1)
MAX_STOPS = 16
MAX_STOP_CHARS = 1024
ROLES = ("system", "developer", "user", "assistant", "tool")
# field -> (neutral values, why it is refused otherwise)
UNSUPPORTED = {
    "n": ((None, 1), "n > 1 is not supported; send one request per completion"),
    "best_of": ((None, 1), "best_of is not supported"),
    "logprobs": ((None, False), "logprobs are not supported by this server"),
    "top_logprobs": ((None, 0), "top_logprobs is not supported by this server"),
    "prompt_logprobs": ((None,), "prompt_logprobs is not supported by this server"),
    "echo": ((None, False), "echo is not supported by this server"),
    "suffix": ((None, ""), "suffix is not supported by this server"),
    "presence_penalty": ((None, 0), "presence_penalty is not supported by this server"),
    "frequency_penalty": ((None, 0), "frequency_penalty is not supported by this server"),
    "repetition_penalty": ((None, 1), "repetition_penalty is not supported by this server"),
    "min_p": ((None, 0), "min_p is not supported by this server"),
    "min_tokens": ((None, 0), "min_tokens is not supported by this server"),
    "logit_bias": ((None,), "logit_bias is not supported by this server"),
    "use_beam_search": ((None, False), "beam search is not supported by this server"),
    "tools": ((None,), "tools are not supported by this server"),
    "functions": ((None,), "functions are not supported by this server"),
    "prompt_embeds": ((None,), "prompt_embeds are not supported by this server"),
}


@dataclass(frozen=True)
class ApiRequest:
    """One checked request. `prompt` (completions: text, or a tuple of token ids) or `messages`
    (chat: a tuple of {"role", "content"} dicts with text content); `max_tokens` None means what
    the context leaves after the prompt."""

    endpoint: str
    model: str | None
    prompt: object = None
    messages: tuple = ()
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple = ()
    stop_token_ids: tuple = ()
    stream: bool = False
    include_usage: bool = False
    ignore_eos: bool = False
    return_token_ids: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    def sampling(self) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, seed=self.seed)


def parse_body(raw) -> dict:
    """Bytes (or str) of a request body -> its JSON object, else ApiError(400)."""
    if isinstance(raw, (bytes, bytearray)):
        try:
            raw = bytes(raw).decode("utf-8")
        except UnicodeDecodeError:
            raise bad_request("the request body is not UTF-8 text; send a JSON object") from None
    try:
        body = json.loads(raw, parse_constant=_no_constant)
    except json.JSONDecodeError as exc:
        raise bad_request(f"the request body is not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})") from None
    except (RecursionError, ValueError) as exc:
        raise bad_request(f"the request body is not valid JSON ({str(exc) or type(exc).__name__})") from None
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got a JSON {_kind(body)}")
    return body


def parse_request(endpoint: str, body) -> ApiRequest:
    """A JSON object (or raw body bytes) of `endpoint` -> ApiRequest, else ApiError(400)."""
    if not isinstance(body, dict):
        body = parse_body(body)
    for name, (neutral, why) in UNSUPPORTED.items():
        if name in body and not _neutral(body[name], neutral):
            raise bad_request(why, name)
    rf = body.get("response_format")
    if rf is not None and not (isinstance(rf, dict) and rf.get("type") == "text"):
        raise bad_request("response_format other than {\"type\": \"text\"} is not supported by this server",
                          "response_format")
    if body.get("tool_choice") not in (None, "none"):
        raise bad_request("tool_choice is not supported by this server", "tool_choice")
    model = _optional(body, "model", str)
    stream = _bool(body, "stream", False)
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise bad_request("stream_options must be an object such as {\"include_usage\": true}", "stream_options")
    if options and not stream:
        raise bad_request("stream_options can only be given with stream: true", "stream_options")
    include_usage = _bool(options or {}, "include_usage", False, "stream_options.include_usage")
    common = dict(
        model=model, stream=stream, include_usage=include_usage,
        temperature=_number(body, "temperature", 1.0, low=0.0),
        top_p=_number(body, "top_p", 1.0, low=0.0, low_open=True, high=1.0),
        top_k=_top_k(body), seed=_int(body, "seed", None, *INT64),
        stop=_stop(body), stop_token_ids=_token_ids(body, "stop_token_ids", allow_empty=True),
        ignore_eos=_bool(body, "ignore_eos", False), return_token_ids=_bool(body, "return_token_ids", False))
    if endpoint == COMPLETIONS:
        return ApiRequest(endpoint=COMPLETIONS, prompt=_prompt(body), max_tokens=_int(body, "max_tokens", 16, 1),
                          **common)
    if endpoint == CHAT:
        max_tokens = _int(body, "max_completion_tokens", None, 1)
        if max_tokens is None:
            max_tokens = _int(body, "max_tokens", None, 1)
        add_generation_prompt = _bool(body, "add_generation_prompt", True)
        continue_final = _bool(body, "continue_final_message", False)
        if continue_final and add_generation_prompt and "add_generation_prompt" in body:
            raise bad_request("continue_final_message and add_generation_prompt cannot both be true", "continue_final_message")
        messages = _messages(body)
        if continue_final and messages[-1]["role"] != "assistant":
            raise bad_request("continue_final_message needs the last message to be the assistant's", "continue_final_message")
        return ApiRequest(endpoint=CHAT, messages=messages, max_tokens=max_tokens,
                          add_generation_prompt=add_generation_prompt and not continue_final,
                          continue_final_message=continue_final, **common)
    raise ValueError(f"unknown endpoint {endpoint!r}")


# --- field checks: each returns the value or raises ApiError(400) naming the field ------------
def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _kind(value) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}.get(
        type(value), "number")


def _neutral(value, neutral: tuple) -> bool:
    """True for null, an empty list or object, or one of `neutral` (same JSON type: true is not 1)."""
    if value is None or (isinstance(value, (list, dict)) and not value):
        return True
    return any(type(value) is type(n) and value == n for n in neutral) or (
        type(value) is float and any(type(n) is int and value == n for n in neutral))


def _optional(body: dict, name: str, kind):
    value = body.get(name)
    if value is not None and not isinstance(value, kind):
        raise bad_request(f"{name} must be a {kind.__name__}, got a JSON {_kind(value)}", name)
    return value


def _bool(body: dict, name: str, default: bool, label: str | None = None) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"{label or name} must be true or false, got a JSON {_kind(value)}", label or name)
    return value


def _int(body: dict, name: str, default, low=None, high=None):
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, float) and value.is_integer() and abs(value) < 2 ** 53:
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(f"{name} must be an integer, got a JSON {_kind(value)}", name)
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f"at least {low}" if high is None else f"between {low} and {high}"
        raise bad_request(f"{name} must be {bounds}, got {value}", name)
    return value


def _number(body: dict, name: str, default: float, low: float, high: float | None = None, low_open: bool = False) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad_request(f"{name} must be a number, got a JSON {_kind(value)}", name)
    value = float(value)
    if not math.isfinite(value) or value < low or (low_open and value == low) or (high is not None and value > high):
        where = f"in ({low:g}, {high:g}]" if low_open else f"at least {low:g}" + (f" and at most {high:g}" if high else "")
        raise bad_request(f"{name} must be {where}, got {value:g}", name)
    return value


def _top_k(body: dict) -> int:
    value = _int(body, "top_k", 0, -1, 2 ** 31 - 1)
    return 0 if value == -1 else value


def _stop(body: dict) -> tuple:
    value = body.get("stop")
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad_request("stop must be a string or a list of strings", "stop")
    if len(stops) > MAX_STOPS:
        raise bad_request(f"stop takes at most {MAX_STOPS} strings, got {len(stops)}", "stop")
    if any(not s or len(s) > MAX_STOP_CHARS for s in stops):
        raise bad_request(f"stop strings must be 1 to {MAX_STOP_CHARS} characters long", "stop")
    return tuple(dict.fromkeys(stops))


def _token_ids(body: dict, name: str, allow_empty: bool = False) -> tuple:
    value = body.get(name)
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise bad_request(f"{name} must be a list of integer token ids", name)
    if not value and not allow_empty:
        raise bad_request(f"{name} must not be empty", name)
    if any(t < 0 for t in value):
        raise bad_request(f"{name} must hold token ids >= 0", name)
    return tuple(value)


def _prompt(body: dict):
    value = body.get("prompt")
    if value is None:
        raise bad_request("prompt is required: a string or a list of token ids", "prompt")
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]  # a batch of one
    if isinstance(value, str):
        if not value:
            raise bad_request("prompt must not be empty", "prompt")
        return value
    if isinstance(value, list) and value and all(isinstance(v, (str, list)) for v in value):
        raise bad_request(f"prompt holds {len(value)} prompts; this server takes one prompt per request", "prompt")
    return _token_ids({"prompt": value}, "prompt")


def _messages(body: dict) -> tuple:
    value = body.get("messages")
    if not isinstance(value, list) or not value:
        raise bad_request("messages must be a non-empty list of {\"role\", \"content\"} objects", "messages")
    out = []
    for i, m in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad_request(f"{where} must be an object with role and content", where)
        role = m.get("role")
        if role not in ROLES:
            raise bad_request(f"{where}.role must be one of {', '.join(ROLES)}", f"{where}.role")
        message = {"role": role, "content": _content(m.get("content"), f"{where}.content")}
        if isinstance(m.get("name"), str):
            message["name"] = m["name"]
        out.append(message)
    return tuple(out)


def _content(value, where: str) -> str:
    """A message's content as text: a string, or text parts joined (other part types are refused)."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = []
        for part in value:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise bad_request(f"{where} parts must be {{\"type\": \"text\", \"text\": ...}}; this model takes text only",
                                  where)
            texts.append(part["text"])
        return "".join(texts)
    raise bad_request(f"{where} must be a string or a list of text parts", where)


__all__ = ["ApiError", "ApiRequest", "CHAT", "COMPLETIONS", "parse_body", "parse_request"]
