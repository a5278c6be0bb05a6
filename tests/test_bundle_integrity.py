"""Issue 17: a tampered bundle is refused before any of its code runs, by `moeplan run`, by
launch.sh itself (sha256sum), and by the Lambda runner; signatures say who built a bundle.

None of these tests launches ranks: every case must stop at the integrity check. A marker file
written by the planted code proves that nothing of the bundle ran.
"""
import json
import os
import shutil
import subprocess

import pytest
from click.testing import CliRunner

from moeplan.backends.common.manifest import BundleCheckError, check_bundle, sha256_file, write_manifest
from moeplan.planner.cli import main
from runtime_fixtures import SMALL, contiguous_placement, small_model_dir, write_small_bundle


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    root = tmp_path_factory.mktemp("integrity")
    model = small_model_dir(root / "model")
    placement = contiguous_placement(SMALL["num_layers"], SMALL["num_experts"], 1, 2)
    return write_small_bundle(root / "bundle", model, placement)


@pytest.fixture
def bundle(pristine, tmp_path):
    copy = tmp_path / "bundle"
    shutil.copytree(pristine, copy, symlinks=True)
    return copy


def _rehash(root, rel):
    """What an attacker who also edits the manifest does: the entry now matches the planted file."""
    doc = json.loads((root / "manifest.json").read_text())
    doc["files"][rel] = sha256_file(root / rel)
    (root / "manifest.json").write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")


def _delist(root, rel):
    doc = json.loads((root / "manifest.json").read_text())
    del doc["files"][rel]
    (root / "manifest.json").write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")


def _plant(path, marker):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"open({str(marker)!r}, 'w').write('ran')\n")


def _run_cli(args):
    result = CliRunner().invoke(main, args)
    return result.exit_code, result.output


def _launch(root, tmp_path):
    env = dict(os.environ, NNODES="1")
    env.pop("PYTHONPATH", None)
    return subprocess.run(["bash", str(root / "launch.sh"), "--new-tokens", "1", "--out", str(tmp_path / "res")],
                          env=env, capture_output=True, text=True, timeout=60)


TAMPERS = {
    # name: (edit of the bundle, text expected in the error of `moeplan run`)
    "unlisted package in the bundle root": (lambda r, m: _plant(r / "safetensors" / "__init__.py", m), "not listed"),
    "unlisted module beside the runtime": (lambda r, m: _plant(r / "runtime" / "extra.py", m), "not listed"),
    "stale bytecode": (lambda r, m: _plant(r / "runtime" / "__pycache__" / "serve.cpython-311.pyc", m), "not listed"),
    "delisted serve.py": (lambda r, m: (_delist(r, "runtime/serve.py"), _plant(r / "runtime/serve.py", m)), "not listed"),
    "edited serve.py": (lambda r, m: _plant(r / "runtime/serve.py", m), "does not match its sha256"),
    "deleted shard": (lambda r, m: (r / "shards/rank-00001.safetensors").unlink(), "missing"),
}


@pytest.mark.parametrize("name", sorted(TAMPERS))
def test_run_and_launch_sh_refuse_tampered_bundles_before_any_code_runs(bundle, tmp_path, name):
    marker = tmp_path / "marker"
    edit, message = TAMPERS[name]
    edit(bundle, marker)
    code, output = _run_cli(["run", str(bundle), "--nproc", "2", "--new-tokens", "1"])
    assert code == 2 and output.startswith("error: ") and output.count("\n") == 1 and message in output, output
    proc = _launch(bundle, tmp_path)
    assert proc.returncode == 2, proc.stderr[-500:]
    assert proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1, proc.stderr
    assert not marker.exists()


@pytest.mark.parametrize("entry", ["/etc/hostname", "../../../../etc/hostname", "runtime/../plan.json", "./plan.json", ""])
def test_manifest_paths_outside_the_bundle_are_refused(bundle, entry):
    doc = json.loads((bundle / "manifest.json").read_text())
    doc["files"][entry] = "0" * 64
    (bundle / "manifest.json").write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    with pytest.raises(BundleCheckError, match="inside the bundle"):
        check_bundle(bundle)


def test_symbolic_links_in_a_bundle_are_refused(bundle, tmp_path):
    outside = tmp_path / "outside.py"
    outside.write_text("x = 1\n")
    (bundle / "model" / "model.py").unlink()
    (bundle / "model" / "model.py").symlink_to(outside)
    with pytest.raises(BundleCheckError, match="symbolic link"):
        check_bundle(bundle)
    assert _launch(bundle, tmp_path).returncode == 2


