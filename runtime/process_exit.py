"""How a runtime process (a torchrun rank, rank 0's engine process) ends after a clean shutdown.

Why not `sys.exit`: the interpreter's teardown sometimes aborted there ("terminate called without an active
exception", SIGABRT: a native thread still joinable), turning a drained rank's exit 0 into -6 (seen once in
tests/test_bundle_readme.py's SIGTERM of a served bundle; the same abort in spawned test ranks, 1 run in 10, in the
eleventh session). Nothing in these processes waits on the teardown: results are written and the process group left
before `main` returns. Nothing here imports moeplan: bundles run without it.
"""
from __future__ import annotations

import os
import sys


def leave(code) -> None:
    """Flush stdout and stderr, then end the process with `code` (None: 0) without the interpreter's teardown."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(int(code or 0))
