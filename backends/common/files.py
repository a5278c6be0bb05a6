"""Writing bundle files: fixed permissions (modes, like bytes, must not depend on the umask) and the runtime copy.

Runtime code reaches bundles by one mechanism: the modules of `runtime/` (the package
`moeplan.runtime`) are copied verbatim (they use relative imports only, so the same files run as
`moeplan.runtime` and as a bundle's `runtime` package). A bundle ships the runtime's top-level
modules and whole subpackages, named here per bundle kind; nothing development-only lives in the
runtime.
"""
from __future__ import annotations

import os
from importlib import resources
from pathlib import Path

RUNTIME_PACKAGE = "moeplan.runtime"
# The subpackages each kind of bundle ships, whole:
# * torchrun (and Kubernetes, whose pods run the torchrun bundle): the library's model with the runtime's
#   MoE blocks (model/), expert parallelism (ep/), and the inference service rank 0 runs with `--serve`
#   (serving/; starlette and uvicorn are then requirements);
# * lambda: the functions and the front (lambda_/), the model they build (model/, whose MoE adapter orders
#   replicas by ep/expert_table.py) and the framework-free OpenAI API the front function runs (serving/).
SUBPACKAGES = {"torchrun": ("ep", "model", "serving"), "lambda": ("ep", "lambda_", "model", "serving")}
# The expert cache (offload/): its policies, next-use model, prefetchers and timed stepper are the very
# modules the planner's simulator imports, so a bundle's ranks decide as the simulation did. Shipped only in
# bundles whose plan has per-rank expert caches (runtime/bundle_io.py imports it only then).
EXPERT_CACHE_SUBPACKAGE = "offload"


def write_file(path: Path, data, executable: bool = False) -> None:
    """Write text or bytes at `path` (parents created) with mode 0755 or 0644."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(data, bytes):
        path.write_bytes(data)
    else:
        path.write_text(data)
    os.chmod(path, 0o755 if executable else 0o644)


def fixed_modes(root: Path) -> None:
    """Directories 0755, files 0644 (0755 where executable), whatever the umask compile ran under and
    mkdtemp's 0700 for the bundle's own directory: a bundle is built into images, copied to volumes and
    run by other users (the Kubernetes pods' user, a shared filesystem's ranks), and its modes, like its
    bytes, depend only on the inputs."""
    for path in [root, *root.rglob("*")]:
        if path.is_dir():
            os.chmod(path, 0o755)
        else:
            os.chmod(path, 0o755 if path.stat().st_mode & 0o100 else 0o644)


def finish_bundle(root: Path) -> dict:
    """The last step of every bundle writer: the manifest, then the fixed modes; returns the manifest."""
    from moeplan.backends.common.manifest import write_manifest

    manifest = write_manifest(root)
    fixed_modes(root)
    return manifest


def runtime_modules(kind: str, expert_cache: bool = False) -> list:
    """Paths (relative to runtime/) of the runtime modules a `kind` bundle ships (see SUBPACKAGES):
    every top-level module of the runtime package and every module of its subpackages, with the
    expert cache's subpackage only with `expert_cache`."""
    src = resources.files(RUNTIME_PACKAGE)
    subpackages = SUBPACKAGES[kind] + ((EXPERT_CACHE_SUBPACKAGE,) if expert_cache else ())
    names = sorted(entry.name for entry in src.iterdir() if entry.name.endswith(".py"))
    for sub in sorted(subpackages):
        names += sorted(f"{sub}/{entry.name}" for entry in src.joinpath(sub).iterdir() if entry.name.endswith(".py"))
    return names


def copy_runtime(dest: Path, kind: str, expert_cache: bool = False) -> None:
    """Copy the runtime's python files (only those: no caches) into dest, verbatim."""
    src = resources.files(RUNTIME_PACKAGE)
    for name in runtime_modules(kind, expert_cache):
        write_file(dest / name, src.joinpath(name).read_text())
