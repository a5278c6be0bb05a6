"""The continuous-batching engine under real torchrun (2 gloo ranks), seen from rank 0's EngineClient.

The bundle's own runtime serves; rank 0's front is tests/serving_engine_driver.py (the events it
records are what the HTTP front receives). Checked: 16 concurrent greedy requests of different
lengths, arriving and leaving at different steps, equal the source model's own single-request
greedy generation token for token (the model's own forward over the whole sequence, as `moeplan run
--verify` checks: TinyMoE, and transformers' Qwen2-MoE and gpt-oss with its sliding-window layers), in
both communication modes; a seeded request samples the same alone and in a
crowd; `moeplan run` of the same prompts (one batch through the same worker) gives the service's
tokens; cancel, stop ids, ignore_eos, the bounded queue and drain; an idle service's CPU time
(from /proc of every rank); a rank killed mid-generation ends every request with an error, not a hang.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from runtime_fixtures import (SMALL, contiguous_placement, load_small, small_model_dir, write_hf_bundle,
                              write_small_bundle)

DRIVER = Path(__file__).resolve().parent / "serving_engine_driver.py"
HF_TINY = Path(__file__).resolve().parent.parent / "examples" / "hf_tiny" / "architectures.py"
IDLE_CORE_FRACTION = 0.05


def launch(bundle: Path, out: Path, scenario: str, timeout: float = 240, **options) -> tuple:
    """torchrun --standalone, 2 ranks, the driver in the bundle's directory; (exit code, seconds, output)."""
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1")
    env.pop("PYTHONPATH", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(DRIVER),
           str(bundle), str(out), scenario] + [f"{k}={v}" for k, v in options.items()]
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=bundle, env=env, capture_output=True, text=True, timeout=timeout)
    return proc.returncode, time.monotonic() - start, proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    root = tmp_path_factory.mktemp("serving")
    model_dir = small_model_dir(root, max_positions=128)
    bundles = {}
    for mode in ("coherent", "standard"):  # expert 0 on both ranks: replica-aware dispatch
        placement = contiguous_placement(SMALL["num_layers"], SMALL["num_experts"], 1, 2, replicate=(0,))
        bundles[mode] = write_small_bundle(root / f"bundle-{mode}", model_dir, placement, mode)
    return root, load_small(model_dir), bundles


@pytest.fixture(scope="module", params=["coherent", "standard"])
def served(request, small):
    root, model, bundles = small
    mode = request.param
    code, _, output = launch(bundles[mode], root / f"out-{mode}", "engine", mode=mode, max_sequences=16,
                             max_waiting=16)
    assert code == 0, output[-3000:]
    return mode, model, json.loads((root / f"out-{mode}" / "result.json").read_text())


@torch.no_grad()
def tiny_moe_greedy(model, prompt: list, n: int) -> list:
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt):]


def test_concurrent_greedy_requests_equal_the_model_alone(served):
    mode, model, result = served
    for rid, r in result["greedy"].items():
        assert r["finish"] == "length" and len(r["tokens"]) == r["max_tokens"], rid
        assert r["tokens"] == tiny_moe_greedy(model, r["prompt"], r["max_tokens"]), (mode, rid)
    assert len({len(r["prompt"]) for r in result["greedy"].values()}) >= 10  # lengths differ


def test_moeplan_run_of_the_same_prompts_gives_the_services_tokens(served, small, tmp_path):
    """One generation loop: `moeplan run` hands its prompts to the same batch worker as one batch
    (2 ranks: request i at rank i % 2, coherent mode's prompt sync), so each prompt's tokens are the
    service's for it, up to the request's max_tokens (the run generates the longest for every prompt)."""
    mode, _, result = served
    greedy = list(result["greedy"].values())
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("".join("ids: " + " ".join(map(str, r["prompt"])) + "\n" for r in greedy))
    new_tokens = max(r["max_tokens"] for r in greedy)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "moeplan.planner.cli", "run", str(small[2][mode]), "--nproc", "2",
                           "--prompts", str(prompts), "--new-tokens", str(new_tokens), "--mode", mode,
                           "--results", str(tmp_path / "results"), "--json"],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    run = json.loads((tmp_path / "results" / mode / "result.json").read_text())
    assert run["prompt_ids"] == [r["prompt"] for r in greedy]
    for r, generated in zip(greedy, run["generated"]):
        assert len(generated) == new_tokens
        assert generated[:r["max_tokens"]] == r["tokens"], (mode, r["prompt"])


def test_a_seeded_request_samples_the_same_alone_and_in_a_crowd(served):
    _, _, result = served
    seeded = result["seeded"]
    assert len(seeded["s-alone"]) == 12
    assert seeded["s-alone"] == seeded["s-crowd"]
    assert seeded["s-other"] != seeded["s-alone"]  # another seed, another sample


