"""One hardware-profile system (issue 32): every built-in profile carries every figure, each with its
source; `--hardware` takes one list of names on every command; an expert cache inside a torchrun
plan is sized and priced with the plan's own profile, exactly as the offload planner prices that
profile; unknown figures are refused in one line; this machine's calibration is found by its key
and recorded in the plan."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from moeplan.passes.analysis.trace.format import save_trace
from synth_routing import synthesize_routed_tokens
from moeplan.core import hardware
from moeplan.planner.cli import main
from moeplan.core.errors import UserError
from moeplan.core.hardware import (BUILTIN, COST_FIGURES, MEMORY_FIGURES, THIS_MACHINE, TIERED, load_hardware,
                                      load_profile, profile_from_dict)

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "examples" / "tiny_moe")
GIB = 1 << 30


def run(args):
    result = CliRunner().invoke(main, [str(a) for a in args])
    return result.exit_code, result.output


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    path = tmp_path_factory.mktemp("hw") / "t.npz"
    save_trace(synthesize_routed_tokens(tokens=1200, layers=6, experts=16, top_k=2, seq_len=100, seed=0), path)
    return path


def test_one_list_of_builtin_profiles_each_figure_with_a_source():
    files = sorted(p.stem for p in (ROOT / "core" / "hardware_data").glob("*.yaml"))
    assert list(BUILTIN) == files and {"cpu-gloo", "h100-sxm", "rtx4090-pcie4", "a5000-pcie4"} <= set(BUILTIN)
    for name in BUILTIN:
        p = load_hardware(name)
        assert p.name == name
        for key in (*COST_FIGURES, *MEMORY_FIGURES, *TIERED):
            assert p.sources.get(key), f"{name}: {key} has no source"
        for key in ("flops_per_s", "memory_bytes_per_s", "op_overhead_s", "host_to_device_bytes_per_s",
                    "disk_read_bytes_per_s", "device_memory_bytes", "host_memory_bytes"):
            assert getattr(p, key) > 0, (name, key)
        assert p.bandwidth_bytes_per_s["same_node"] > 0
        unknown = [t for t in ("other_node",) if p.bandwidth_bytes_per_s[t] is None]
        assert not unknown or "unknown" in p.sources["bandwidth_bytes_per_s"]
    assert not hasattr(hardware, "builtin_names")


def test_the_published_offload_figures_are_kept():
    """The figures passes/optimize/offload/hardware.yaml held, now in the one profile of each name."""
    old = {"rtx4090-pcie4": (25757220864, 1.008e12, 68719476736, 2.5e10, 6.5e9, 5e-5),
           "a5000-pcie4": (25757220864, 7.68e11, 137438953472, 2.5e10, 6.5e9, 5e-5),
           "rtx4080-pcie4": (17179869184, 7.17e11, 34359738368, 2.5e10, 6.5e9, 5e-5),
           "h100-pcie5": (85899345920, 2.0e12, 274877906944, 5e10, 1.2e10, 3e-5),
           "h100-sxm": (85899345920, 3.35e12, 1099511627776, 5e10, 1.2e10, 3e-5),
           "h200-sxm": (151397597184, 4.8e12, 1099511627776, 5e10, 1.2e10, 3e-5),
           "a100-sxm": (85899345920, 2.039e12, 1099511627776, 2.5e10, 6.5e9, 3e-5)}
    for name, (gpu, bw, host, pcie, nvme, layer) in old.items():
        p = load_hardware(name)
        assert (p.device_memory_bytes, p.memory_bytes_per_s, p.host_memory_bytes, p.host_to_device_bytes_per_s,
                p.disk_read_bytes_per_s, p.layer_overhead_s, p.memory_efficiency, p.copy_latency_s) == \
            (gpu, bw, host, pcie, nvme, layer, 0.8, 1e-5)


def test_a_profile_missing_a_key_or_with_a_bad_figure_is_refused():
    data = load_hardware("h100-sxm").to_dict()
    with pytest.raises(UserError, match="missing key.*host_to_device_bytes_per_s.*null"):
        profile_from_dict({k: v for k, v in data.items() if k != "host_to_device_bytes_per_s"}, "mine.yaml")
    with pytest.raises(UserError, match="disk_read_bytes_per_s"):
        profile_from_dict(data | {"disk_read_bytes_per_s": 0}, "mine.yaml")
    assert profile_from_dict(data | {"disk_read_bytes_per_s": None}, "mine.yaml").disk_read_bytes_per_s is None


def test_the_exchange_latency_line_may_have_a_negative_intercept_but_not_a_non_positive_call():
    """`moeplan calibrate` fits the line through its 2- and 4-rank latencies; where 4 ranks share 2
    cores the line's value at 1 rank is negative. Only worlds of 2 or more are priced, so the profile
    is accepted as long as a call at 2 ranks takes a positive time."""
    data = load_hardware("cpu-gloo").to_dict()
    line = profile_from_dict(data | {"collective_latency_base_s": -1.5e-4, "collective_latency_per_peer_s": 8e-4}, "cal.yaml")
    assert line.collective_latency(2) == pytest.approx(6.5e-4) and line.collective_latency(4) == pytest.approx(2.25e-3)
    with pytest.raises(UserError, match=r"cal.yaml.*at 2 ranks.*must take a positive time"):
        profile_from_dict(data | {"collective_latency_base_s": -8e-4, "collective_latency_per_peer_s": 8e-4}, "cal.yaml")
    with pytest.raises(UserError, match="collective_latency_base_s' must be a number"):
        profile_from_dict(data | {"collective_latency_base_s": "fast"}, "cal.yaml")


def test_hardware_names_are_the_same_on_compile_and_offload(trace, tmp_path):
    # cpu-gloo on the offload target (refused before), rtx4090-pcie4 on torchrun (refused before)
    code, out = run(["plan", TINY, "--trace", trace, "--target", "offload", "--expert-cache", "24", "--hardware", "cpu-gloo",
                     "--out", tmp_path / "o.json", "--quiet"])
    assert code == 0, out
    assert json.loads((tmp_path / "o.json").read_text())["communication"]["hardware"]["name"] == "cpu-gloo"
    code, out = run(["plan", TINY, "--trace", trace, "--target", "torchrun", "--nodes", "1", "--gpus-per-node", "2",
                     "--policy", "contiguous", "--hardware", "rtx4090-pcie4", "--out", tmp_path / "t.json", "--quiet"])
    assert code == 0, out
    assert json.loads((tmp_path / "t.json").read_text())["predicted"]["cost"]["hardware"] == "rtx4090-pcie4"
    for target, scale in (("torchrun", ["--nodes", "1", "--gpus-per-node", "2"]), ("offload", [])):
        code, out = run(["plan", TINY, "--trace", trace, "--target", target, *scale,
                         "--expert-cache", "8", "--hardware", "tpu-v9", "--out", tmp_path / "x.json", "--quiet"])
        assert code == 2 and "unknown hardware 'tpu-v9'" in out and "rtx4090-pcie4" in out and "cpu-gloo" in out


def test_an_unknown_figure_is_refused_where_a_prediction_needs_it(trace, tmp_path):
    """A workstation profile knows no second node: two nodes are refused in one line, one node plans."""
    code, out = run(["plan", TINY, "--trace", trace, "--target", "torchrun", "--nodes", "2", "--gpus-per-node", "1",
                     "--policy", "contiguous", "--hardware", "rtx4090-pcie4", "--out", tmp_path / "p.json"])
    assert code == 2 and out.count("\n") == 1 and out.startswith("error:")  # before any pass ran
    assert "rtx4090-pcie4" in out and "other_node" in out and "--hardware FILE" in out
    assert not (tmp_path / "p.json").exists()


def _cache_sections(trace, tmp_path, hw: str, *flags):
    """(torchrun plan, offload plan), both on `hw`: the torchrun one by `compile` (the bundle's plan.json)."""
    bundle, off = tmp_path / f"torchrun-{hw}", tmp_path / f"offload-{hw}.json"
    code, out = run(["compile", TINY, "--trace", trace, "--target", "torchrun", "--nodes", "1", "--gpus-per-node", "2",
                     "--policy", "contiguous", "--mode", "standard", "--prefetch", "moeplan", *flags,
                     "--hardware", hw, "--out", bundle, "--quiet"])
    assert code == 0, out
    code, out = run(["plan", TINY, "--trace", trace, "--target", "offload", *flags, "--hardware", hw, "--out", off, "--quiet"])
    assert code == 0, out
    return json.loads((bundle / "plan.json").read_text()), json.loads(off.read_text())


@pytest.mark.parametrize("flags", [("--expert-cache", "6"), ("--gpu-memory", "1130000000")])
def test_hardware_governs_every_prediction_of_a_compiled_plan_caches_included(trace, tmp_path, flags):
    """compile --hardware h100-sxm / cpu-gloo with an expert cache: the cost model, the caches (sized and
    priced exactly as the offload planner does on that profile) and the serving capacity all use it."""
    sections = {hw: _cache_sections(trace, tmp_path, hw, *flags) for hw in ("h100-sxm", "cpu-gloo")}
    for hw, (plan, offload) in sections.items():
        profile = load_hardware(hw)
        cache, predicted = plan["communication"]["expert_cache"], plan["predicted"]["expert_cache"]
        assert plan["predicted"]["cost"]["hardware"] == hw
        # the same clock (layer step, expert compute, copies) and the same memory budget as the offload planner's,
        # but the activations: those of the service's largest prefill step, as serving capacity reserves them
        assert cache["timing"] == offload["communication"]["timing"]
        planned, single = dict(cache["memory"]), dict(offload["communication"]["memory"])
        assert planned.pop("activation_bytes") == plan["communication"]["capacity"]["activation_bytes"]
        single.pop("activation_bytes")
        if "--gpu-memory" in flags:
            assert planned == single
        else:  # --expert-cache N: the memory it takes follows from the activations
            assert planned.pop("gpu_memory_bytes") > single.pop("gpu_memory_bytes") and planned == single
        assert predicted["hardware"] == hw == offload["communication"]["hardware"]["name"]
        # the host tier: the profile's host memory less 8 GiB, split between the node's two ranks
        assert cache["host"]["memory_bytes"] == (profile.host_memory_bytes - 8 * GIB) // 2
        capacity = plan["communication"]["capacity"]
        if "--gpu-memory" in flags:
            assert capacity["device_memory_source"] == "--gpu-memory"
        elif hw == "cpu-gloo":  # CPU ranks: the node's two ranks share the host's memory
            assert capacity["device_memory_bytes"] == profile.device_memory_bytes // 2
            assert capacity["device_memory_source"] == f"hardware profile {hw}, host memory shared by 2 CPU ranks"
        else:
            assert capacity["device_memory_bytes"] == profile.device_memory_bytes
            assert capacity["device_memory_source"] == f"hardware profile {hw}"
    (h100, _), (cpu, _) = sections["h100-sxm"], sections["cpu-gloo"]
    assert h100["communication"]["expert_cache"]["timing"] != cpu["communication"]["expert_cache"]["timing"]
    assert h100["predicted"]["expert_cache"]["seconds_per_token"] != cpu["predicted"]["expert_cache"]["seconds_per_token"]
    assert h100["predicted"]["cost"]["modes"] != cpu["predicted"]["cost"]["modes"]
    assert h100["communication"]["expert_cache"]["host"]["memory_bytes"] != cpu["communication"]["expert_cache"]["host"]["memory_bytes"]


def test_offload_timing_follows_the_profile_figures():
    from moeplan.passes.optimize.offload.cache_plan import hardware_record, timing_for
    from moeplan.passes.importers import load_model

    ir = load_model(TINY).ir
    for name in ("h100-sxm", "cpu-gloo", "rtx4090-pcie4"):
        p = load_hardware(name)
        t = timing_for(ir, p)
        expert = ir.moe_stages[0].expert_param_bytes
        assert t.expert_compute_s == pytest.approx(expert / (p.memory_bytes_per_s * p.memory_efficiency))
        assert t.pcie_copy_s == pytest.approx(p.copy_latency_s + expert / p.host_to_device_bytes_per_s)
        assert t.nvme_copy_s == pytest.approx(expert / p.disk_read_bytes_per_s)
        record = hardware_record(p)
        assert record["gpu_memory_bandwidth"] == p.memory_bytes_per_s and record["pcie_bandwidth"] == p.host_to_device_bytes_per_s


# --- this machine's calibration ---------------------------------------------------------------------

def _calibration_file(path: Path, op: float = 2e-5) -> Path:
    data = load_hardware("cpu-gloo").to_dict() | {"op_overhead_s": op, "attention_ops_per_sequence": 0.0}
    data["calibration"] = {"date": "2026-01-02T03:04:05+00:00", "machine_key": hardware.machine_key(),
                           "machine": hardware.machine_facts(), "load_average": 0.5}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_this_machine_is_refused_until_calibrated_then_found_by_its_key(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    with pytest.raises(UserError, match="no calibration yet.*moeplan calibrate"):
        load_profile(THIS_MACHINE)
    key = hardware.machine_key()
    assert key.endswith(f"-m{hardware.CALIBRATION_METHOD}-r{hardware.runtime_digest()}")
    assert f"{hardware.machine_facts()['cores']}c" in key
    path = _calibration_file(hardware.calibration_path())
    assert path == tmp_path / "cache" / "moeplan" / "hardware" / f"cpu-gloo-{key}.yaml"
    given = load_profile(THIS_MACHINE)
    assert given.origin == THIS_MACHINE and given.profile.op_overhead_s == 2e-5
    assert given.provenance()["calibration"]["machine_key"] == key


def test_the_plan_records_the_calibration_and_run_prices_with_its_figures(trace, tmp_path, monkeypatch):
    """compile --hardware this-machine: plan.json names the file's hash, date and machine and keeps the
    figures, so `run` prices with them even where the calibration file is not; bytes repeat."""
    from moeplan.passes.cost.options import plan_profile, profile_label

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    _calibration_file(hardware.calibration_path(), op=1.234e-5)
    args = ["plan", TINY, "--trace", trace, "--target", "torchrun", "--nodes", "1", "--gpus-per-node", "2",
            "--policy", "contiguous", "--hardware", THIS_MACHINE, "--quiet"]
    assert run([*args, "--out", tmp_path / "a.json"])[0] == 0
    assert run([*args, "--out", tmp_path / "b.json"])[0] == 0
    assert (tmp_path / "a.json").read_bytes() == (tmp_path / "b.json").read_bytes()
    cost = json.loads((tmp_path / "a.json").read_text())["predicted"]["cost"]
    recorded = cost["hardware_profile"]
    assert recorded["given"] == THIS_MACHINE and recorded["origin"] == THIS_MACHINE and len(recorded["sha256"]) == 64
    assert recorded["calibration"]["date"] == "2026-01-02T03:04:05+00:00"
    assert recorded["calibration"]["machine_key"] == hardware.machine_key()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "elsewhere"))  # the calibration is not here any more
    assert plan_profile(cost).op_overhead_s == 1.234e-5
    assert "calibrated 2026-01-02T03:04:05+00:00" in profile_label(cost)
    # the report says which calibration priced the plan
    assert run(["report", tmp_path / "a.json", "--out", tmp_path / "a.html"])[0] == 0
    page = (tmp_path / "a.html").read_text()
    assert "2026-01-02T03:04:05+00:00" in page and hardware.machine_key() in page and recorded["sha256"] in page
    # a built-in profile: nothing recorded beyond its name (plans made with it are as before)
    assert run([*args[:-2], "cpu-gloo", "--quiet", "--out", tmp_path / "c.json"])[0] == 0
    assert "hardware_profile" not in json.loads((tmp_path / "c.json").read_text())["predicted"]["cost"]


