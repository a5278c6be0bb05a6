"""`moeplan calibrate`: the pieces that measure this machine run on the current runtime (issue 31 item
5: the command had stopped working when the runtime moved onto library models), the engine fit
makes the cost model reproduce the engine run it measured, and the per-machine cache is reused
rather than measured again. No assertion on timings: only on what the measurements must satisfy."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from moeplan.core import hardware
from moeplan.planner.cli import main
from moeplan.planner.commands import calibrate as C
from moeplan.planner.commands import calibrate_engine as CE
from moeplan.core.errors import UserError
from moeplan.core.hardware import load_hardware, profile_from_dict

ROOT = Path(__file__).resolve().parents[1]


def finite_positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_compute_and_memory_measurements_are_figures(tmp_path):
    compute = C.measure_compute()
    memory = C.measure_memory(str(tmp_path))
    assert all(finite_positive(v) for v in compute.values()), compute
    assert all(finite_positive(v) for v in memory.values()), memory
    assert memory["device_memory_bytes"] == hardware.physical_memory_bytes() > 0


def _bundle_runs(tmp_path, model_dir, world: int) -> tuple:
    """calibrate's engine model compiled at `world` ranks and launched once by torchrun: (bundle, runs)."""
    directory = CE.engine_model(tmp_path, model_dir)
    prompts, trace = CE.prompt_file(directory, tmp_path), CE._trace(directory, tmp_path)
    root = CE.compile_bundle(directory, trace, world, tmp_path)
    return root, CE.measure_bundle(root, world, prompts, tmp_path, runs=1)


def _relative_errors(root, runs: dict, profile: dict) -> dict:
    """{mode: predicted / measured - 1} for the runs, priced with `profile` as `moeplan run` prices them."""
    from moeplan.passes.cost.run_check import predict_run

    p = profile_from_dict(profile, "x")
    return {m: predict_run(root, r["results"], m, p)["seconds_per_token"] / r["seconds_per_token"] - 1
            for m, r in runs.items()}


@pytest.mark.parametrize("model_dir", [None, str(ROOT / "examples" / "tiny_moe")])
def test_the_one_rank_fit_is_the_least_squares_op_cost_of_the_bundle_runs_it_measured(tmp_path, model_dir):
    """op_overhead_s is the value that best predicts the 1-rank bundle's measured runs in both modes:
    at the least-squares optimum the relative errors, weighted by their slope in op_overhead_s, sum to
    zero; any other value predicts worse. The runs are real torchrun launches of a compiled bundle."""
    pytest.importorskip("transformers")
    root, runs = _bundle_runs(tmp_path, model_dir, 1)
    assert sorted(runs) == ["coherent", "standard"] and all(finite_positive(r["seconds_per_token"]) for r in runs.values())
    partial = {k: v for k, v in load_hardware("cpu-gloo").to_dict().items() if k != "sources"}
    op = CE.fit(root, runs, lambda v: dict(partial, op_overhead_s=max(v, 1e-12)))
    assert finite_positive(op)

    def loss(v: float) -> float:
        return sum(e * e for e in _relative_errors(root, runs, dict(partial, op_overhead_s=v)).values())

    assert loss(op) <= min(loss(op * 0.9), loss(op * 1.1))
    at, up = _relative_errors(root, runs, dict(partial, op_overhead_s=op)), _relative_errors(root, runs, dict(partial, op_overhead_s=2 * op))
    slopes = {m: (up[m] - at[m]) / op for m in at}  # d(relative error)/d(op): the prediction is linear in it
    terms = [slopes[m] * at[m] for m in at]  # the loss's gradient: zero at the optimum (up to rounding)
    assert sum(terms) == pytest.approx(0.0, abs=1e-4 * sum(abs(t) for t in terms))


def test_the_op_cost_and_its_part_per_row_are_the_least_squares_fit_of_two_workloads(tmp_path):
    """calibrate's 1-rank fit (method 6): the runtime's op cost and its part per row of the step are the pair that
    best predicts the bundle's runs of 8 and of 2 prompts in both modes over the counted ops; moving either
    predicts worse. Real torchrun launches of a compiled bundle of the demo's model."""
    root, runs = _bundle_runs(tmp_path, str(ROOT / "examples" / "tiny_moe"), 1)
    directory = ROOT / "examples" / "tiny_moe"
    small = CE.measure_bundle(root, 1, CE.prompt_file(directory, tmp_path, CE.SMALL_REQUESTS), tmp_path, runs=1)
    partial = {k: v for k, v in load_hardware("cpu-gloo").to_dict().items() if k != "sources"}

    def profile(op: float, row: float) -> dict:
        return dict(partial, **CE.op_cost(op, row))

    op, row = CE.fit_op(root, [runs, small], profile)
    assert finite_positive(op) and row >= 0

    def loss(o: float, r: float) -> float:
        return sum(e * e for each in (runs, small) for e in _relative_errors(root, each, profile(o, r)).values())

    best = loss(op, row)
    assert best <= min(loss(op * 0.9, row), loss(op * 1.1, row), loss(op, row * 1.1 + 1e-9))
    if row > 0:
        assert best <= loss(op, row * 0.9)