def test_verify_never_imports_a_model_source_outside_the_bundle(bundle, tmp_path):
    marker = tmp_path / "marker"
    outside = tmp_path / "evil.py"
    _plant(outside, marker)
    plan = json.loads((bundle / "plan.json").read_text())
    plan["model"]["source"] = str(outside)
    (bundle / "plan.json").write_text(json.dumps(plan, indent=2, sort_keys=True) + "\n")
    write_manifest(bundle)  # even with a consistent manifest
    code, output = _run_cli(["run", str(bundle), "--verify", "--nproc", "2", "--new-tokens", "1"])
    assert code == 2 and "not a file listed in the bundle's manifest" in output, output
    assert not marker.exists()


def test_launch_sh_accepts_the_pristine_bundle_up_to_torchrun(bundle, tmp_path):
    """The check passes on the bundle as written (the launch itself is covered by the torchrun tests):
    with NNODES wrong, the script must get past the integrity check to the node-count check."""
    env = dict(os.environ, NNODES="3")
    proc = subprocess.run(["bash", str(bundle / "launch.sh")], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "compiled for 1 node(s) but NNODES=3" in proc.stderr, proc.stderr


# ------------------------------------------------------------------------------------ signing

def _keypair(tmp_path, name):
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    key = Ed25519PrivateKey.generate()
    private = tmp_path / f"{name}.pem"
    public = tmp_path / f"{name}.pub"
    private.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))
    public.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                     serialization.PublicFormat.SubjectPublicKeyInfo))
    return private, public


@pytest.fixture(scope="module")
def signed(tmp_path_factory):
    """A bundle compiled with --sign-key through the real CLI, and the builder's and a stranger's keys."""
    root = tmp_path_factory.mktemp("signed")
    model = small_model_dir(root / "model")
    builder, builder_pub = _keypair(root, "builder")
    _, stranger_pub = _keypair(root, "stranger")
    data = root / "data.txt"
    data.write_text("The quick brown fox jumps over the lazy dog. Once upon a time.\n")
    assert _run_cli(["trace", str(model), "--data", str(data), "--out", str(root / "t.npz"), "--quiet"])[0] == 0
    code, output = _run_cli(["compile", str(model), "--trace", str(root / "t.npz"), "--nodes", "1", "--gpus-per-node",
                             "2", "--policy", "contiguous", "--out", str(root / "bundle"), "--sign-key", str(builder),
                             "--quiet"])
    assert code == 0, output
    return root / "bundle", builder_pub, stranger_pub


def test_signed_bundle_verifies_with_the_builders_key_only(signed, tmp_path):
    root, builder_pub, stranger_pub = signed
    from moeplan.backends.common.signing import SigningError, verify_bundle_signature

    verify_bundle_signature(root, builder_pub)
    with pytest.raises(SigningError, match="not a valid signature"):
        verify_bundle_signature(root, stranger_pub)
    # the plain RFC 8032 signature: openssl checks it without moeplan, where openssl is installed
    if shutil.which("openssl"):
        proc = subprocess.run(["openssl", "pkeyutl", "-verify", "-pubin", "-inkey", str(builder_pub), "-rawin",
                               "-in", str(root / "manifest.json"), "-sigfile", str(root / "manifest.sig")],
                              capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr


def test_run_with_trusted_key_refuses_rehashed_unsigned_and_foreign_bundles(signed, tmp_path):
    root, builder_pub, stranger_pub = signed
    copy = tmp_path / "b"
    shutil.copytree(root, copy)
    marker = tmp_path / "marker"
    # the attack a plain manifest cannot see: plant code and rehash its manifest entry
    _plant(copy / "runtime/serve.py", marker)
    _rehash(copy, "runtime/serve.py")
    code, output = _run_cli(["run", str(copy), "--trusted-key", str(builder_pub), "--nproc", "2"])
    assert code == 2 and "not a valid signature" in output and output.count("\n") == 1, output
    code, output = _run_cli(["run", str(root), "--trusted-key", str(stranger_pub), "--nproc", "2"])
    assert code == 2 and "not a valid signature" in output, output
    (copy / "manifest.sig").unlink()
    code, output = _run_cli(["run", str(copy), "--trusted-key", str(builder_pub), "--nproc", "2"])
    assert code == 2 and "is not signed" in output, output
    assert not marker.exists()


def test_sign_key_that_is_not_an_ed25519_key_fails_before_compiling(tmp_path):
    bad = tmp_path / "key.pem"
    bad.write_bytes(os.urandom(64))
    code, output = _run_cli(["compile", "nonexistent-model", "--trace", "t.npz", "--out", str(tmp_path / "b"),
                             "--sign-key", str(bad)])
    assert code == 2 and output.startswith("error: --sign-key:") and output.count("\n") == 1, output
    assert not (tmp_path / "b").exists()


def test_results_inside_the_bundle_are_refused(bundle):
    """Results written into the bundle would be unlisted files: the next run would refuse the bundle."""
    code, output = _run_cli(["run", str(bundle), "--nproc", "2", "--results", str(bundle / "results")])
    assert code == 2 and "is inside the input" in output and output.count("\n") == 1, output
    assert not (bundle / "results").exists()
