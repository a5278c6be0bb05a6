"""Atomic file output: readers never see a half-written file, failures leave nothing behind."""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path


@contextlib.contextmanager
def atomic_path(target: str | os.PathLike):
    """Yield a temporary path beside `target`; rename it onto `target` only on success.

    Works for files and directories alike: whatever the caller creates at the yielded path
    replaces `target` when the block exits cleanly, and is removed when it raises.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    tmp = tmp_dir / target.name
    try:
        yield tmp
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)


def write_text_atomic(target: str | os.PathLike, text: str) -> None:
    """Write `text` to `target` atomically."""
    with atomic_path(target) as tmp:
        tmp.write_text(text)