def test_a_cached_calibration_is_reused_and_model_needs_out(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    data = load_hardware("cpu-gloo").to_dict()
    data["calibration"] = {"date": "2026-01-02T03:04:05+00:00", "machine_key": hardware.machine_key()}
    path = hardware.calibration_path()
    path.parent.mkdir(parents=True)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    before = path.read_bytes()
    result = CliRunner().invoke(main, ["calibrate"])
    assert result.exit_code == 0, result.output
    assert "using this machine's calibration of 2026-01-02T03:04:05+00:00" in result.output and str(path) in result.output
    assert path.read_bytes() == before  # nothing measured, nothing written
    result = CliRunner().invoke(main, ["calibrate", "--model", str(ROOT / "examples" / "tiny_moe")])
    assert result.exit_code == 2 and "--out" in result.output


def test_a_calibration_yaml_round_trips_with_its_date_as_text():
    data = load_hardware("cpu-gloo").to_dict() | {"calibration": {"date": "2026-01-02T03:04:05+00:00"}}
    again = yaml.safe_load(yaml.safe_dump(data, sort_keys=False))
    assert again["calibration"]["date"] == "2026-01-02T03:04:05+00:00"
    assert profile_from_dict(again, "x").calibration == {"date": "2026-01-02T03:04:05+00:00"}


def test_the_engine_runs_at_two_ranks_under_torchrun_and_the_exchange_latency_fits_them(tmp_path):
    """The 2-rank engine run: every token of the workload routed, and the fitted exchange latency is
    the least-squares value over both modes (neither mode's error can shrink without the other's growing)."""
    import torch

    pytest.importorskip("transformers")
    root, runs = _bundle_runs(tmp_path, None, 2)
    requests, length, new = CE.WORKLOAD
    for run in runs.values():
        routing = torch.load(run["results"] / "routing.pt", weights_only=False)
        assert len(routing["keys"]) == requests * (length + new - 1)  # every prompt and decode token, once
    partial = {k: v for k, v in load_hardware("cpu-gloo").to_dict().items() if k != "sources"}

    def profile(v: float) -> dict:
        return dict(partial, collective_latency_base_s=max(v, 1e-12), collective_latency_per_peer_s=1e-12)

    latency = CE.fit(root, runs, profile)
    assert math.isfinite(latency)
    if latency > 1e-6:  # an optimum inside the allowed range
        errors = _relative_errors(root, runs, profile(latency))
        assert min(errors.values()) <= 1e-9 <= max(errors.values()) or max(abs(e) for e in errors.values()) < 1e-6


def test_a_failed_engine_launch_is_one_line_naming_the_world(tmp_path):
    (tmp_path / "not-a-bundle").mkdir()
    prompts = tmp_path / "p.txt"
    prompts.write_text("ids: 1 2 3\n")
    with pytest.raises(UserError, match=r"^the engine run at 2 rank\(s\) failed: ") as info:
        CE.measure_bundle(tmp_path / "not-a-bundle", 2, prompts, tmp_path, runs=1)
    assert "\n" not in str(info.value)


def test_reuse_keeps_an_out_file_only_while_it_is_this_machines_calibration_of_the_same_engine(tmp_path, monkeypatch):
    """`make demo` calibrates on the example model's engine into build/demo and keeps the file with
    --reuse: kept for this machine's key and the same engine model, measured again for any other."""
    model = str(ROOT / "examples" / "tiny_moe")
    data = load_hardware("cpu-gloo").to_dict()
    data["calibration"] = {"date": "2026-01-02T03:04:05+00:00", "machine_key": hardware.machine_key(), "engine_model": model}
    path = tmp_path / "cpu-gloo.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    before = path.read_bytes()
    result = CliRunner().invoke(main, ["calibrate", "--model", model, "--out", str(path), "--reuse"])
    assert result.exit_code == 0, result.output
    assert "using this machine's calibration of 2026-01-02T03:04:05+00:00" in result.output
    assert path.read_bytes() == before  # nothing measured, nothing written
    assert C._this_machines(path, model) is not None
    assert C._this_machines(path, None) is None  # another engine model: measured again
    other = data | {"calibration": dict(data["calibration"], machine_key="another-cpu-64c-512g-torch2.13.0-m4")}
    path.write_text(yaml.safe_dump(other, sort_keys=False))
    assert C._this_machines(path, model) is None  # another machine's: measured again
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    monkeypatch.setattr(hardware, "runtime_digest", lambda: "0ther000")
    assert C._this_machines(path, model) is None  # measured on other runtime code: measured again
    monkeypatch.undo()
    path.write_text("not: [a profile")
    assert C._this_machines(path, model) is None
    result = CliRunner().invoke(main, ["calibrate", "--reuse"])
    assert result.exit_code == 2 and "--reuse keeps an --out FILE" in result.output
