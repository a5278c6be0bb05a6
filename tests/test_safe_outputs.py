"""Issue 17: `--out` never destroys data (core/atomic.py, planner/output_guard.py).

Through the real CLI: a non-moeplan --out is refused unless --force, an input is never replaced
or contained, earlier outputs of the same kind are replaced, a kill leaves the old or the new
result whole, and temporaries of killed runs are cleaned.
"""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from click.testing import CliRunner

from moeplan.core import atomic
from moeplan.planner.cli import main

SYNTH = ["trace", "synth", "--layers", "2", "--experts", "4", "--tokens", "50"]


def _cli(args):
    result = CliRunner().invoke(main, args)
    return result.exit_code, result.output


def _snapshot(path):
    if path.is_file():
        return path.read_bytes()
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def _one_error_line(code, output, *needles):
    assert code == 2, output
    assert output.startswith("error: ") and output.count("\n") == 1, output
    for needle in needles:
        assert needle in output, output


def test_existing_directory_is_not_replaced_by_a_trace(tmp_path):
    existing = tmp_path / "results"
    existing.mkdir()
    (existing / "notes.txt").write_text("precious")
    code, output = _cli([*SYNTH, "--out", str(existing)])
    _one_error_line(code, output, "not a moeplan routing trace", "--force")
    assert (existing / "notes.txt").read_text() == "precious"


def test_force_replaces_a_foreign_output_but_earlier_outputs_need_no_force(tmp_path):
    out = tmp_path / "t.npz"
    out.write_text("someone else's file")
    _one_error_line(*_cli([*SYNTH, "--out", str(out)]), "already exists")
    assert out.read_text() == "someone else's file"
    assert _cli([*SYNTH, "--out", str(out), "--force"])[0] == 0
    first = out.read_bytes()
    assert _cli([*SYNTH, "--seed", "1", "--out", str(out)])[0] == 0  # a trace replacing a trace: no --force
    assert out.read_bytes() != first


@pytest.mark.parametrize("make_args", [
    lambda t, p: ["place", "--trace", str(t), "--nodes", "1", "--gpus-per-node", "2", "--policy", "contiguous", "--out", str(t)],
    lambda t, p: ["trace", "import", str(p), "--out", str(p)],
    lambda t, p: ["place", "--trace", str(t), "--nodes", "1", "--gpus-per-node", "2", "--policy", "contiguous",
                  "--out", str(t.parent)],
])
@pytest.mark.parametrize("force", [False, True])
def test_output_equal_to_or_containing_an_input_is_refused_even_with_force(tmp_path, make_args, force):
    trace = tmp_path / "t.npz"
    assert _cli([*SYNTH, "--out", str(trace)])[0] == 0
    log = tmp_path / "log.jsonl"
    log.write_text('{"problem_id": 0, "layer": 0, "token_idx": 0, "experts": [1]}\n')
    before = _snapshot(tmp_path)
    args = make_args(trace, log) + (["--force"] if force else [])
    _one_error_line(*_cli(args), "input", "never replaces an input")
    assert _snapshot(tmp_path) == before


def test_output_inside_an_input_directory_is_refused(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "trace.npz").write_bytes(b"")
    assert _cli([*SYNTH, "--out", str(data / "x.npz")])[0] == 0  # synth reads no input: allowed
    trace = tmp_path / "t.npz"
    assert _cli([*SYNTH, "--out", str(trace)])[0] == 0
    code, output = _cli(["place", "--trace", str(trace), "--nodes", "1", "--gpus-per-node", "2", "--policy",
                         "contiguous", "--out", str(tmp_path / "t.npz" / "p.json")])
    _one_error_line(code, output)


def test_a_file_or_read_only_directory_as_parent_is_one_line(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    _one_error_line(*_cli([*SYNTH, "--out", str(blocker / "sub" / "t.npz")]), "is a file, not a directory")
    if os.geteuid() != 0:  # root writes anywhere
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o500)
        try:
            _one_error_line(*_cli([*SYNTH, "--out", str(ro / "t.npz")]), "cannot write")
        finally:
            ro.chmod(0o700)


def test_failed_run_leaves_the_old_output_and_no_temporary(tmp_path):
    out = tmp_path / "t.npz"
    assert _cli([*SYNTH, "--out", str(out)])[0] == 0
    before = out.read_bytes()
    with pytest.raises(RuntimeError):
        with atomic.atomic_path(out, kind="trace") as tmp:
            tmp.write_bytes(b"half")
            raise RuntimeError("killed mid-write")
    assert out.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.npz"]


def test_directory_swap_replaces_a_bundle_atomically(tmp_path):
    target = tmp_path / "bundle"
    for generation in ("old", "new"):
        with atomic.atomic_path(target) as tmp:
            tmp.mkdir()
            (tmp / "manifest.json").write_text(json.dumps({"files": {}}))
            (tmp / "plan.json").write_text(generation)
    assert (target / "plan.json").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bundle"]


def test_an_interrupted_swap_is_restored_and_stale_temporaries_are_cleaned(tmp_path):
    target = tmp_path / "bundle"
    target.mkdir()
    (target / "plan.json").write_text("old")
    # a run killed between the two renames of the fallback swap: the old result sits aside
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f".bundle.moeplan-{dead.pid}-abc123"
    stale.mkdir()
    os.rename(target, stale / "bundle.old")
    legacy = tmp_path / ".bundle.k2j3h4g5"  # the older mkdtemp name
    (legacy / "bundle").mkdir(parents=True)
    removed = atomic.clean_stale_temporaries(target)
    assert (target / "plan.json").read_text() == "old"
    assert set(removed) == {stale, legacy} and sorted(p.name for p in tmp_path.iterdir()) == ["bundle"]


def test_a_live_runs_temporary_is_left_alone(tmp_path):
    live = tmp_path / f".t.npz.moeplan-{os.getppid()}-xyz"
    live.mkdir()
    atomic.clean_stale_temporaries(tmp_path / "t.npz")
    assert live.is_dir()


def test_killed_write_leaves_the_previous_output_whole(tmp_path):
    """SIGKILL a real `moeplan trace synth` at several moments while it replaces a trace."""
    out = tmp_path / "t.npz"
    assert _cli([*SYNTH, "--out", str(out)])[0] == 0
    from moeplan.passes.analysis.trace.format import load_trace

    old = out.read_bytes()
    big = ["trace", "synth", "--layers", "8", "--experts", "16", "--tokens", "400000", "--seed", "3", "--out", str(out)]
    for delay in (0.5, 1.5, 3.0):
        proc = subprocess.Popen([sys.executable, "-m", "moeplan.planner.cli", *big], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert out.read_bytes() == old or load_trace(out).num_tokens == 400000
        old = out.read_bytes()
    assert _cli([*SYNTH, "--out", str(out)])[0] == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.npz"]



def test_calibrate_replaces_a_hardware_profile_but_refuses_another_file_before_measuring(tmp_path):
    import shutil
    from pathlib import Path

    import moeplan.core as core_pkg
    from moeplan.core.errors import UserError

    profile = tmp_path / "hw.yaml"
    shutil.copy(Path(core_pkg.__file__).parent / "hardware_data" / "cpu-gloo.yaml", profile)
    atomic.check_replaceable(profile, "hardware")  # an earlier profile: replaced without --force
    notes = tmp_path / "notes.txt"
    notes.write_text("precious")
    with pytest.raises(UserError, match="not a moeplan hardware profile"):
        atomic.check_replaceable(notes, "hardware")
    _one_error_line(*_cli(["calibrate", "--out", str(notes)]), "--force")
    assert notes.read_text() == "precious"
