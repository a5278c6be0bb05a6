"""Writing bundle files: fixed permissions (bytes must not depend on the umask) and the runtime copy.

Runtime code reaches bundles by one mechanism: the modules of `backends/runtime/` are copied
verbatim (they use relative imports only, so the same files run as `moeplan.backends.runtime` and
as a bundle's `runtime` package). Which modules a bundle ships is declared here.
"""
from __future__ import annotations

import os
from importlib import resources
from pathlib import Path

RUNTIME_PACKAGE = "moeplan.backends.runtime"
# The expert cache's decisions (eviction, next-use model, prefetch, the timed stepper): the planner's
# simulator imports these same modules, so a bundle's ranks decide as the simulation did; and what
# only an expert cache runs (live speculation, host compute on a miss). Shipped only in bundles whose
# plan has per-rank expert caches.
EXPERT_CACHE_MODULES = ("host_compute.py", "offload_eam_match.py", "offload_next_use.py", "offload_policies.py",
                        "offload_prefetch.py", "offload_stepper.py", "speculation.py")
# The inference service (OpenAI-compatible HTTP on rank 0 over continuous batching; issue 29): shipped
# in torchrun and Kubernetes bundles, whose ranks serve it (starlette and uvicorn are then
# requirements), and in Lambda bundles, whose front function runs its framework-free API over
# StartSyncExecution (runtime/lambda_front.py; issue 30).
SERVING_PACKAGE = "serving"


def write_file(path: Path, data, executable: bool = False) -> None:
    """Write text or bytes at `path` (parents created) with mode 0755 or 0644."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(data, bytes):
        path.write_bytes(data)
    else:
        path.write_text(data)
    os.chmod(path, 0o755 if executable else 0o644)


def runtime_modules(expert_cache: bool = False, serving: bool = False) -> list:
    """Paths (relative to runtime/) of the runtime modules a bundle ships: every top-level module of
    the runtime package, the expert-cache modules only with `expert_cache`, and with `serving` the
    inference service's subpackage (`serving/*.py`: `launch.sh --serve`, `moeplan serve`)."""
    src = resources.files(RUNTIME_PACKAGE)
    names = sorted(entry.name for entry in src.iterdir() if entry.name.endswith(".py"))
    names = [n for n in names if expert_cache or n not in EXPERT_CACHE_MODULES]
    if serving:
        names += sorted(f"{SERVING_PACKAGE}/{entry.name}" for entry in src.joinpath(SERVING_PACKAGE).iterdir()
                        if entry.name.endswith(".py"))
    return names


def copy_runtime(dest: Path, expert_cache: bool = False, serving: bool = False) -> None:
    """Copy the runtime's python files (only those: no caches) into dest, verbatim."""
    src = resources.files(RUNTIME_PACKAGE)
    for name in runtime_modules(expert_cache, serving):
        write_file(dest / name, src.joinpath(name).read_text())
