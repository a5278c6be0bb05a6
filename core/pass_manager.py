"""The PassManager: orders named passes by the facts they read and write, checks, runs and times them.

Every command that plans or compiles is a list of passes (`planner/pipeline/`). A pass declares
the facts it reads and the facts it writes; the manager orders the list so that every pass runs
after the passes that write what it reads (ties keep the list's order), checks each pass's
precondition before it runs (e.g. the trace matches the model), checks that it wrote exactly what
it declared and that its postcondition holds (e.g. the placement it wrote is a valid placement of
the topology it was asked for), times it, and names the failing pass in the one-line error a user
sees. A pass that breaks (a moeplan bug, not a user error) raises `PassError` naming it and the
passes that ran before it, as torch.fx's pass manager does.
`want` restricts a run to the passes that the wanted facts depend on, given the facts already
there: `moeplan plan` is its target's list asked for the plan, `moeplan codegen` the same list
given the plan and asked for the bundle.

No result cache: planning passes are either cheap or keep their own content-keyed cache on disk
(operator profiles under `--cache-dir`), and an in-memory cache only ever hit within one process.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from collections.abc import Callable

from moeplan.core import progress
from moeplan.core.errors import UserError


@dataclass(frozen=True)
class Pass:
    """A named step: `run(facts)` gets the facts it reads and returns the facts it writes.

    `check(facts)`, if given, is the pass's precondition over the same facts: it raises
    `UserError` when the inputs cannot be right (before any work is spent on them).
    `ensures(facts)`, if given, is its postcondition over the facts it read and wrote: it raises
    (any exception) when the pass produced something it must not.
    """

    name: str
    reads: tuple
    writes: tuple
    run: Callable
    check: Callable | None = None
    ensures: Callable | None = None


class PassError(RuntimeError):
    """A pass broke (an exception that is not the user's, a wrong set of facts, a failed
    postcondition): names the pass and the passes that ran before it."""

    def __init__(self, name: str, before: list, what: str):
        self.pass_name, self.before = name, list(before)
        after = f"after the passes {', '.join(before)}" if before else "as the first pass"
        super().__init__(f"pass '{name}' ({after}) {what}")


@dataclass
class PassRecord:
    name: str
    seconds: float


def _writers(passes: list) -> dict:
    writer = {}
    for p in passes:
        for w in p.writes:
            if w in writer:
                raise RuntimeError(f"passes '{writer[w].name}' and '{p.name}' both write '{w}'")
            writer[w] = p
    return writer


def order_passes(passes: list, available) -> list:
    """Passes in dependency order: each after the writers of what it reads; ties in list order.

    Raises `RuntimeError` (a moeplan bug, not a user error) when a pass reads a fact that neither
    the inputs nor any pass provides, when two passes write the same fact, or on a cycle.
    """
    writer = _writers(passes)
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


def needed_passes(passes: list, want, available) -> list:
    """The passes of `passes` whose writes the facts `want` depend on, transitively, given the facts
    `available` (a pass whose every write is available is not needed), in list order."""
    writer = _writers(passes)
    keep, seen, stack = [], set(), [w for w in want if w not in available]
    while stack:
        fact = stack.pop()
        if fact in seen or fact in available:
            continue
        seen.add(fact)
        if fact not in writer:
            raise RuntimeError(f"no pass writes '{fact}' and it is not given")
        p = writer[fact]
        if p not in keep:
            keep.append(p)
            stack.extend(p.reads)
    return [p for p in passes if p in keep]


@dataclass
class PassManager:
    """Runs a pass list over a dictionary of facts; `records` holds the last run's timings.

    Progress: on a terminal (stderr), the running pass live with its elapsed time and a line per
    finished pass (`core/progress.py`); nothing when stderr is not a terminal or with `quiet`;
    every line, start and end, on `stream` when one is given.
    """

    passes: list
    quiet: bool = False
    stream: object = None
    records: list = field(default_factory=list)

    def _say(self, text: str) -> None:
        if not self.quiet:
            progress.say(text, self.stream)

    def run(self, facts: dict, want: tuple | None = None) -> dict:
        facts = dict(facts)
        self.records = []
        passes = self.passes if want is None else needed_passes(self.passes, want, facts)
        ordered = order_passes(passes, facts)
        total = len(ordered)
        live = not self.quiet and progress.enabled()
        for i, p in enumerate(ordered, 1):
            view = {r: facts[r] for r in p.reads}
            before = [r.name for r in self.records]
            start = time.perf_counter()
            if not live:
                self._say(f"[{i}/{total}] {p.name} ...")
            with progress.step(f"[{i}/{total}] {p.name}", show=live):
                written = self._run_one(p, view, before)
            seconds = time.perf_counter() - start
            self.records.append(PassRecord(p.name, seconds))
            self._say(f"[{i}/{total}] {p.name} done in {seconds:.2f} s")
            facts.update(written)
        return facts

    @staticmethod
    def _run_one(p: Pass, view: dict, before: list) -> dict:
        """The pass's precondition, the pass, the facts it wrote and its postcondition."""
        try:
            if p.check is not None:
                p.check(view)
            written = p.run(view) or {}
        except UserError as exc:
            raise UserError(f"{p.name}: {exc}") from None
        except Exception as exc:
            raise PassError(p.name, before, f"failed: {type(exc).__name__}: {exc}") from exc
        if set(written) != set(p.writes):
            raise PassError(p.name, before, f"wrote {sorted(written)}, declared {sorted(p.writes)}")
        if p.ensures is not None:
            try:
                p.ensures({**view, **written})
            except Exception as exc:
                raise PassError(p.name, before, f"broke its postcondition: {exc}") from exc
        return written

    def timings(self) -> list:
        return [{"pass": r.name, "seconds": round(r.seconds, 4)} for r in self.records]
