"""Writing bundle files: fixed permissions (bytes must not depend on the umask) and the runtime copy."""
from __future__ import annotations

import os
from importlib import resources
from pathlib import Path

RUNTIME_PACKAGE = "moeplan.backends.runtime"


def write_file(path: Path, data, executable: bool = False) -> None:
    """Write text or bytes at `path` (parents created) with mode 0755 or 0644."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(data, bytes):
        path.write_bytes(data)
    else:
        path.write_text(data)
    os.chmod(path, 0o755 if executable else 0o644)


def copy_runtime(dest: Path, src=None) -> None:
    """Copy the runtime's python files (only those: no caches) into dest, with its subpackages
    (`serving/`: the inference service)."""
    src = resources.files(RUNTIME_PACKAGE) if src is None else src
    for entry in sorted(src.iterdir(), key=lambda p: p.name):
        if entry.name.endswith(".py"):
            write_file(dest / entry.name, entry.read_text())
        elif entry.is_dir() and entry.joinpath("__init__.py").is_file():
            copy_runtime(dest / entry.name, entry)
