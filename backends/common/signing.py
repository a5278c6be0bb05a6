"""Optional ed25519 signature over a bundle's manifest.json (`manifest.sig`, 64 raw bytes).

The manifest lists every bundle file with its sha256 and `verify_manifest` refuses anything else,
so a valid signature over manifest.json's exact bytes vouches for every file of the bundle. The
signature says *who built* the bundle; whether to run code from that builder is the user's trust
decision (docs/security.md). Keys are PEM files as `openssl genpkey -algorithm ed25519` writes
them (private, unencrypted PKCS#8) and `openssl pkey -pubout` (public); the signature is the
plain RFC 8032 signature, so `openssl pkeyutl -verify -pubin -inkey KEY.pub -rawin -in
manifest.json -sigfile manifest.sig` checks it without moeplan. Uses the `cryptography` library.
"""
from __future__ import annotations

import os
from pathlib import Path

from moeplan.backends.common.manifest import MANIFEST, SIGNATURE

MAX_KEY_BYTES = 1 << 16


class SigningError(Exception):
    """A key that cannot be used, or a signature that does not verify; one line."""


def _read_key_file(path) -> bytes:
    path = Path(path)
    try:
        if not path.is_file():
            raise SigningError(f"key file '{path}' does not exist or is not a file")
        if path.stat().st_size > MAX_KEY_BYTES:
            raise SigningError(f"key file '{path}' is too large to be a PEM key")
        return path.read_bytes()
    except OSError as exc:
        raise SigningError(f"cannot read key file '{path}' ({exc.strerror or exc})") from None


def load_private_key(path):
    """The ed25519 private key in PEM file `path`; SigningError if it is anything else."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from cryptography.hazmat.primitives.serialization import load_pem_private_key

    data = _read_key_file(path)
    try:
        key = load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as exc:
        raise SigningError(f"'{path}' is not an unencrypted PEM private key ({str(exc).splitlines()[0][:80]}); "
                           "make one with 'openssl genpkey -algorithm ed25519 -out KEY.pem'") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise SigningError(f"'{path}' is not an ed25519 key; make one with 'openssl genpkey -algorithm ed25519'")
    return key


def load_public_key(path):
    """The ed25519 public key in PEM file `path`; SigningError if it is anything else."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
    from cryptography.hazmat.primitives.serialization import load_pem_public_key

    data = _read_key_file(path)
    try:
        key = load_pem_public_key(data)
    except (ValueError, TypeError) as exc:
        raise SigningError(f"'{path}' is not a PEM public key ({str(exc).splitlines()[0][:80]}); export it with "
                           "'openssl pkey -in KEY.pem -pubout -out KEY.pub'") from None
    if not isinstance(key, Ed25519PublicKey):
        raise SigningError(f"'{path}' is not an ed25519 public key")
    return key


def sign_bundle(root, private_key) -> Path:
    """Write `manifest.sig` beside the manifest; returns its path."""
    root = Path(root)
    signature = private_key.sign((root / MANIFEST).read_bytes())
    path = root / SIGNATURE
    path.write_bytes(signature)
    os.chmod(path, 0o644)  # as every bundle file (files.py: fixed_modes)
    return path


def verify_bundle_signature(root, public_key_path) -> None:
    """Raise SigningError unless manifest.sig is a valid signature of manifest.json by the key."""
    from cryptography.exceptions import InvalidSignature

    root = Path(root)
    key = load_public_key(public_key_path)
    sig_path, manifest_path = root / SIGNATURE, root / MANIFEST
    if sig_path.is_symlink() or not sig_path.is_file():
        raise SigningError(f"bundle '{root}' is not signed ({SIGNATURE} is missing); it cannot be trusted with "
                           "--trusted-key: ask its builder for a signed bundle (compile --sign-key)")
    if manifest_path.is_symlink() or not manifest_path.is_file():
        raise SigningError(f"'{manifest_path}' is missing: this is not a complete moeplan bundle")
    signature = sig_path.read_bytes()[:1024]
    try:
        key.verify(signature, manifest_path.read_bytes())
    except InvalidSignature:
        raise SigningError(f"bundle '{root}': {SIGNATURE} is not a valid signature of manifest.json by the key "
                           f"'{public_key_path}'; the bundle was changed or built by someone else") from None
