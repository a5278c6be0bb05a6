"""When a generated token ends its sequence: one rule for every loop that generates, the service's
scheduler (`scheduler.py`) and a Lambda execution's decode (`lambda_/decode.py`).

A sampled stop id ends the sequence and is not emitted (finish reason "stop", as OpenAI's API
reports a stop sequence); any other token is emitted, and the sequence ends with "length" once it
has emitted `max_tokens`. A static run (`static_batch.py`) has no stop ids and no early end: it
always generates exactly its new tokens.
"""
from __future__ import annotations

from .contract import FINISH_LENGTH, FINISH_STOP


def token_outcome(token: int, stops, emitted: int, max_tokens: int) -> tuple:
    """(emit the token?, finish reason or None) for a sequence that has emitted `emitted` tokens
    and samples `token`; `stops`: its stop ids (a set; empty with ignore_eos)."""
    if token in stops:
        return False, FINISH_STOP
    return True, FINISH_LENGTH if emitted + 1 >= max_tokens else None
