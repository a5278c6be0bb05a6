"""The expert cache's backing store: reference checkpoints and the host tier (issue 13).

* Unit: the reference store (one expert's recipe from the original checkpoint) returns exactly
  the tensors the copy store (the rank's copied shard) returns, dense and per expert, for a
  per-expert checkpoint (Mixtral), a fused one (gpt-oss [E, ...]) and DBRX's flattened [E * r, D],
  reading one expert's rows of a fused tensor; the host tier serves preloaded experts from host
  memory and counts disk and host bytes apart.
* `LoadRecorder` leaves a simulation unchanged and records exactly its loads (hypothesis).
* End to end (real CLI, real torchrun, 1 and 2 ranks): `compile --weights reference
  --expert-cache N --host-memory B` then `run --verify`: logits exact, and measured hits, loads,
  bytes and the disk/host split equal the simulator's replay; a changed checkpoint is refused in
  one line; Kubernetes manifests of such a bundle validate.
"""
import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from moeplan.runtime.offload.expert_cache import expert_tensor_owner
from moeplan.runtime.checkpoint_reader import read_header
from moeplan.runtime.offload.expert_store import ReferenceStore, ShardStore, open_rank_store
from moeplan.passes.analysis.trace.format import save_trace
from moeplan.planner.cli import main
from moeplan.passes.importers.resolve import import_file
from runtime_fixtures import random_trace

REPO = Path(__file__).resolve().parents[1]
tiny = import_file(REPO / "examples" / "hf_tiny" / "architectures.py")


def _containers(directory: Path) -> list:
    from moeplan.backends.common.model_source import expert_containers, model_files

    return expert_containers(*model_files(str(directory)))


def _compile(directory: Path, out: Path, ranks: int, *extra) -> dict:
    trace = out.parent / "trace.npz"
    if not trace.exists():
        save_trace(random_trace(300, len(_containers(directory)), 8, top_k=2, seed=1), trace)
    result = CliRunner().invoke(main, ["compile", str(directory), "--trace", str(trace), "--nodes", "1", "--gpus-per-node",
                                       str(ranks), "--policy", "contiguous", "--mode", "standard", "--out", str(out),
                                       "--quiet", *extra])
    assert result.exit_code == 0, result.output
    return json.loads((out / "plan.json").read_text())


@pytest.mark.parametrize("arch", ["mixtral", "gpt_oss", "dbrx"])
def test_reference_store_returns_the_copy_stores_tensors(tmp_path, arch):
    directory = tiny.build(arch, tmp_path / "models")
    _compile(directory, tmp_path / "copy", 2)
    _compile(directory, tmp_path / "ref", 2, "--weights", "reference")
    owner = expert_tensor_owner(_containers(directory))
    for rank in (0, 1):
        copy = ShardStore(tmp_path / "copy" / f"shards/rank-{rank:05d}.safetensors", owner)
        ref = ReferenceStore(directory, tmp_path / "ref" / f"shards/rank-{rank:05d}.index.json", owner)
        assert sorted(ref.recipes_of) == sorted(copy.names_of) and len(copy.names_of) == 8 * len(_containers(directory)) // 2
        dense_copy, dense_ref = copy.dense(), ref.dense()
        assert sorted(dense_copy) == sorted(dense_ref)
        assert all(torch.equal(dense_copy[n], dense_ref[n]) for n in dense_copy)
        for layer, expert in sorted(copy.names_of):
            a, b = copy.load(layer, expert), ref.load(layer, expert)
            assert sorted(a) == sorted(b) and all(a[p].dtype == torch.float32 and torch.equal(a[p], b[p]) for p in a)
        assert copy.counters() == ref.counters() and ref.disk_loads == len(copy.names_of)  # same loads, same bytes
    index = json.loads((tmp_path / "ref" / "shards/rank-00001.index.json").read_text())["tensors"]
    parts = [p for name, r in index.items() if owner(name) is not None for p in r["parts"]]
    if arch == "mixtral":  # per-expert checkpoint tensors, read whole
        assert parts and all(p["rows"] is None for p in parts)
        return
    header = read_header(directory / "model.safetensors")
    for p in parts:  # one expert's rows of a fused checkpoint tensor: [E, ...] or DBRX's [E * r, D]
        assert (p["rows"][1] - p["rows"][0]) * 8 == header[p["tensor"]]["shape"][0]
    assert len({tuple(p["rows"]) for p in parts if p["tensor"] == parts[0]["tensor"]}) == 4  # rank 1's four experts


