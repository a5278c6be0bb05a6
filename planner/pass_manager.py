"""The PassManager: orders named passes by the facts they read and write, checks, runs and times them.

Every command that plans or compiles is a list of passes (`planner/pipeline/`). A pass declares
the facts it reads and the facts it writes; the manager orders the list so that every pass runs
after the passes that write what it reads (ties keep the list's order), checks each pass's
precondition before it runs (e.g. the trace matches the model), checks that it wrote exactly what
it declared, times it, and names the failing pass in the one-line error a user sees.
`want` restricts a run to the passes that the wanted facts depend on: `moeplan plan` is its
target's list asked for the plan alone, so it stops before codegen and skips what only codegen
needs (the runtime's model files).

No result cache: planning passes are either cheap or keep their own content-keyed cache on disk
(operator profiles under `--cache-dir`), and an in-memory cache only ever hit within one process.
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from moeplan.planner.errors import UserError


@dataclass(frozen=True)
class Pass:
    """A named step: `run(facts)` gets the facts it reads and returns the facts it writes.

    `check(facts)`, if given, is the pass's precondition over the same facts: it raises
    `UserError` when the inputs cannot be right (before any work is spent on them).
    """

    name: str
    reads: tuple
    writes: tuple
    run: Callable
    check: Optional[Callable] = None


@dataclass
class PassRecord:
    name: str
    seconds: float


def order_passes(passes: list, available) -> list:
    """Passes in dependency order: each after the writers of what it reads; ties in list order.

    Raises `RuntimeError` (a moeplan bug, not a user error) when a pass reads a fact that neither
    the inputs nor any pass provides, when two passes write the same fact, or on a cycle.
    """
    writer = {}
    for p in passes:
        for w in p.writes:
            if w in writer:
                raise RuntimeError(f"passes '{writer[w].name}' and '{p.name}' both write '{w}'")
            writer[w] = p
    for p in passes:
        missing = [r for r in p.reads if r not in available and r not in writer]
        if missing:
            raise RuntimeError(f"pass '{p.name}' reads {missing}, which no input or pass provides")
    done, ordered, pending = set(available), [], list(passes)
    while pending:
        ready = next((p for p in pending if all(r in done for r in p.reads)), None)
        if ready is None:
            raise RuntimeError(f"passes {[p.name for p in pending]} depend on each other in a cycle")
        pending.remove(ready)
        ordered.append(ready)
        done.update(ready.writes)
    return ordered


def needed_passes(ordered: list, want, available) -> list:
    """The passes of `ordered` whose writes the facts `want` depend on, transitively, in order."""
    needed, keep = set(want) - set(available), []
    for p in reversed(ordered):
        if needed & set(p.writes):
            keep.append(p)
            needed |= set(r for r in p.reads if r not in available)
    missing = needed - set(available) - {w for p in keep for w in p.writes}
    if missing:
        raise RuntimeError(f"no pass writes {sorted(missing)}")
    return list(reversed(keep))


@dataclass
class PassManager:
    """Runs a pass list over a dictionary of facts; `records` holds the last run's timings."""

    passes: list
    quiet: bool = False
    stream: object = None
    records: list = field(default_factory=list)

    def _say(self, text: str) -> None:
        if not self.quiet:
            print(text, file=self.stream or sys.stderr, flush=True)

    def run(self, facts: dict, want: tuple | None = None) -> dict:
        facts = dict(facts)
        self.records = []
        ordered = order_passes(self.passes, facts)
        if want is not None:
            ordered = needed_passes(ordered, want, facts)
        total = len(ordered)
        for i, p in enumerate(ordered, 1):
            view = {r: facts[r] for r in p.reads}
            start = time.perf_counter()
            self._say(f"[{i}/{total}] {p.name} ...")
            try:
                if p.check is not None:
                    p.check(view)
                written = p.run(view) or {}
            except UserError as exc:
                raise UserError(f"{p.name}: {exc}") from None
            if set(written) != set(p.writes):
                raise RuntimeError(f"pass '{p.name}' wrote {sorted(written)}, declared {sorted(p.writes)}")
            seconds = time.perf_counter() - start
            self.records.append(PassRecord(p.name, seconds))
            self._say(f"[{i}/{total}] {p.name} done in {seconds:.2f} s")
            facts.update(written)
        return facts

    def timings(self) -> list:
        return [{"pass": r.name, "seconds": round(r.seconds, 4)} for r in self.records]
