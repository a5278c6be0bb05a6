"""The seam between the HTTP front (rank 0) and the continuous-batching engine (every rank).

Why a seam: the front speaks HTTP and the OpenAI API and knows text (tokenizer, chat template,
stop strings); the engine knows token ids, ranks, expert parallelism and the KV cache. The front
hands the engine `GenerationRequest`s and receives `TokenEvent`s; nothing else crosses.

Threads: the front's event loop calls `EngineClient` methods from its own thread; the engine
calls each request's `sink` from the engine's thread, one event at a time, in token order. A sink
must not block (the front hands the event to its loop with `call_soon_threadsafe`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol
from collections.abc import Callable

FINISH_STOP, FINISH_LENGTH, FINISH_ABORT, FINISH_ERROR = "stop", "length", "abort", "error"


@dataclass(frozen=True)
class SamplingParams:
    """The OpenAI sampling fields the engine applies to logits. temperature 0 is greedy (argmax,
    ties to the lowest id, as torch.argmax); top_k 0 or -1 means off; seed None draws from the
    engine's own generator, an int makes the request's samples reproducible whatever shares its batch."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None


@dataclass(frozen=True)
class GenerationRequest:
    """One sequence to generate. `prompt_ids` already tokenized (chat template applied) by the front.
    The engine stops on `max_tokens` (finish "length") or on a token of `stop_token_ids` unless
    `ignore_eos` (finish "stop", the stop token itself is not emitted); stop *strings* are the
    front's: it cancels the request when the decoded text reaches one."""

    request_id: str
    prompt_ids: tuple
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop_token_ids: tuple = ()
    ignore_eos: bool = False


@dataclass(frozen=True)
class TokenEvent:
    """One step's news for one request: a new token (token_id >= 0), or the end (finish_reason set;
    then token_id is -1 unless the last token and the end arrive together). `error` says why for
    FINISH_ERROR (a rank died, the engine failed). Times are time.monotonic() seconds on rank 0."""

    request_id: str
    token_id: int
    finish_reason: str | None = None
    error: str | None = None
    time_s: float = 0.0


class Overloaded(Exception):
    """The bounded queue is full: the front answers 429 with Retry-After `retry_after_s`."""

    def __init__(self, message: str, retry_after_s: float = 1.0):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class RequestTooLong(Exception):
    """Prompt + max_tokens exceeds the plan's context capacity: the front answers 400."""


class InvalidRequest(ValueError):
    """The request cannot run as given (prompt ids outside the vocabulary, an empty prompt,
    max_tokens < 1, temperature < 0, top_p outside (0, 1], a request_id already in flight): the
    front answers 400 with the message."""


class Unavailable(Exception):
    """The engine is draining (SIGTERM) or a rank is down: the front answers 503."""


class EngineClient(Protocol):
    """What rank 0's engine offers the front."""

    model_name: str
    max_context: int  # prompt + max_tokens limit from the plan's capacity decision

    def submit(self, request: GenerationRequest, sink: Callable[[TokenEvent], None]) -> None:
        """Queue a request (it joins the batch at the next step boundary); raises Overloaded,
        RequestTooLong, InvalidRequest or Unavailable without queueing it."""

    def cancel(self, request_id: str) -> None:
        """The client went away or a stop string matched: the request leaves the batch by the next
        step and its sink gets a final FINISH_ABORT event. Unknown or finished ids are ignored."""

    def healthy(self) -> bool:
        """True only while every rank is up and the engine loop is alive."""

    def drain(self) -> None:
        """Stop admitting (submit raises Unavailable); in-flight requests run to their end."""

    def idle(self) -> bool:
        """True when nothing is running or waiting (after drain(): safe to exit)."""

    def metrics(self) -> dict:
        """Engine-side figures for /metrics: {"running": int, "waiting": int,
        "exchange_bytes": {(layer, kind): bytes}, "expert_cache": {"hits": int, "misses": int,
        "prefetches": int, "prefetch_hits": int, "host_computed": int},
        "gpu_local_fraction": float | None, "steps": int}. Token counts and latency histograms are
        the front's (it sees every event's time)."""