def test_the_runtime_digest_follows_the_runtime_code_and_keys_the_calibration(tmp_path, monkeypatch):
    """A calibration fits the runtime's own call cost: another runtime's code gives another key, so this
    machine's cached calibration of the runtime of then is not found (measured again)."""
    import shutil

    import moeplan.runtime as runtime_package

    digest = hardware.runtime_digest()
    assert len(digest) == 8 and int(digest, 16) >= 0
    copy = tmp_path / "runtime"
    shutil.copytree(Path(runtime_package.__file__).parent, copy, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(hardware.resources, "files", lambda package: copy)
    hardware.runtime_digest.cache_clear()
    try:
        assert hardware.runtime_digest() == digest  # same files, same digest
        hardware.runtime_digest.cache_clear()
        (copy / "serving" / "worker.py").write_text((copy / "serving" / "worker.py").read_text() + "\n# faster\n")
        changed = hardware.runtime_digest()
    finally:
        monkeypatch.undo()
        hardware.runtime_digest.cache_clear()
    assert changed != digest and hardware.runtime_digest() == digest
    facts = hardware.machine_facts()
    assert hardware.machine_key(facts | {"runtime": changed}) != hardware.machine_key(facts)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    _calibration_file(hardware.calibration_path(hardware.machine_key(facts | {"runtime": changed})))
    with pytest.raises(UserError, match="no calibration yet"):
        load_profile(THIS_MACHINE)