def test_host_tier_serves_preloaded_experts_and_counts_disk_and_host_bytes(tmp_path):
    directory = tiny.build("mixtral", tmp_path / "models")
    _compile(directory, tmp_path / "ref", 1, "--weights", "reference")
    owner = expert_tensor_owner(_containers(directory))
    index = tmp_path / "ref" / "shards/rank-00000.index.json"
    store, dense = open_rank_store(index, owner, host_keys=[[0, 1], [1, 5]], checkpoint_dir=directory)
    assert dense and all(owner(n) is None for n in dense)
    per_disk = sum(t.numel() * t.element_size() for t in store.read(0, 0).values())
    assert store.counters() == {"disk_loads": 0, "disk_bytes": 0, "host_loads": 0, "host_bytes": 0, "host_experts": 2,
                                "preload_bytes": 2 * per_disk}
    held = store.load(0, 1)
    assert all(t is held[p] for p, t in store.load(0, 1).items())  # the same host copy, not a new read
    store.load(0, 2)
    store.load(1, 5)
    store.load(0, 2)  # not in the host tier: read from disk again
    c = store.counters()
    assert (c["disk_loads"], c["host_loads"]) == (2, 3)
    assert c["disk_bytes"] == 2 * per_disk and c["host_bytes"] == 3 * per_disk  # float32 checkpoint: same bytes
    store.reset_counters()
    assert store.counters()["host_loads"] == 0 and store.counters()["preload_bytes"] == 2 * per_disk
    with pytest.raises(ValueError, match="checkpoint index"):
        open_rank_store(index, owner)


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 10_000), st.integers(1, 10), st.sampled_from(["lru", "lfu", "lifo", "moe-infinity"]))
def test_load_recorder_changes_nothing_and_records_every_load(seed, capacity, name):
    from synth_routing import synthesize_routed_tokens
    from moeplan.runtime.offload.policies import make_policy
    from moeplan.passes.optimize.offload.simulator import simulate_demand
    from moeplan.passes.optimize.offload.stream import build_stream
    from moeplan.passes.optimize.offload.tiers import LoadRecorder, tier_split

    trace = synthesize_routed_tokens(tokens=60, layers=2, experts=6, top_k=2, seq_len=20, seed=seed)
    stream = build_stream(trace)
    resident = list(range(0, 12, 3))[:capacity]
    plain = simulate_demand(stream, capacity, make_policy(name), resident=resident)
    recorder = LoadRecorder(make_policy(name))
    recorded = simulate_demand(stream, capacity, recorder, resident=resident)
    assert recorded.to_dict() == plain.to_dict() and len(recorder.loaded) == plain.loads
    host = set(range(0, 12, 2))
    split = tier_split(recorder.loaded, host, 10, 40)
    assert split["disk_loads"] + split["host_loads"] == plain.loads
    assert split["host_bytes"] == 40 * sum(1 for k in recorder.loaded if k in host)
    assert split["disk_bytes"] == 10 * sum(1 for k in recorder.loaded if k not in host)


def _run(bundle: Path, ranks: int, prompts: Path):
    return CliRunner().invoke(main, ["run", str(bundle), "--verify", "--nproc", str(ranks), "--new-tokens", "3", "--mode",
                                     "standard", "--prompts", str(prompts), "--json"])


@pytest.mark.parametrize("ranks", [1, 2])
def test_reference_weights_with_an_expert_cache_run_verified_with_the_disk_host_split(tmp_path, ranks):
    directory = tiny.build("qwen3_moe" if ranks == 1 else "gpt_oss", tmp_path / "models")
    bundle = tmp_path / "bundle"
    plan = _compile(directory, bundle, ranks, "--weights", "reference", "--expert-cache", "3", "--eviction", "lru",
                    "--host-memory", "40000" if ranks == 1 else "80000")
    spec = plan["communication"]["expert_cache"]
    expert_bytes = spec["runtime_expert_bytes"]
    assert not list(bundle.rglob("*.safetensors"))  # experts come from the original checkpoint
    per_rank = 40000 // expert_bytes  # 80000 at 2 ranks: shared by the machine's two ranks
    assert spec["host"]["capacity"] == [per_rank] * ranks and 0 < per_rank < 8 // ranks * len(_containers(directory))
    predicted = plan["predicted"]["expert_cache"]  # held-out split: the most popular keys are in host memory
    assert predicted["host_bytes_per_token"] > 0 and predicted["disk_bytes_per_token"] > 0
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("ids: 5 9 11 3\nids: 60 12 33\n")
    result = _run(bundle, ranks, prompts)
    assert result.exit_code == 0, result.output
    report = json.loads(result.output.strip().splitlines()[-1])
    report = report["modes"]["standard"] if "modes" in report else report
    assert report["verified"] and report["max_abs_logit_diff"] <= 1e-4 and report["tokens_match"]
    cache = report["expert_cache"]
    measured, simulated = cache["measured"], cache["simulated"]
    assert cache["matches_simulation"] and cache["requests_match_routing"]
    for key in ("loads", "bytes_moved", "disk_loads", "disk_bytes", "host_loads", "host_bytes"):
        assert measured[key] == simulated[key], key
    assert measured["disk_loads"] > 0 and measured["host_loads"] > 0
    assert measured["disk_loads"] + measured["host_loads"] == measured["loads"]
    assert measured["preload_bytes"] == sum(spec["host"]["capacity"]) * spec["disk_expert_bytes"]
    if ranks == 2:  # a changed checkpoint is refused in one line
        checkpoint = directory / "model.safetensors"
        data = bytearray(checkpoint.read_bytes())
        data[-1] ^= 0x01
        checkpoint.write_bytes(bytes(data))
        result = _run(bundle, ranks, prompts)
        assert result.exit_code == 2
        assert result.output.strip().count("\n") == 0 and "not the one the bundle was compiled from" in result.output


