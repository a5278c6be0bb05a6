"""A bundle's file modes, like its bytes, depend only on the inputs: directories 0755, files 0644 and
launch.sh 0755 whatever the umask compile runs under (and not mkdtemp's 0700 for the bundle's own
directory), so that the bundle copied into an image, onto a volume or a shared filesystem is readable
by the user that runs it there (backends/common/files.py: finish_bundle)."""
import os
import stat

from click.testing import CliRunner

from moeplan.planner.cli import main
from runtime_fixtures import small_model_dir


def modes(root) -> dict:
    return {p.relative_to(root).as_posix(): stat.S_IMODE(p.stat().st_mode) for p in [root, *root.rglob("*")]}


def compile_under(umask: int, model, trace, out, key) -> dict:
    previous = os.umask(umask)
    try:
        result = CliRunner().invoke(main, ["compile", str(model), "--trace", str(trace), "--nodes", "1", "--gpus-per-node",
                                           "2", "--policy", "contiguous", "--out", str(out), "--sign-key", str(key),
                                           "--quiet"])
    finally:
        os.umask(previous)
    assert result.exit_code == 0, result.output
    return modes(out)


def test_a_torchrun_bundles_modes_are_fixed_whatever_the_umask(tmp_path):
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    model = small_model_dir(tmp_path / "model")
    key = tmp_path / "key.pem"
    key.write_bytes(Ed25519PrivateKey.generate().private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                               serialization.NoEncryption()))
    data = tmp_path / "data.txt"
    data.write_text("The quick brown fox jumps over the lazy dog. Once upon a time.\n")
    assert CliRunner().invoke(main, ["trace", str(model), "--data", str(data), "--out", str(tmp_path / "t.npz"),
                                     "--quiet"]).exit_code == 0
    private = compile_under(0o077, model, tmp_path / "t.npz", tmp_path / "private", key)
    usual = compile_under(0o022, model, tmp_path / "t.npz", tmp_path / "usual", key)
    assert private == usual
    assert private["."] == 0o755 and private["launch.sh"] == 0o755
    assert private["manifest.json"] == private["manifest.sig"] == private["plan.json"] == 0o644
    dirs = {rel for rel in private if (tmp_path / "private" / rel).is_dir()}
    assert dirs >= {".", "runtime", "model"} and all(private[d] == 0o755 for d in dirs)
    assert all(mode in (0o644, 0o755) for mode in private.values())
