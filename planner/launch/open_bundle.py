"""Opening a bundle to run or serve it, once for every command that does (`moeplan run`, `serve`, and
`planner/pipeline/run.py`): its signature, its files, its referenced checkpoint, each problem one line.
"""
from __future__ import annotations

import json
from pathlib import Path

from moeplan.core.errors import UserError


def open_bundle(bundle, nproc: int | None = None, trusted_key=None, check_files: bool = True) -> dict:
    """The plan of the bundle at `bundle`, after these checks (each failure a UserError):

    * with `trusted_key`, its manifest must be signed by that ed25519 key (docs/security.md);
    * with `check_files` (torchrun and Kubernetes bundles), the manifest's hashes, every file listed
      and nothing else, the shards and the world size (`nproc`, when given: it must equal the
      plan's), and a `--weights reference` bundle's checkpoint must be the one it was compiled from.

    Without `check_files` the plan is read as far as it reads ({} when it does not: the target's own
    checks then say what is wrong; a Lambda bundle's run checks its functions' files itself)."""
    root = Path(bundle)
    if trusted_key is not None:
        from moeplan.backends.common.signing import SigningError, verify_bundle_signature

        try:
            verify_bundle_signature(str(root), trusted_key)
        except SigningError as exc:
            raise UserError(str(exc)) from None
    if not check_files:
        try:
            plan = json.loads((root / "plan.json").read_text())
        except (OSError, ValueError):
            return {}
        return plan if isinstance(plan, dict) else {}
    from moeplan.backends.common.manifest import BundleCheckError, check_bundle
    from moeplan.runtime.bundle_io import BundleError, check_referenced_checkpoint

    try:
        plan = check_bundle(root, nproc)
        check_referenced_checkpoint(root, plan)  # --weights reference: the checkpoint is the compiled one
    except (BundleCheckError, BundleError) as exc:
        raise UserError(str(exc)) from None
    return plan
