"""The OpenAI API over an EngineClient, without an HTTP framework: (method, path, headers, body)
in, a JSON answer or a stream of Server-Sent Events out.

`http_server.py` puts this behind uvicorn/starlette on rank 0; the Lambda bundle's front function
can put it behind API Gateway. Every path answers with an OpenAI-shaped body; nothing here raises
to the caller (a bug becomes a 500 body, logged), so the server keeps serving after any request.

Routes: GET /v1/models, POST /v1/completions, POST /v1/chat/completions, GET /health (200 only
while every rank is up and the engine is not draining), GET /metrics (Prometheus text). With an
API key, /v1/ routes need `Authorization: Bearer <key>` (401 otherwise); /health and /metrics stay
open for probes and scrapers, as vLLM does.
"""
from __future__ import annotations

import hmac
import logging
import time
import uuid
from dataclasses import dataclass, field

from . import prompt_check
from .api_errors import ApiError, error_body
from .api_request import CHAT, COMPLETIONS, parse_request
from .api_response import DONE, ResponseWriter, models_list, sse
from .generation import Generation
from .prometheus import ServingMetrics

log = logging.getLogger("moeplan.serving")
MAX_BODY_BYTES = 8 << 20
ROUTES = {("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
          ("GET", "/health"), ("GET", "/metrics")}


@dataclass
class Answer:
    """status, headers, and either `body` (JSON object or text) or `chunks` (an async iterator of
    SSE bytes); `close()` must be called once the answer is sent or abandoned."""

    status: int
    body: object = None
    chunks: object = None
    headers: dict = field(default_factory=dict)
    media_type: str = "application/json"
    generation: Generation | None = None
    on_close: object = None

    def close(self) -> None:
        if self.generation is not None:
            self.generation.close()
        if self.on_close is not None:
            self.on_close()
            self.on_close = None


class OpenAIService:
    def __init__(self, client, served, api_key: str | None = None, poll_s: float = 1.0):
        self.client, self.served, self.api_key, self.poll_s = client, served, api_key, poll_s
        self.metrics = ServingMetrics(served.name)
        self.created = int(time.time())
        self.draining = False  # set by whoever calls client.drain() (http_server on SIGTERM)
        self.open_answers = 0  # generation answers not yet fully written (drain waits for them)

    async def handle(self, method: str, path: str, headers: dict, body: bytes) -> Answer:
        """`headers` with lower-case names. Never raises: errors are answers."""
        try:
            answer = await self._route(method.upper(), path.rstrip("/") or "/", headers, body)
        except ApiError as exc:
            answer = Answer(exc.status, exc.body(), headers=exc.headers())
        except Exception:  # a bug: the client gets a 500 body and the server goes on
            log.exception("request %s %s failed", method, path)
            answer = Answer(500, error_body(500, "internal error in the serving front; see the server log"))
        if answer.status >= 400:
            self.metrics.request_refused(answer.status)
        return answer

    async def _route(self, method, path, headers, body) -> Answer:
        if (method, path) not in ROUTES:
            known = {p for _, p in ROUTES}
            if path in known:
                raise ApiError(405, f"{path} does not take {method}")
            raise ApiError(404, f"no route {method} {path}; this server serves {', '.join(sorted(known))}")
        if path == "/health":
            return self.health()
        if path == "/metrics":
            return Answer(200, self.metrics.render(self.client.metrics()), media_type="text/plain; version=0.0.4; charset=utf-8")
        self._authorize(headers)
        if path == "/v1/models":
            return Answer(200, models_list(self.served.name, self.created, self.client.max_context, self.served.describe()))
        if len(body) > MAX_BODY_BYTES:
            raise ApiError(413, f"the request body has {len(body)} bytes; this server takes at most {MAX_BODY_BYTES}")
        return await self.generate(COMPLETIONS if path == "/v1/completions" else CHAT, body)

    def health(self) -> Answer:
        if not self.client.healthy():
            return Answer(503, {"status": "unhealthy", "detail": "a rank is down or the engine has stopped"})
        if self.draining:
            return Answer(503, {"status": "draining", "detail": "shutting down; finishing the requests in flight"})
        return Answer(200, {"status": "ok"})

    def _authorize(self, headers: dict) -> None:
        if self.api_key is None:
            return
        given = headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
            raise ApiError(401, "missing or wrong API key; send 'Authorization: Bearer <key>'")

    async def generate(self, endpoint: str, body: bytes) -> Answer:
        arrival = time.monotonic()
        if self.draining:
            raise ApiError(503, "the server is shutting down and takes no new requests", retry_after_s=1.0)
        api = parse_request(endpoint, body)
        ids = prompt_check.prompt_ids(api, self.served)
        request_id = f"{'chatcmpl' if endpoint == CHAT else 'cmpl'}-{uuid.uuid4().hex}"
        request = prompt_check.generation_request(api, self.served, ids, request_id, self.client.max_context)
        generation = Generation(self.client, request, self.served.codec.decode, api.stop, self.metrics, arrival,
                                self.poll_s)
        generation.submit()
        self.open_answers += 1
        writer = ResponseWriter(endpoint, request_id, int(time.time()), self.served.name, ids, api.return_token_ids,
                                api.include_usage)
        if api.stream:
            return Answer(200, chunks=self._stream(generation, writer, api.return_token_ids), generation=generation,
                          media_type="text/event-stream", on_close=self._answer_closed)
        try:
            return await self._whole(generation, writer)
        finally:
            generation.close()
            self._answer_closed()

    def _answer_closed(self) -> None:
        self.open_answers -= 1

    async def _whole(self, generation: Generation, writer: ResponseWriter) -> Answer:
        texts, ids = [], []
        async for piece in generation.pieces():
            if piece.error is not None:
                raise ApiError(503, f"generation failed: {piece.error}")
            texts.append(piece.text)
            ids += piece.token_ids
            if piece.finish_reason is not None:
                return Answer(200, writer.response("".join(texts), ids, piece.finish_reason, piece.stop_reason))
        raise ApiError(503, "generation ended without a finish reason")

    async def _stream(self, generation: Generation, writer: ResponseWriter, with_ids: bool):
        try:
            if writer.chat:  # the role first, as OpenAI's chat streams begin
                yield sse(writer.chunk("", []))
            async for piece in generation.pieces():
                if piece.error is not None:
                    yield sse(error_body(503, f"generation failed: {piece.error}"))
                    break
                if piece.text or piece.finish_reason is not None or (with_ids and piece.token_ids):
                    yield sse(writer.chunk(piece.text, piece.token_ids, piece.finish_reason, piece.stop_reason))
                if piece.finish_reason is not None:
                    if writer.include_usage:
                        yield sse(writer.usage_chunk(generation.completion_tokens))
                    break
            yield DONE
        finally:
            generation.close()
