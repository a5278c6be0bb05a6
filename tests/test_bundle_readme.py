"""A torchrun bundle's README, followed as written: its one-machine commands run twice in a row from
the bundle's directory (the second launch must pass the bundle's integrity check too, so nothing may
have been written inside it), then its `Serve` section: `launch.sh --serve`, the README's curl
request, and SIGTERM, after which the service exits 0."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys

import pytest

from runtime_fixtures import SMALL, contiguous_placement, small_model_dir, write_small_bundle
from serving_helpers import ServerProcess


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _blocks(readme: str, section: str) -> list:
    """The ```sh blocks of one `## section` of the README."""
    body = readme.split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```sh\n(.*?)```", body, flags=re.S)


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    root = tmp_path_factory.mktemp("readme")
    placement = contiguous_placement(SMALL["num_layers"], SMALL["num_experts"], 1, 2)
    return write_small_bundle(root / "bundle", small_model_dir(root), placement, "coherent")


def _env() -> dict:
    """As a user who installed requirements.txt into this Python: its scripts (torchrun) on PATH."""
    env = dict(os.environ, MASTER_PORT=str(_free_port()),
               PATH=os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")]))
    env.pop("PYTHONPATH", None)
    return env


def test_the_readme_run_commands_work_twice(bundle):
    readme = (bundle / "README.md").read_text()
    (commands,) = _blocks(readme, "Run")
    assert "./launch.sh --prompts ../prompts.txt --new-tokens 16 --out ../results" in commands
    for attempt in range(2):
        proc = subprocess.run(["bash", "-euo", "pipefail", "-c", commands], cwd=bundle, env=_env(),
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, f"attempt {attempt + 1}:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
        result = json.loads((bundle.parent / "results" / "coherent" / "result.json").read_text())
        assert len(result["texts"]) == 2 and result["generated_tokens"] == 32
        assert proc.stdout.rstrip().endswith("}")  # the README's `cat` printed the result
    shutil.rmtree(bundle.parent / "results")


def test_launch_refuses_results_inside_the_bundle(bundle):
    for out in ("results", "./x/../results", str(bundle)):
        proc = subprocess.run(["./launch.sh", "--prompts", "../prompts.txt", "--out", out], cwd=bundle, env=_env(),
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2 and "is inside the bundle" in proc.stderr, proc.stderr
    assert not (bundle / "results").exists()


def test_the_readme_serve_section(bundle):
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    readme = (bundle / "README.md").read_text()
    assert "`./launch.sh --serve --port 8000`" in readme
    (curl,) = _blocks(readme, "Serve")
    server = ServerProcess(["./launch.sh", "--serve", "--port", "0"], cwd=bundle, env=_env())
    try:
        command = curl.replace("http://127.0.0.1:8000", server.url)
        proc = subprocess.run(["bash", "-euo", "pipefail", "-c", command], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        answer = json.loads(proc.stdout)
        assert answer["model"] == "small_moe" and answer["usage"]["completion_tokens"] == 16
        server.signal(signal.SIGTERM)  # to launch.sh, which hands it to the ranks
        assert server.wait(60) == 0, server.output()[-3000:]
    finally:
        server.kill()
