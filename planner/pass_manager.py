"""The PassManager: runs named passes in order over a dictionary of facts, timed and cached.

A pass declares the facts it reads and the facts it writes; the manager checks that every read
fact exists before running it, that it wrote exactly what it declared, times it, reports progress
(one line per pass on stderr unless quiet) and caches its outputs keyed by a hash of the pass's
name, version and the fingerprints of the facts it reads. Re-running a pipeline with one input
changed re-runs only the passes downstream of it. Facts that cannot be fingerprinted (an
`nn.Module` without one, an open file) make the pass uncacheable rather than wrongly cached.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np


class Unfingerprintable(Exception):
    """A fact whose content cannot be hashed; passes reading it are not cached."""


def fingerprint(value) -> str:
    """sha256 of a fact's content. Objects may define `fingerprint()` to say what identifies them."""
    h = hashlib.sha256()
    _feed(h, value)
    return h.hexdigest()


def _feed(h, value) -> None:
    if hasattr(value, "fingerprint") and callable(value.fingerprint):
        h.update(b"F" + str(value.fingerprint()).encode())
    elif value is None or isinstance(value, (bool, int, float, str)):
        h.update(b"J" + json.dumps(value).encode())
    elif isinstance(value, bytes):
        h.update(b"B" + value)
    elif isinstance(value, np.ndarray):
        h.update(f"N{value.dtype}{value.shape}".encode() + np.ascontiguousarray(value).tobytes())
    elif isinstance(value, dict):
        h.update(b"D")
        for key in sorted(value, key=str):
            _feed(h, str(key))
            _feed(h, value[key])
    elif isinstance(value, (list, tuple)):
        h.update(b"L%d" % len(value))
        for item in value:
            _feed(h, item)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        h.update(type(value).__name__.encode())
        for f in dataclasses.fields(value):
            _feed(h, f.name)
            _feed(h, getattr(value, f.name))
    elif type(value).__module__.startswith("torch") and hasattr(value, "detach"):
        t = value.detach().to("cpu").contiguous()
        h.update(f"T{t.dtype}{tuple(t.shape)}".encode() + t.numpy().tobytes())
    else:
        raise Unfingerprintable(type(value).__name__)


@dataclass(frozen=True)
class Pass:
    """A named step: `run(facts)` gets the facts it reads and returns the facts it writes."""

    name: str
    reads: tuple
    writes: tuple
    run: Callable
    version: str = "1"
    cacheable: bool = True


@dataclass
class PassRecord:
    name: str
    seconds: float
    cached: bool


@dataclass
class PassManager:
    """Runs passes in order; `cache` persists across `run` calls of the same manager."""

    passes: list
    quiet: bool = False
    stream: object = None
    cache: dict = field(default_factory=dict)
    records: list = field(default_factory=list)

    def _say(self, text: str) -> None:
        if not self.quiet:
            print(text, file=self.stream or sys.stderr, flush=True)

    def run(self, facts: dict) -> dict:
        facts = dict(facts)
        self.records = []
        total = len(self.passes)
        for i, p in enumerate(self.passes, 1):
            missing = [r for r in p.reads if r not in facts]
            if missing:
                raise RuntimeError(f"pass '{p.name}' reads {missing}, which no earlier pass wrote")
            key = self._key(p, facts)
            start = time.perf_counter()
            if key is not None and key in self.cache:
                written, cached = self.cache[key], True
            else:
                self._say(f"[{i}/{total}] {p.name} ...")
                written = p.run({r: facts[r] for r in p.reads}) or {}
                cached = False
                if set(written) != set(p.writes):
                    raise RuntimeError(f"pass '{p.name}' wrote {sorted(written)}, declared {sorted(p.writes)}")
                if key is not None:
                    self.cache[key] = written
            seconds = time.perf_counter() - start
            self.records.append(PassRecord(p.name, seconds, cached))
            self._say(f"[{i}/{total}] {p.name} {'(cached)' if cached else f'done in {seconds:.2f} s'}")
            facts.update(written)
        return facts

    @staticmethod
    def _key(p: Pass, facts: dict):
        if not p.cacheable:
            return None
        try:
            return fingerprint([p.name, p.version, {r: facts[r] for r in p.reads}])
        except Unfingerprintable:
            return None

    def timings(self) -> list:
        return [{"pass": r.name, "seconds": round(r.seconds, 4), "cached": r.cached} for r in self.records]