def test_cancel_stop_ids_and_ignore_eos(served):
    _, _, result = served
    assert result["cancel"]["finish"] == "abort" and result["cancel"]["tokens"] < 40
    assert result["cancel"]["running_after"] == 0  # the slot is free by the next step
    stop, first = result["stop"], result["greedy"]["g0"]["tokens"]
    assert stop["finish"] == "stop" and stop["tokens"] == first[:2]  # the stop token itself is not emitted
    assert stop["ignore_finish"] == "length" and stop["ignore_tokens"][:3] == first[:3]
    assert len(stop["ignore_tokens"]) == 10


def test_the_queue_is_bounded_and_drain_finishes_in_flight_requests(served):
    _, _, result = served
    over = result["overload"]
    assert (over["accepted"], over["overloaded"]) == (32, 8)  # 16 running + 16 waiting, the rest refused
    assert over["finishes"] == ["length"]
    assert result["late_refused"]
    assert all(v == ["length", 15] for v in result["drain"].values())
    assert result["idle_after_drain"] and result["healthy"]


def test_an_idle_service_uses_under_5_percent_of_a_core(served):
    _, _, result = served
    assert len(result["idle_cpu_s"]) == 2
    for cpu in result["idle_cpu_s"]:
        assert cpu < IDLE_CORE_FRACTION * result["idle_window_s"], result["idle_cpu_s"]


def test_metrics_report_the_exchanges_of_the_mode(served):
    mode, _, result = served
    by_kind = {}
    for _layer, kind, nbytes in result["exchange_bytes"]:
        by_kind[kind] = by_kind.get(kind, 0) + nbytes
    assert by_kind["dispatch"] > 0 and by_kind["token_sync"] > 0
    if mode == "standard":
        assert by_kind["combine"] > 0 and by_kind["merge"] == 0 and by_kind["context"] == 0
    else:
        assert by_kind["merge"] > 0 and by_kind["context"] > 0 and by_kind["combine"] == 0
    assert 0 < result["gpu_local_fraction"] < 1
    assert result["metrics"]["running"] == 0 and result["metrics"]["steps"] > 50


def test_a_killed_rank_ends_requests_with_errors_and_the_service_exits(small):
    """Mode-independent: rank 0 sees a failed collective (coherent mode's rank 0 path is the same loop)."""
    root, _, bundles = small
    mode = "standard"
    out = root / f"fault-{mode}"
    code, seconds, output = launch(bundles[mode], out, "fault", timeout=120, mode=mode)
    assert (out / "result.json").exists(), output[-3000:]
    result = json.loads((out / "result.json").read_text())
    assert result["unhealthy_after_s"] < 10
    assert result["finishes"] == ["error"] * 4 and all(result["errors"])
    assert result["ended_after_s"] < 10 and result["refused_after"]
    assert code != 0 and seconds < 60, output[-2000:]