def test_host_memory_needs_an_expert_cache_and_a_size(tmp_path):
    directory = tiny.build("mixtral", tmp_path / "models")
    save_trace(random_trace(300, len(_containers(directory)), 8, top_k=2, seed=1), tmp_path / "trace.npz")
    base = ["compile", str(directory), "--trace", str(tmp_path / "trace.npz"), "--gpus-per-node", "1", "--policy", "contiguous",
            "--out", str(tmp_path / "b")]
    for extra, message in ((["--host-memory", "1GiB"], "--host-memory needs --gpu-memory BYTES or --expert-cache N"),
                           (["--expert-cache", "2", "--host-memory", "lots"], "--host-memory 'lots' is not a size")):
        result = CliRunner().invoke(main, base + extra)
        assert result.exit_code == 2 and result.output.strip().count("\n") == 0 and message in result.output, result.output
        assert not (tmp_path / "b").exists()


def test_kubernetes_bundle_with_reference_weights_and_an_expert_cache_validates(tmp_path):
    import kubernetes_validate
    import yaml

    from moeplan.backends.kubernetes.codegen import KUBERNETES_VERSION

    directory = tiny.build("dbrx", tmp_path / "models")
    out = tmp_path / "bundle"
    plan = _compile(directory, out, 2, "--target", "kubernetes", "--weights", "reference", "--expert-cache", "3",
                    "--host-memory", "0", "--cpu-only", "--image", "registry.example/moe:1")
    assert plan["communication"]["expert_cache"]["host"]["capacity"] == [0, 0]  # every load reads the checkpoint
    predicted = plan["predicted"]["expert_cache"]
    assert predicted["host_bytes_per_token"] == 0 < predicted["disk_bytes_per_token"]
    for path in sorted((out / "kubernetes").glob("*.yaml")):
        items = list(yaml.safe_load_all(path.read_text()))
        for item in items:
            kubernetes_validate.validate(item, KUBERNETES_VERSION, strict=True)
    pod = yaml.safe_load((out / "kubernetes" / "statefulset.yaml").read_text())["spec"]["template"]["spec"]
    ranks = pod["containers"][0]
    assert {"name": "MOEPLAN_CHECKPOINT", "value": "/checkpoint"} in ranks["env"]
    assert {"name": "checkpoint", "mountPath": "/checkpoint", "readOnly": True} in ranks["volumeMounts"]
    assert (out / "runtime" / "offload" / "expert_store.py").is_file() and (out / "runtime" / "offload" / "policies.py").is_file()
    result = CliRunner().invoke(main, ["codegen", str(out / "plan.json"), "--out", str(tmp_path / "again")])
    assert result.exit_code == 0, result.output  # plan.json alone gives the same bundle, byte for byte
    files = lambda root: {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}
    assert files(tmp_path / "again") == files(out)


def test_host_memory_sizes_the_offload_plans_host_tier(tmp_path):
    """`plan --target offload --host-memory B`: B // expert bytes experts in host memory (the most
    popular), the rest on disk; the timed simulator's host keys are those."""
    from synth_routing import synthesize_routed_tokens

    save_trace(synthesize_routed_tokens(tokens=600, layers=6, experts=16, top_k=2, seq_len=100, seed=0), tmp_path / "t.npz")
    base = ["plan", "examples/tiny_moe", "--trace", str(tmp_path / "t.npz"), "--target", "offload", "--expert-cache", "20"]
    tiers = {}
    for host in ("0", "10.5e0", None):
        out = tmp_path / f"plan-{host}.json"
        result = CliRunner().invoke(main, base + (["--host-memory", str(int(float(host) * expert_bytes_of(tmp_path, base)))]
                                                  if host else []) + ["--out", str(out), "--quiet"])
        assert result.exit_code == 0, result.output
        c = json.loads(out.read_text())["communication"]
        tiers[host] = (c["tiers"]["host_experts"], c["tiers"]["disk_experts"], c["host_resident"])
    assert tiers["0"][:2] == (0, 96) and tiers["0"][2] == []
    assert tiers["10.5e0"][:2] == (10, 86) and len(tiers["10.5e0"][2]) == 10
    assert tiers[None][:2] == (96, 0) and tiers[None][2] is None  # the profile's 64 GiB hold every expert


def expert_bytes_of(tmp_path, base) -> int:
    out = tmp_path / "probe.json"
    if not out.exists():
        assert CliRunner().invoke(main, base + ["--out", str(out), "--quiet"]).exit_code == 0
    return json.loads(out.read_text())["communication"]["memory"]["expert_bytes"]
