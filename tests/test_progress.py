"""Progress on stderr: live (rich) when stderr is a terminal, nothing added otherwise or with --json.

The terminal case runs the real command with its stderr on a pseudo-terminal (python's `pty`)."""
import json
import os
import pty
import re
import subprocess
import sys

import pytest

from moeplan.passes.analysis.trace.format import save_trace
from runtime_fixtures import SMALL, random_trace, small_model_dir

PLAIN_LINE = re.compile(r"^\[\d+/\d+\] [a-z_]+ (\.\.\.|done in \d+\.\d\d s)$")
ESCAPE = "\x1b["


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("progress")
    model = small_model_dir(root)
    save_trace(random_trace(200, SMALL["num_layers"], SMALL["num_experts"]), root / "t.npz")
    return root, model


def compile_args(root, model, out, *extra):
    return [sys.executable, "-m", "moeplan.planner.cli", "compile", str(model), "--trace", str(root / "t.npz"),
            "--gpus-per-node", "2", "--policy", "eplb", "--mode", "standard", "--out", str(out), *extra]


def run_on_terminal(args) -> tuple:
    """(exit code, stdout, what the terminal on stderr received)."""
    master, slave = pty.openpty()
    env = dict(os.environ, TERM="xterm", COLUMNS="100", LINES="30", OMP_NUM_THREADS="1")
    proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=slave, env=env)
    os.close(slave)
    received = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: the command closed the terminal
            break
        if not chunk:
            break
        received += chunk
    os.close(master)
    stdout = proc.stdout.read().decode()
    return proc.wait(), stdout, received.decode(errors="replace")


def test_a_terminal_shows_the_running_pass_live(inputs, tmp_path):
    root, model = inputs
    code, stdout, terminal = run_on_terminal(compile_args(root, model, tmp_path / "b"))
    assert code == 0, terminal
    assert ESCAPE in terminal  # rich drew (and erased) a live display
    assert re.search(r"\[9/9\] codegen.*0:00:\d\d", terminal)  # the pass, with its elapsed time
    assert "writing 2 shards (tensors)" in terminal  # codegen's own step, with a bar
    assert "[5/9] placement done in" in terminal  # the pass's line stays once it finished
    assert "[5/9] placement ..." not in terminal  # the live line stands in for the start line
    assert stdout.startswith("wrote ")


def test_a_terminal_gets_no_progress_with_json(inputs, tmp_path):
    root, model = inputs
    code, stdout, terminal = run_on_terminal(compile_args(root, model, tmp_path / "b", "--json"))
    assert code == 0, terminal
    assert terminal.strip() == "" and json.loads(stdout.strip().splitlines()[-1])["target"] == "torchrun"


def test_no_terminal_nothing_added_on_stderr(inputs, tmp_path):
    """The README: piped (stderr not a terminal), nothing is added; stdout is the result alone."""
    root, model = inputs
    proc = subprocess.run(compile_args(root, model, tmp_path / "b"), capture_output=True, text=True,
                          env=dict(os.environ, TERM="xterm", OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    assert proc.stdout.startswith("wrote ") and not any(PLAIN_LINE.match(line) for line in proc.stdout.splitlines())


def test_a_given_stream_gets_every_pass_line():
    """A PassManager given a stream (a log) writes a start and an end line per pass there, terminal or not."""
    import io

    from moeplan.core.pass_manager import Pass, PassManager

    log = io.StringIO()
    PassManager([Pass("a", (), ("x",), lambda f: {"x": 1}), Pass("b", ("x",), ("y",), lambda f: {"y": 2})],
                stream=log).run({})
    lines = log.getvalue().splitlines()
    assert len(lines) == 4 and all(PLAIN_LINE.match(line) for line in lines), lines