@pytest.mark.parametrize("arch, mode, context", [("qwen2_moe", "coherent", "kv"), pytest.param("gpt_oss", "standard", "auto", marks=pytest.mark.slow)])
def test_transformers_models_serve_exactly(tmp_path, arch, mode, context):
    """Qwen2-MoE (shared experts, a dense block) with coherent mode's K/V exchange through the moved
    cache rows; gpt-oss, whose sliding-window layers (window 4) alternate with full ones."""
    import transformers

    from moeplan.runtime.model.library_model import decoder_layers
    from moeplan.runtime.model.moe_adapter import find_containers
    from moeplan.passes.importers.resolve import import_file

    model_dir = import_file(HF_TINY).build(arch, tmp_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    layers = len(find_containers(*reversed(decoder_layers(model))))
    bundle = write_hf_bundle(tmp_path / "bundle", model_dir, model, contiguous_placement(layers, 8, 1, 2))
    code, _, output = launch(bundle, tmp_path / "out", "exact", mode=mode, context=context, max_sequences=16,
                             max_waiting=16)
    assert code == 0, output[-3000:]
    result = json.loads((tmp_path / "out" / "result.json").read_text())
    for rid, r in result["greedy"].items():  # the model's own forward over the whole sequence, token by token
        ids = list(r["prompt"])
        with torch.no_grad():
            for _ in range(r["max_tokens"]):
                ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
        assert r["tokens"] == ids[len(r["prompt"]):], (arch, rid)


@pytest.fixture(scope="module")
def offloaded(tmp_path_factory):
    """A 2-rank bundle compiled by the real CLI with an expert cache of 3 experts per rank and
    MoE-Infinity prefetch over a host tier."""
    from click.testing import CliRunner

    from moeplan.planner.cli import main

    root = tmp_path_factory.mktemp("serving_offload")
    model_dir = small_model_dir(root, max_positions=128)
    (root / "data.txt").write_text("the quick brown fox jumps over the lazy dog. " * 40)
    for args in (["trace", str(model_dir), "--data", str(root / "data.txt"), "--out", str(root / "t.npz"),
                  "--seq-len", "32", "--quiet"],
                 ["compile", str(model_dir), "--trace", str(root / "t.npz"), "--policy", "contiguous", "--mode",
                  "standard", "--gpus-per-node", "2", "--expert-cache", "3", "--prefetch", "moe-infinity",
                  "--host-memory", "20000", "--out", str(root / "bundle"), "--quiet"]):
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 0, result.output
    return root, load_small(model_dir)


@pytest.mark.parametrize("mode", ["coherent", pytest.param("standard", marks=pytest.mark.slow)])
def test_an_offloaded_bundle_with_prefetch_serves_exactly(offloaded, mode):
    root, model = offloaded
    code, _, output = launch(root / "bundle", root / f"out-{mode}", "exact", mode=mode, max_sequences=16,
                             max_waiting=16)
    assert code == 0, output[-3000:]
    result = json.loads((root / f"out-{mode}" / "result.json").read_text())
    for rid, r in result["greedy"].items():
        assert r["tokens"] == tiny_moe_greedy(model, r["prompt"], r["max_tokens"]), (mode, rid)
    cache = result["expert_cache"]
    assert cache["hits"] > 0 and cache["misses"] > 0  # experts really loaded and reused under the batch


@pytest.fixture(scope="module")
def speculative_offload(tmp_path_factory):
    """A 2-rank bundle with the speculative prefetcher (trace --speculate 2) and host compute on a
    miss, forced by the plan's clock (test_offload_speculative.forced_host_compute: plan -> a clock
    on which the host beats a copy -> codegen)."""
    from test_offload_runtime import cli
    from test_offload_speculative import forced_host_compute

    root = tmp_path_factory.mktemp("serving_speculative")
    model_dir = small_model_dir(root, max_positions=128)
    (root / "data.txt").write_text("the quick brown fox jumps over the lazy dog. " * 40)
    code, out = cli(["trace", str(model_dir), "--data", str(root / "data.txt"), "--out", str(root / "t.npz"),
                     "--seq-len", "32", "--speculate", "2", "--quiet"])
    assert code == 0, out
    spec = forced_host_compute(model_dir, root / "t.npz", root / "bundle", 2, "speculative")
    return root, load_small(model_dir), spec


@pytest.mark.parametrize("mode", ["coherent", pytest.param("standard", marks=pytest.mark.slow)])
def test_a_speculative_bundle_with_host_compute_serves_exactly_and_decides_as_the_simulator(speculative_offload, mode):
    """Under continuous batching the ranks speculate live and compute misses on the host; the
    simulator's replay of each rank's logged requests (the `run --verify` replay) gives exactly
    the counters the service measured."""
    from moeplan.passes.optimize.offload.rank_caches import rank_keys
    from moeplan.passes.optimize.offload.replay import COMPARED, replay_rank_logs
    from moeplan.passes.optimize.offload.stream import stream_from_log
    from moeplan.passes.optimize.placement.schema import placement_from_dict

    root, model, spec = speculative_offload
    out = root / f"out-{mode}"
    code, _, output = launch(root / "bundle", out, "exact", mode=mode, max_sequences=16, max_waiting=16, cache_log=1)
    assert code == 0, output[-3000:]
    result = json.loads((out / "result.json").read_text())
    for rid, r in result["greedy"].items():
        assert r["tokens"] == tiny_moe_greedy(model, r["prompt"], r["max_tokens"]), (mode, rid)
    records = [torch.load(out / f"expert-cache-{r}.pt", weights_only=True) for r in range(2)]
    measured = {k: sum(rec["stats"][k] for rec in records) for k in COMPARED}
    masks = rank_keys(placement_from_dict(json.loads((root / "bundle" / "placement.json").read_text())).hosts())
    simulated = replay_rank_logs(spec, [stream_from_log(rec["log"]) for rec in records], masks)
    assert measured == {k: simulated[k] for k in COMPARED}
    assert all(int(rec["log"]["spec_depth"]) == spec["speculation"]["depth"] for rec in records)
    assert sum(len(rec["log"]["spec_keys"]) for rec in records) > 0  # the ranks speculated live
    assert measured["prefetches"] > 0 and measured["prefetch_hits"] > 0 and measured["host_computed"] > 0
    served = result["expert_cache"]  # the service's metrics (gathered before the last step's copies were flushed)
    assert (served["hits"], served["misses"], served["host_computed"]) == (
        measured["hits"], measured["requests"] - measured["hits"], measured["host_computed"])
    assert 0 < served["prefetch_hits"] <= served["prefetches"] <= measured["prefetches"]
