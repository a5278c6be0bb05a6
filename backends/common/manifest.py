"""`manifest.json`: the sha256 of every bundle file, and the check run before any rank starts.

`check_bundle` reports the first problem as one line (missing file, hash mismatch, unexpected
world size) so that `moeplan run` stops before launching anything.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

MANIFEST = "manifest.json"
SIGNATURE = "manifest.sig"  # optional ed25519 signature over manifest.json's bytes (signing.py)
MANIFEST_VERSION = 1
NOT_LISTED = (MANIFEST, SIGNATURE)
_HEX = frozenset("0123456789abcdef")


def sha256_file(path: Path) -> str:
    from moeplan.runtime.checkpoint_reader import file_sha256  # one block-wise file hash for both

    return file_sha256(path)


def bundle_files(root: Path) -> list:
    """Relative POSIX paths of every file under root except the manifest and its signature, sorted."""
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*")
                  if p.is_file() and p.relative_to(root).as_posix() not in NOT_LISTED)


def write_manifest(root: Path) -> dict:
    doc = {"version": MANIFEST_VERSION, "files": {rel: sha256_file(root / rel) for rel in bundle_files(root)}}
    (root / MANIFEST).write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    return doc


class BundleCheckError(Exception):
    """What is wrong with a bundle, in one line."""


def safe_relative(rel) -> bool:
    """A manifest path names a file inside the bundle: relative, POSIX, no '..', '.', or empty parts."""
    if not isinstance(rel, str) or not rel or rel.startswith("/") or "\\" in rel or "\0" in rel:
        return False
    parts = rel.split("/")
    return all(part not in ("", ".", "..") for part in parts) and rel not in NOT_LISTED


def bundle_path(root: Path, rel) -> Path:
    """`root / rel` for a path the manifest may name; raises BundleCheckError for anything that
    would leave the bundle (absolute, '..', through a symbolic link)."""
    root = Path(root)
    if not safe_relative(rel):
        raise BundleCheckError(f"bundle path {rel!r} is not a relative path inside the bundle; the bundle was "
                               "tampered with, recompile it")
    path = root / rel
    real_root = Path(os.path.realpath(root))
    real = Path(os.path.realpath(path))
    if real_root not in real.parents:
        raise BundleCheckError(f"bundle path {rel!r} leads outside the bundle (a symbolic link?); recompile the bundle")
    return path


def _present_files(root: Path) -> list:
    """Every entry under root that is not the manifest or its signature; links are refused."""
    present = []
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            full = Path(dirpath) / name
            rel = full.relative_to(root).as_posix()
            if full.is_symlink():
                raise BundleCheckError(f"bundle entry '{rel}' is a symbolic link; bundles hold plain files only, recompile it")
            if name in filenames and rel not in NOT_LISTED:
                if not full.is_file():
                    raise BundleCheckError(f"bundle entry '{rel}' is not a plain file; recompile the bundle")
                present.append(rel)
    return sorted(present)


def verify_manifest(root: Path) -> dict:
    """Check that manifest.json lists exactly the bundle's files, each with its sha256.

    Returns {relative path: sha256}. Refuses: a missing or malformed manifest, paths that leave
    the bundle, symbolic links, listed files that are missing or changed, and files present but
    not listed (an unlisted `safetensors/__init__.py` would be imported by the ranks; a stale
    `__pycache__` would be run instead of the listed source).
    """
    root = Path(root)
    if not root.is_dir():
        raise BundleCheckError(f"bundle directory '{root}' does not exist; build one with 'moeplan compile'")
    path = root / MANIFEST
    if path.is_symlink() or not path.is_file():
        raise BundleCheckError(f"'{path}' is missing: this is not a complete moeplan bundle; recompile it")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
        files = manifest["files"]
        version = manifest["version"]
    except (ValueError, KeyError, TypeError, UnicodeDecodeError, RecursionError):
        raise BundleCheckError(f"'{path}' is not a valid manifest; recompile the bundle") from None
    if version != MANIFEST_VERSION or not isinstance(files, dict):
        raise BundleCheckError(f"'{path}' is not a version-{MANIFEST_VERSION} moeplan manifest; recompile the bundle")
    for rel in sorted(files, key=str):
        bundle_path(root, rel)
        digest = files[rel]
        if not (isinstance(digest, str) and len(digest) == 64 and set(digest) <= _HEX):
            raise BundleCheckError(f"manifest entry '{rel}' has no valid sha256; recompile the bundle")
    present = _present_files(root)
    extra = sorted(set(present) - set(files))
    if extra:
        raise BundleCheckError(f"bundle file '{extra[0]}' is not listed in manifest.json; nothing unlisted may ship "
                               "in a bundle: remove it or recompile")
    for rel in sorted(files):
        f = root / rel
        if not f.is_file():
            raise BundleCheckError(f"bundle file '{rel}' listed in the manifest is missing; recompile or restore it")
        if sha256_file(f) != files[rel]:
            raise BundleCheckError(f"bundle file '{rel}' does not match its sha256 in manifest.json (modified or corrupt); recompile the bundle")
    return files


def check_bundle(root: Path, nproc: int | None = None) -> dict:
    """Validate a bundle against its manifest and its plan; returns the plan dict."""
    root = Path(root)
    files = verify_manifest(root)
    try:
        plan = json.loads((root / "plan.json").read_text())
        world = int(plan["topology"]["nodes"]) * int(plan["topology"]["gpus_per_node"])
        shards = plan["shards"]
    except (OSError, ValueError, KeyError, TypeError):
        raise BundleCheckError("plan.json is missing or malformed; recompile the bundle") from None
    if "plan.json" not in files:
        raise BundleCheckError("plan.json is not covered by the manifest; recompile the bundle")
    if world < 1 or not isinstance(shards, list) or not all(isinstance(rel, str) for rel in shards):
        raise BundleCheckError("plan.json's topology or shards are malformed; recompile the bundle")
    if len(shards) != world:
        raise BundleCheckError(f"plan.json lists {len(shards)} shards for {world} ranks; recompile the bundle")
    for rel in shards:
        if rel not in files:
            raise BundleCheckError(f"shard '{rel}' named by plan.json is not in the manifest; recompile the bundle")
    check_model_paths(plan, files)
    if nproc is not None and nproc != world:
        topo = plan["topology"]
        raise BundleCheckError(f"--nproc {nproc} does not match the plan's world size {world} "
                               f"({topo['nodes']} nodes x {topo['gpus_per_node']} GPUs); use --nproc {world} or recompile")
    return plan


def check_model_paths(plan: dict, files: dict) -> None:
    """The model source and config that `--verify` loads must be files the manifest lists."""
    model = plan.get("model") if isinstance(plan, dict) else None
    if not isinstance(model, dict):
        raise BundleCheckError("plan.json has no 'model' section; recompile the bundle")
    for key in ("source", "config"):
        rel = model.get(key)
        if rel is not None and (not isinstance(rel, str) or rel not in files):
            raise BundleCheckError(f"plan.json's model {key} {rel!r} is not a file listed in the bundle's manifest; "
                                   "a bundle runs only its own code: recompile it")
