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

from moeplan.planner import hardware
from moeplan.planner.cli import main
from moeplan.planner.commands import calibrate as C
from moeplan.planner.hardware import load_hardware, profile_from_dict

ROOT = Path(__file__).resolve().parents[1]


def finite_positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_compute_and_memory_measurements_are_figures(tmp_path):
    compute = C.measure_compute()
    memory = C.measure_memory(str(tmp_path))
    assert all(finite_positive(v) for v in compute.values()), compute
    assert all(finite_positive(v) for v in memory.values()), memory
    assert memory["device_memory_bytes"] == hardware.physical_memory_bytes() > 0


@pytest.mark.parametrize("model_dir", [None, str(ROOT / "examples" / "tiny_moe")])
def test_the_engine_fit_reproduces_the_run_it_measured(tmp_path, model_dir, monkeypatch):
    """op_overhead_s is chosen so that the cost model predicts the measured one-rank engine time."""
    from moeplan.passes.analysis import cost_model

    measured, predicted = [], []
    real_predict = cost_model.predict

    def spy(*args, **kwargs):  # the real cost model, its answers kept to compare
        out = real_predict(*args, **kwargs)
        predicted.append(sum(out.step_seconds))
        return out

    monkeypatch.setattr(cost_model, "predict", spy)
    from moeplan.backends.runtime.engine import Engine

    real_generate = Engine.generate

    def timed(self, prompts, new_tokens):
        out = real_generate(self, prompts, new_tokens)
        measured.append(out["elapsed_s"])
        return out

    monkeypatch.setattr(Engine, "generate", timed)
    partial = {k: v for k, v in load_hardware("cpu-gloo").to_dict().items() if k != "sources"}
    op = C.measure_engine(partial, str(tmp_path), model_dir, runs=3)
    assert finite_positive(op) and len(measured) == 3
    median = sorted(measured)[1]
    at0, at1 = predicted[-2:]  # the fit's two evaluations: at op ~ 0 and at op = 1 s
    assert at0 + op * (at1 - at0) == pytest.approx(median, rel=1e-6)


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


def test_the_engine_runs_at_two_ranks_and_the_exchange_latency_fits_it(tmp_path):
    """The multi-rank engine run of the calibration: every token of the workload routed, and the
    fitted latency makes the cost model predict that run."""
    import torch

    from moeplan.passes.analysis.cost_model import ModelShape, Workload, predict
    from moeplan.planner.importers import load_model

    torch.manual_seed(0)
    transformers = pytest.importorskip("transformers")
    directory = tmp_path / "qwen3_moe"
    transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**C.ENGINE_QWEN3)).save_pretrained(directory)
    runs = C.measure_engine_ranks(directory, 2, runs=1)
    requests, length, new = C.ENGINE_WORKLOAD
    assert len(runs["routing"]) == requests * (length + new - 1)  # every prompt and decode token, once
    assert runs["hosts"].shape == (6, 16, 2) and runs["hosts"].sum(axis=2).min() == 1
    partial = {k: v for k, v in load_hardware("cpu-gloo").to_dict().items() if k != "sources"}
    latency = C.fit_collective_latency(partial, directory, runs)
    assert finite_positive(latency)
    if latency > 1e-7:  # not clamped: the model now predicts the measured run
        profile = profile_from_dict(dict(partial, collective_latency_base_s=latency, collective_latency_per_peer_s=1e-12), "x")
        shape = ModelShape.from_ir(load_model(str(directory)).ir)
        pred = predict(runs["hosts"], 2, shape, "standard", Workload((length,) * requests, new), runs["routing"], profile)
        assert sum(pred.step_seconds) == pytest.approx(runs["seconds"], rel=1e-6)
