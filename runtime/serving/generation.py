"""One request's life on the front: submit it to the engine, turn its TokenEvents into text pieces.

The engine calls the request's sink from its own thread; the sink hands each event to the front's
event loop (`call_soon_threadsafe`), where `pieces()` reads them in order and yields Pieces: new
text (cut at stop strings, text_stream.py), the new token ids, and at the end the finish reason.
Where the engine got ahead of the consumer (several events queued when it reads), they make one
piece, so a stream under load writes and its client parses one chunk per turn of the front, not
one per token (vLLM 0.32 merges so too: `RequestOutputCollector`, vllm/v1/engine/output_processor.py).
A stop string, a consumer that stops reading (client gone) or `close()` cancels the engine's
request (`EngineClient.cancel`), so its batch slot is freed by the next step.

Hangs: while waiting for an event, the engine's health is checked every `poll_s`; a request whose
engine went unhealthy ends with an error piece instead of waiting forever (the engine is expected
to end it with FINISH_ERROR itself; this is the front's guarantee should that event never come).

Latency: time to first token from the request's arrival (the front's clock, time.monotonic, the
same clock as TokenEvent.time_s), inter-token latency between successive token events.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from .api_errors import ApiError, from_engine
from .contract import (FINISH_ABORT, FINISH_ERROR, FINISH_LENGTH, FINISH_STOP, GenerationRequest, InvalidRequest,
                       Overloaded, RequestTooLong, Unavailable)
from .text_stream import TextStream


@dataclass
class Piece:
    """New text and token ids; on the last piece `finish_reason` ("stop", "length") and
    `stop_reason` (the matched stop string), or `error` (the request failed: no finish reason)."""

    text: str
    token_ids: list = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | None = None
    error: str | None = None


class Generation:
    def __init__(self, client, request: GenerationRequest, decode, stops: tuple, metrics=None,
                 arrival_s: float | None = None, poll_s: float = 1.0):
        self.client, self.request, self.metrics, self.poll_s = client, request, metrics, poll_s
        self.stream = TextStream(decode, stops)
        self.arrival_s = time.monotonic() if arrival_s is None else arrival_s
        self.loop = asyncio.get_running_loop()
        self.events: asyncio.Queue = asyncio.Queue()
        self.completion_tokens = 0
        self.last_token_s: float | None = None
        self.done = False
        self.submitted = False

    def submit(self) -> None:
        """Queue the request in the engine; its refusals become ApiErrors (429, 400, 503)."""
        try:
            self.client.submit(self.request, self._sink)
        except (Overloaded, RequestTooLong, InvalidRequest, Unavailable) as exc:
            self.done = True
            raise from_engine(exc) from None
        self.submitted = True
        if self.metrics is not None:
            self.metrics.prompt_tokens += len(self.request.prompt_ids)

    def _sink(self, event) -> None:  # engine thread
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the front's loop is closed: nobody is listening any more
            pass

    def close(self) -> None:
        """The consumer is done (or gone): cancel the engine's request if it has not finished."""
        if self.submitted and not self.done:
            self.done = True
            self.client.cancel(self.request.request_id)

    async def pieces(self):
        try:
            while not self.done:
                try:
                    event = await asyncio.wait_for(self.events.get(), self.poll_s)
                except asyncio.TimeoutError:
                    if not self.client.healthy():
                        yield self._end(Piece("", error="the engine stopped (a rank is down); the request did not finish"))
                    continue
                piece = self._on_event(event)
                while not self.done and not self.events.empty():  # the engine got ahead of the consumer
                    piece = _merged(piece, self._on_event(self.events.get_nowait()))
                if piece is not None:
                    yield piece
        finally:
            self.close()

    def _on_event(self, event):
        text, ids, stop = "", [], None
        if event.token_id >= 0:
            self._timing(event.time_s)
            ids.append(event.token_id)
            text, stop = self.stream.push(event.token_id)
            if stop is not None:
                return self._end(Piece(text, ids, FINISH_STOP, stop))  # the engine's request is cancelled
        if event.finish_reason is None:
            return Piece(text, ids) if (text or ids) else None
        if event.finish_reason in (FINISH_STOP, FINISH_LENGTH):
            more, stop = self.stream.finish()
            reason = FINISH_STOP if stop is not None else event.finish_reason
            return self._end(Piece(text + more, ids, reason, stop), engine_finished=True)
        why = event.error if event.finish_reason == FINISH_ERROR else None
        return self._end(Piece(text, ids, error=why or f"the engine ended the request ({event.finish_reason})"),
                         engine_finished=event.finish_reason in (FINISH_ERROR, FINISH_ABORT))

    def _timing(self, time_s: float) -> None:
        self.completion_tokens += 1
        if self.metrics is None:
            return
        self.metrics.generation_tokens += 1
        if self.last_token_s is None:
            self.metrics.ttft.observe(time_s - self.arrival_s)
        else:
            self.metrics.itl.observe(time_s - self.last_token_s)
        self.last_token_s = time_s

    def _end(self, piece: Piece, engine_finished: bool = False) -> Piece:
        if engine_finished:
            self.done = True
        else:
            self.close()
        if self.metrics is not None:
            self.metrics.request_finished(piece.finish_reason or "error")
            self.metrics.e2e.observe(time.monotonic() - self.arrival_s)
        return piece


def _merged(first: Piece | None, then: Piece | None) -> Piece | None:
    """One piece saying what `first` and then `then` say (either may be None: nothing to say)."""
    if first is None or then is None:
        return first or then
    return Piece(first.text + then.text, first.token_ids + then.token_ids, then.finish_reason, then.stop_reason,
                 then.error)


__all__ = ["ApiError", "Generation", "Piece"]
