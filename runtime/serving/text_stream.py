"""Generated token ids -> text deltas, cut at the first stop string.

Detokenizing: tokenizers do not decode token by token (a UTF-8 character or a byte-level BPE
symbol can span tokens, and decoders clean up spaces), so each step decodes a short window,
`ids[prefix:]`, and emits what it adds beyond `ids[prefix:read]` (the window's already-emitted
part), as vLLM's incremental detokenizer and transformers' TextStreamer do; a trailing U+FFFD
(a character cut between tokens) waits for the next token.

Stop strings (OpenAI `stop`): the output ends just before the earliest occurrence of any of them
(the stop string is not returned). Text that could be the start of a stop string is held back
until the next token says whether it is, so a client never receives text that a later match
would have cut.
"""
from __future__ import annotations

from collections.abc import Callable

REPLACEMENT = "\ufffd"


class TextStream:
    """push(token id) -> (text delta, matched stop string or None); finish() -> the last held text."""

    def __init__(self, decode: Callable[[list], str], stops: tuple = ()):
        self.decode, self.stops = decode, tuple(s for s in stops if s)
        self.longest = max((len(s) for s in self.stops), default=0)
        self.ids: list = []
        self.prefix = self.read = 0  # window start; end of the window's emitted part
        self.text = ""  # everything detokenized so far
        self.sent = 0  # characters of self.text given out
        self.stopped: str | None = None

    def push(self, token_id: int) -> tuple:
        if self.stopped is not None:
            return "", self.stopped
        self.ids.append(int(token_id))
        before = self.decode(self.ids[self.prefix:self.read])
        now = self.decode(self.ids[self.prefix:])
        if len(now) > len(before) and not now.endswith(REPLACEMENT):
            self.text += now[len(before):]
            self.prefix, self.read = self.read, len(self.ids)
        return self._release(final=False)

    def finish(self) -> tuple:
        """No more tokens: flush what decoding held back (a cut character stays U+FFFD) and any
        possible stop-string start."""
        if self.stopped is not None:
            return "", self.stopped
        if self.read < len(self.ids):
            before = self.decode(self.ids[self.prefix:self.read])
            self.text += self.decode(self.ids[self.prefix:])[len(before):]
            self.prefix = self.read = len(self.ids)
        return self._release(final=True)

    def _release(self, final: bool) -> tuple:
        start = max(0, self.sent - self.longest + 1)
        hits = [(self.text.find(s, start), -len(s), s) for s in self.stops]
        hits = [h for h in hits if h[0] >= 0]
        if hits:
            at, _, stop = min(hits)  # earliest; at equal positions the longest
            delta, self.sent, self.stopped = self.text[self.sent:at], at, stop
            return delta, stop
        end = len(self.text) if final else len(self.text) - self._held_tail()
        delta, self.sent = self.text[self.sent:end], max(self.sent, end)
        return delta, None

    def _held_tail(self) -> int:
        """Length of the longest unsent tail of the text that is a proper prefix of a stop string."""
        tail = self.text[self.sent:]
        for k in range(min(len(tail), self.longest - 1), 0, -1):
            piece = tail[-k:]
            if any(s.startswith(piece) for s in self.stops):
                return k
        return 0

    def released(self) -> str:
        return self.text[:self.sent]
