"""Response bodies, stream chunks and Server-Sent Events framing of the OpenAI API (no HTTP here).

Shapes as vLLM writes them (vllm-project/vllm at 002032ee2b18:
`vllm/entrypoints/openai/completion/protocol.py` CompletionResponse / CompletionStreamResponse,
`vllm/entrypoints/openai/chat_completion/protocol.py` ChatCompletionResponse /
ChatCompletionStreamResponse) and SGLang 0.5.23 (`python/sglang/srt/entrypoints/openai/protocol.py`):
* completions: `{"id": "cmpl-…", "object": "text_completion", "created", "model", "choices":
  [{"index", "text", "logprobs": null, "finish_reason", "stop_reason"}], "usage"}`; with
  `return_token_ids` each choice carries `token_ids` and `prompt_token_ids` (vLLM puts the
  prompt's ids in the choice for completions);
* chat: `{"id": "chatcmpl-…", "object": "chat.completion", …, "choices": [{"index", "message":
  {"role": "assistant", "content"}, "logprobs": null, "finish_reason", "stop_reason"}], "usage"}`;
  with `return_token_ids` the choice carries `token_ids` and the response `prompt_token_ids`;
* stream chunks: the same `id` and `created` in every chunk, `object` "text_completion" or
  "chat.completion.chunk"; chat's first chunk carries `delta.role`; the prompt's ids ride on the
  first chunk, each chunk's new ids in its choice's `token_ids`; `finish_reason` on the last
  content chunk; with `stream_options.include_usage` every chunk has `usage: null` and one last
  chunk `choices: []` carries the usage (OpenAI's documented shape); then `data: [DONE]`.
* `stop_reason` (vLLM's extension): the stop string that ended the text, else null.
"""
from __future__ import annotations

import json

DONE = b"data: [DONE]\n\n"


def sse(payload: dict) -> bytes:
    """One Server-Sent Event carrying a JSON object (compact, UTF-8, one line)."""
    return b"data: " + json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode("utf-8") + b"\n\n"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": int(prompt_tokens), "completion_tokens": int(completion_tokens),
            "total_tokens": int(prompt_tokens) + int(completion_tokens)}


def models_list(name: str, created: int, max_context: int, details: dict) -> dict:
    card = {"id": name, "object": "model", "created": int(created), "owned_by": "moeplan", "root": name,
            "max_model_len": int(max_context)}
    card.update(details)
    return {"object": "list", "data": [card]}


class ResponseWriter:
    """Builds every body of one request, so that its chunks share id, created and model."""

    def __init__(self, endpoint: str, request_id: str, created: int, model: str, prompt_ids: list,
                 return_token_ids: bool, include_usage: bool):
        self.chat = endpoint == "chat"
        self.id, self.created, self.model = request_id, int(created), model
        self.prompt_ids, self.return_token_ids, self.include_usage = list(prompt_ids), return_token_ids, include_usage
        self.first_chunk = True

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def _choice(self, content: dict, finish_reason, stop_reason) -> dict:
        return {"index": 0, **content, "logprobs": None, "finish_reason": finish_reason, "stop_reason": stop_reason}

    def _ids(self, body: dict, choice: dict, token_ids: list, with_prompt: bool) -> None:
        """return_token_ids: the choice's new ids; the prompt's on the response (chat) or choice (completions)."""
        if not self.return_token_ids:
            return
        choice["token_ids"] = list(token_ids)
        if with_prompt:
            (body if self.chat else choice)["prompt_token_ids"] = self.prompt_ids

    def response(self, text: str, token_ids: list, finish_reason: str, stop_reason) -> dict:
        """The whole answer of a non-streaming request."""
        content = {"message": {"role": "assistant", "content": text}} if self.chat else {"text": text}
        choice = self._choice(content, finish_reason, stop_reason)
        body = self._head("chat.completion" if self.chat else "text_completion")
        self._ids(body, choice, token_ids, with_prompt=True)
        body.update(choices=[choice], usage=usage(len(self.prompt_ids), len(token_ids)))
        return body

    def chunk(self, text: str, token_ids: list, finish_reason: str | None = None, stop_reason=None) -> dict:
        """One streamed piece: new text (and ids), and on the last piece the finish reason."""
        if self.chat:
            delta = {"role": "assistant", "content": text} if self.first_chunk else {"content": text} if text else {}
            content = {"delta": delta}
        else:
            content = {"text": text}
        choice = self._choice(content, finish_reason, stop_reason)
        body = self._head("chat.completion.chunk" if self.chat else "text_completion")
        self._ids(body, choice, token_ids, with_prompt=self.first_chunk)
        body["choices"] = [choice]
        if self.include_usage:
            body["usage"] = None
        self.first_chunk = False
        return body

    def usage_chunk(self, completion_tokens: int) -> dict:
        """The last chunk with `stream_options.include_usage`: no choices, the request's usage."""
        body = self._head("chat.completion.chunk" if self.chat else "text_completion")
        body.update(choices=[], usage=usage(len(self.prompt_ids), completion_tokens))
        return body
