"""`manifest.json`: the sha256 of every bundle file, and the check run before any rank starts.

`check_bundle` reports the first problem as one line (missing file, hash mismatch, unexpected
world size) so that `moeplan run` stops before launching anything.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

MANIFEST = "manifest.json"
MANIFEST_VERSION = 1


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def bundle_files(root: Path) -> list:
    """Relative POSIX paths of every file under root except the manifest, sorted."""
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*")
                  if p.is_file() and p.name != MANIFEST and "__pycache__" not in p.parts)


def write_manifest(root: Path) -> dict:
    doc = {"version": MANIFEST_VERSION, "files": {rel: sha256_file(root / rel) for rel in bundle_files(root)}}
    (root / MANIFEST).write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    return doc


class BundleCheckError(Exception):
    """What is wrong with a bundle, in one line."""


def check_bundle(root: Path, nproc: int | None = None) -> dict:
    """Validate a bundle against its manifest and its plan; returns the plan dict."""
    root = Path(root)
    if not root.is_dir():
        raise BundleCheckError(f"bundle directory '{root}' does not exist; build one with 'moeplan compile'")
    path = root / MANIFEST
    if not path.is_file():
        raise BundleCheckError(f"'{path}' is missing: this is not a complete moeplan bundle; recompile it")
    try:
        manifest = json.loads(path.read_text())
        files = manifest["files"]
    except (ValueError, KeyError, TypeError):
        raise BundleCheckError(f"'{path}' is not a valid manifest; recompile the bundle")
    for rel in sorted(files):
        f = root / rel
        if not f.is_file():
            raise BundleCheckError(f"bundle file '{rel}' listed in the manifest is missing; recompile or restore it")
        if sha256_file(f) != files[rel]:
            raise BundleCheckError(f"bundle file '{rel}' does not match its sha256 in manifest.json (modified or corrupt); recompile the bundle")
    try:
        plan = json.loads((root / "plan.json").read_text())
        world = int(plan["topology"]["nodes"]) * int(plan["topology"]["gpus_per_node"])
        shards = plan["shards"]
    except (OSError, ValueError, KeyError, TypeError):
        raise BundleCheckError("plan.json is missing or malformed; recompile the bundle")
    if "plan.json" not in files:
        raise BundleCheckError("plan.json is not covered by the manifest; recompile the bundle")
    if len(shards) != world:
        raise BundleCheckError(f"plan.json lists {len(shards)} shards for {world} ranks; recompile the bundle")
    for rel in shards:
        if rel not in files:
            raise BundleCheckError(f"shard '{rel}' named by plan.json is not in the manifest; recompile the bundle")
    if nproc is not None and nproc != world:
        topo = plan["topology"]
        raise BundleCheckError(f"--nproc {nproc} does not match the plan's world size {world} "
                               f"({topo['nodes']} nodes x {topo['gpus_per_node']} GPUs); use --nproc {world} or recompile")
    return plan
