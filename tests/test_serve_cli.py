"""`moeplan serve`'s refusals before any rank starts: one `error:` line, exit code 2, nothing on stdout."""
from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from runtime_fixtures import SMALL, contiguous_placement, small_model_dir, write_small_bundle

MOEPLAN = str(Path(sys.executable).parent / "moeplan")


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve_cli")
    return write_small_bundle(root / "bundle", small_model_dir(root),
                              contiguous_placement(SMALL["num_layers"], SMALL["num_experts"], 1, 2))


def _serve(*args) -> subprocess.CompletedProcess:
    return subprocess.run([MOEPLAN, "serve", *map(str, args)], capture_output=True, text=True, timeout=120)


def _one_error_line(proc, *fragments):
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and proc.stdout == "" and len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert all(f in lines[0] for f in fragments), lines[0]


def test_a_busy_port(bundle):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        _one_error_line(_serve(bundle, "--port", port), f"127.0.0.1:{port}", "--port")


def test_bundle_checks(bundle, tmp_path):
    _one_error_line(_serve(bundle, "--nproc", 3), "--nproc 3", "world size 2")
    _one_error_line(_serve(tmp_path / "nowhere"), "does not exist")
    _one_error_line(_serve(bundle, "--port", 70000), "--port")
    tampered = tmp_path / "tampered"
    subprocess.run(["cp", "-r", str(bundle), str(tampered)], check=True)
    (tampered / "extra.txt").write_text("x")
    _one_error_line(_serve(tampered), "extra.txt")


def test_an_incomplete_lambda_bundle_is_refused(tmp_path):
    """A Lambda bundle is served over the local cloud (tests/test_lambda_serve.py); it is checked as
    `run` checks it first, and rank flags do not apply to it."""
    fake = tmp_path / "lambda"
    fake.mkdir()
    (fake / "plan.json").write_text(json.dumps({"target": "lambda"}))
    _one_error_line(_serve(fake), "manifest.json", "missing")
    _one_error_line(_serve(fake, "--nproc", 2), "--nproc", "Lambda bundle")
