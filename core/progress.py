"""Progress on stderr for the steps that take a while: shown only when stderr is a terminal.

A pass of the pass manager, the shards codegen writes, trace recording, `run --verify`'s launch of
the ranks: each runs inside `step(description, total)`, which shows a live line (spinner, elapsed
time, and a bar when the total is known) while a terminal watches, and nothing otherwise, so logs,
pipes and `--json` output stay as they were. `--json` and `--quiet` turn it off (`silenced`).
Progress lines (`say`: a pass done, a solver's iteration) follow the same rule: above the live
step on a terminal, nothing when stderr is piped or redirected (the README's promise; `--json`
reports every pass's seconds). Uses rich.
"""
from __future__ import annotations

import contextlib
import sys
import threading

_lock = threading.RLock()
_state = {"silenced": 0, "live": None, "tasks": 0}


def enabled() -> bool:
    """True when progress is shown: stderr is a terminal and no command asked for silence."""
    try:
        tty = sys.stderr.isatty()
    except (AttributeError, ValueError):
        tty = False
    return tty and _state["silenced"] == 0


@contextlib.contextmanager
def silenced(on: bool = True):
    """No progress inside (for --json and --quiet); nests."""
    _state["silenced"] += int(on)
    try:
        yield
    finally:
        _state["silenced"] -= int(on)


def _bar_column():
    from rich.progress import BarColumn, ProgressColumn
    from rich.table import Table
    from rich.text import Text

    class Bar(ProgressColumn):
        """A bar and `done/total` when the total is known; nothing for a spinner-only step."""

        def __init__(self):
            super().__init__()
            self.bar = BarColumn(bar_width=30)

        def render(self, task):
            if task.total is None:
                return Text("")
            grid = Table.grid(padding=(0, 1))
            grid.add_row(self.bar.render(task), Text(f"{int(task.completed)}/{int(task.total)}"))
            return grid

    return Bar()


def _noop(advance: int = 1, **_) -> None:
    return None


@contextlib.contextmanager
def step(description: str, total: int | None = None, show: bool | None = None):
    """Show `description` live while the block runs; yields `advance(n=1, description=None,
    completed=None, total=None)` (move on by n units, or set the units done and the total).

    `total`: the units of work (a bar and a count); None: a spinner and the elapsed time only.
    `show`: force on or off (default: `enabled()`).
    """
    if not (enabled() if show is None else show):
        yield _noop
        return
    with _lock:
        if _state["live"] is None:
            from rich.console import Console
            from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

            columns = [SpinnerColumn(), TextColumn("{task.description}"), _bar_column(), TimeElapsedColumn()]
            _state["live"] = Progress(*columns, console=Console(file=sys.stderr), transient=True)
            _state["live"].start()
        live = _state["live"]
        task = live.add_task(description, total=total)
        _state["tasks"] += 1

    def advance(n: int = 1, description: str | None = None, completed: int | None = None, total: int | None = None) -> None:
        changes = {k: v for k, v in (("description", description), ("total", total)) if v is not None}
        live.update(task, **({"completed": completed} if completed is not None else {"advance": n}), **changes)

    try:
        yield advance
    finally:
        with _lock:
            live.remove_task(task)
            _state["tasks"] -= 1
            if _state["tasks"] == 0:
                live.stop()
                _state["live"] = None


def say(text: str, stream=None) -> None:
    """A progress line: on `stream` when one is given, else on stderr only where progress is shown
    (`enabled()`: a terminal), above the live step when there is one."""
    if stream is not None and stream is not sys.stderr:
        print(text, file=stream, flush=True)
        return
    if not enabled():
        return
    live = _state["live"]
    if live is not None:
        live.console.print(text, highlight=False, markup=False)
    else:
        print(text, file=sys.stderr, flush=True)
