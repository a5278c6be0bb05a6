"""Prefetch in the runtime expert cache (issue 13): decisions by the simulator's stepper, weights
moved by the cache (background reads, installed before the next step computes).

* Unit: the runtime cache with MoE-Infinity's and our prefetcher, driven by request streams, moves
  exactly what `simulate_timed` predicts (requests, hits, loads, prefetches, prefetched keys that
  hit, resident at layer start, bytes), every served slot holds its expert's weights, and after
  the last step the pool holds exactly the stepper's cached keys; hypothesis varies the stream,
  capacity, timing and the keys a rank may prefetch.
* End to end (real CLI, real torchrun): compile with prefetch at 1 rank and 2 ranks (expert
  parallel), `run --verify`: measured == simulated with prefetches that hit; `--prefetch none`
  plans no timing; bad flag combinations stop in one line (plan + codegen == compile with prefetch:
  tests/test_offload_runtime.py).
"""
import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st
from safetensors.torch import save_file

from moeplan.runtime.offload.expert_cache import ExpertCache, ExpertPool, ShardStore
from moeplan.passes.analysis.activation import build_eamc, popularity_by_layer
from synth_routing import synthesize_routed_tokens
from moeplan.runtime.offload.next_use import fit_next_use
from moeplan.runtime.offload.policies import make_policy
from moeplan.runtime.offload.prefetch import make_prefetcher
from moeplan.passes.optimize.offload.simulator import Timing, simulate_timed
from moeplan.runtime.offload.stepper import TimedCache
from moeplan.passes.optimize.offload.stream import build_stream
from test_offload_runtime import cli, offload_inputs  # noqa: F401 (the module's fixture: a small model and its trace)

L, E, K = 3, 8, 2
SHAPE = (8, 4)
EXPERT_BYTES = 2 * 8 * 4 * 4  # two float32 [8, 4] tensors
PAIRS = {"moe-infinity": "moe-infinity", "moeplan": "moeplan"}  # prefetcher: its cache policy


@pytest.fixture(scope="module")
def shard(tmp_path_factory):
    path = tmp_path_factory.mktemp("prefetch_shard") / "rank-0.safetensors"
    torch.manual_seed(0)
    tensors = {f"blocks.{l}.experts.{e}.{p}": torch.randn(*SHAPE) for l in range(L) for e in range(E) for p in ("up", "down")}
    save_file(tensors, str(path))
    return path, tensors


def owner(name):
    parts = name.split(".")
    return (int(parts[1]), int(parts[3]), parts[4])


def pool_of(capacity):
    containers = [SimpleNamespace(kind="experts", moe=l, num_experts=E, params=(("up", (E, *SHAPE)), ("down", (E, *SHAPE))))
                  for l in range(L)]
    return ExpertPool(containers, None, capacity, "cpu")


@pytest.fixture(scope="module")
def fitted():
    fit = synthesize_routed_tokens(tokens=800, layers=L, experts=E, top_k=K, seq_len=100, seed=0)
    held = synthesize_routed_tokens(tokens=200, layers=L, experts=E, top_k=K, seq_len=50, seed=1)
    model = fit_next_use(build_stream(fit), popularity_by_layer(fit)).with_mix(0.25)
    return model, build_eamc(fit, held, seed=0).eamc, held


def run_runtime(stream, capacity, resident, new_stepper, store, tensors):
    """Drive the runtime cache step by step; every served slot must hold its expert's weights."""
    pool = pool_of(capacity)
    cache = ExpertCache(capacity, store, pool, L, E, new_stepper, resident=resident)
    for s in range(len(stream.step_layer)):
        keys = stream.keys[stream.step_start[s]:stream.step_start[s + 1]]
        cache.token, cache.seq, layer = int(stream.step_token[s]), int(stream.step_seq[s]), int(stream.step_layer[s])
        experts = (keys % E).tolist()
        for i, slot in enumerate(cache.serve(layer, experts)):
            assert torch.equal(pool.tensors["up"][slot], tensors[f"blocks.{layer}.experts.{experts[i]}.up"])
    cache.flush()
    # the pool holds exactly the keys the stepper has cached, each in its own slot with its weights
    assert sorted(cache.slot_of) == np.flatnonzero(cache.cached).tolist()
    assert len(set(cache.slot_of.values())) == len(cache.slot_of) <= capacity
    for key, slot in cache.slot_of.items():
        assert torch.equal(pool.tensors["down"][slot], tensors[f"blocks.{key // E}.experts.{key % E}.down"])
    return cache.stats()


def same_as_simulation(m: dict, sim) -> bool:
    return ((m["requests"], m["hits"], m["loads"], m["prefetches"], m["prefetch_hits"], m["resident_at_layer_start"])
            == (sim.requests, sim.hits, sim.loads, sim.prefetches, sim.prefetch_hits, sim.resident_at_start)
            and m["bytes_moved"] == sim.loads * EXPERT_BYTES and abs(m["modelled_seconds"] - sim.seconds) < 1e-12)


def test_runtime_prefetch_moves_what_the_timed_simulation_predicts(shard, fitted):
    path, tensors = shard
    model, eamc, held = fitted
    store = ShardStore(path, owner)
    timing = Timing(layer_s=50e-6, expert_compute_s=1e-6, pcie_copy_s=12e-6, expert_bytes=EXPERT_BYTES)
    useful = 0
    for prompt in (0, 10):
        stream = build_stream(held, prompt_tokens=prompt)
        for capacity in (4, 9):
            resident = list(range(0, L * E, (L * E) // capacity))[:capacity]
            for name, eviction in PAIRS.items():
                def new_stepper(st_, c, r):
                    return TimedCache(st_, c, make_policy(eviction, model), timing, make_prefetcher(name, eamc), r)  # noqa: B023 (called within this iteration)

                m = run_runtime(stream, capacity, resident, new_stepper, store, tensors)
                sim = simulate_timed(stream, capacity, make_policy(eviction, model), timing, make_prefetcher(name, eamc),
                                     resident=resident)
                assert same_as_simulation(m, sim), (prompt, capacity, name, m, sim)
                useful += m["prefetch_hits"] > 0 and m["hits"] < m["requests"]
    assert useful >= 6  # prefetched experts really served requests, beside real misses


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10**6), capacity=st.integers(1, L * E), copy_over_layer=st.sampled_from([0.1, 0.5, 0.9, 1.5]),
       prefetcher=st.sampled_from(["moe-infinity", "moeplan"]), eviction=st.sampled_from(["lru", "lfu", "lifo", "moeplan"]),
       share=st.sampled_from([0.5, 1.0]))
def test_runtime_prefetch_equals_simulation_on_random_streams(shard, fitted, seed, capacity, copy_over_layer, prefetcher,
                                                              eviction, share):
    path, tensors = shard
    model, eamc, _ = fitted
    if prefetcher == "moeplan":
        eviction = "moeplan"  # ours ranks by that policy's scores
    trace = synthesize_routed_tokens(tokens=40, layers=L, experts=E, top_k=K, seq_len=15, seed=seed)
    stream = build_stream(trace, prompt_tokens=seed % 3 * 4)
    rng = np.random.default_rng(seed)
    allowed = rng.random(L * E) < share  # a rank may prefetch its own experts only
    resident = [int(k) for k in rng.permutation(L * E)[:capacity]]
    timing = Timing(layer_s=40e-6, expert_compute_s=1e-6, pcie_copy_s=40e-6 * copy_over_layer, expert_bytes=EXPERT_BYTES)

    def new_stepper(st_, c, r):
        return TimedCache(st_, c, make_policy(eviction, model), timing, make_prefetcher(prefetcher, eamc, allowed), r)

    m = run_runtime(stream, capacity, resident, new_stepper, ShardStore(path, owner), tensors)
    sim = simulate_timed(stream, capacity, make_policy(eviction, model), timing, make_prefetcher(prefetcher, eamc, allowed),
                         resident=resident)
    assert same_as_simulation(m, sim)


def test_a_prefetcher_copies_only_the_keys_it_may(fitted):
    model, eamc, held = fitted
    stream = build_stream(held)
    allowed = np.zeros(L * E, dtype=bool)
    allowed[::3] = True
    timing = Timing(layer_s=50e-6, expert_compute_s=1e-6, pcie_copy_s=5e-6)
    for name, eviction in PAIRS.items():
        cache = TimedCache(stream, 6, make_policy(eviction, model), timing, make_prefetcher(name, eamc, allowed))
        copied = [k for s in range(len(stream.step_layer)) for k, _ in cache.step(s)[1]]
        assert copied and all(allowed[k] for k in copied), name


# --- end to end --------------------------------------------------------------------------------

@pytest.mark.parametrize("gpus, cache, prefetch, mode", [(1, 5, "moeplan", "standard"), (2, 3, "moe-infinity", "both")])
def test_bundle_with_prefetch_measures_what_the_simulator_predicts(offload_inputs, gpus, cache, prefetch, mode):
    """With a host tier of 4 experts per rank: prefetched and demand loads both split into host
    copies and disk reads exactly as the replay predicts."""
    from moeplan.passes.optimize.offload.rank_caches import runtime_expert_bytes
    from moeplan.passes.importers import load_model

    root, model_dir = offload_inputs
    bundle = root / f"bundle-{prefetch}-{gpus}"
    host_memory = 4 * gpus * runtime_expert_bytes(load_model(str(model_dir)).ir)
    code, out = cli(["compile", str(model_dir), "--trace", str(root / "t.npz"), "--policy", "contiguous", "--mode", "standard",
                     "--gpus-per-node", str(gpus), "--expert-cache", str(cache), "--prefetch", prefetch,
                     "--host-memory", str(host_memory), "--out", str(bundle), "--quiet"])
    assert code == 0, out
    spec = json.loads((bundle / "plan.json").read_text())["communication"]["expert_cache"]
    assert spec["prefetch"] == prefetch and spec["capacity"] == [cache] * gpus and "timing" in spec
    assert ("eamc" in spec) == (prefetch == "moe-infinity")
    assert (bundle / "runtime" / "offload" / "stepper.py").is_file() and (bundle / "runtime" / "offload" / "prefetch.py").is_file()
    code, out = cli(["run", str(bundle), "--verify", "--new-tokens", "6", "--mode", mode, "--prompts",
                     str(root / "prompts.txt"), "--json"])
    assert code == 0, out
    reports = json.loads(out.strip().splitlines()[-1])
    for report in (reports["modes"].values() if mode == "both" else [reports]):
        assert report["verified"] and report["tokens_match"] and report["max_abs_logit_diff"] <= 1e-4
        c = report["expert_cache"]
        m, s = c["measured"], c["simulated"]
        assert c["matches_simulation"] and c["requests_match_routing"]
        for k in ("requests", "hits", "loads", "prefetches", "prefetch_hits", "resident_at_layer_start", "bytes_moved",
                  "disk_loads", "disk_bytes", "host_loads", "host_bytes"):
            assert m[k] == s[k], k
        assert m["host_computed"] == s["host_computed"] and m["host_rows"] == s["host_rows"]
        # every copy reads disk or host memory; a host-computed expert outside the host tier is a disk read too
        assert m["disk_loads"] > 0 and m["host_loads"] > 0 and m["disk_loads"] + m["host_loads"] >= m["loads"]
        assert (m["disk_loads"] + m["host_loads"] == m["loads"]) == (m["host_computed"] == 0 or spec.get("host_compute") is None)
        assert m["prefetch_hits"] > 0 and m["hits"] < m["requests"]  # prefetched experts served requests; real misses too
        assert m["bytes_moved"] == m["loads"] * spec["runtime_expert_bytes"]
        t = c["seconds_per_token"]
        assert t["measured_wall"] > 0 and t["modelled_for_these_tokens"] > 0 and t["planned"] > 0


def test_prefetch_none_plans_demand_paging_and_the_default_compares_all(offload_inputs, tmp_path):
    root, model_dir = offload_inputs
    # a GPU workstation whose host's rates the profile knows: host compute is among the candidates
    flags = ["--trace", str(root / "t.npz"), "--policy", "contiguous", "--mode", "standard", "--expert-cache", "5",
             "--target", "torchrun", "--hardware", "rtx4090-pcie4", "--quiet"]
    code, out = cli(["plan", str(model_dir), *flags, "--prefetch", "none", "--out", str(tmp_path / "none.json")])
    assert code == 0, out
    code, out = cli(["plan", str(model_dir), *flags, "--out", str(tmp_path / "auto.json")])
    assert code == 0, out
    none, auto = (json.loads((tmp_path / f).read_text()) for f in ("none.json", "auto.json"))
    spec = none["communication"]["expert_cache"]
    assert spec["prefetch"] == "none" and "timing" not in spec and "eamc" not in spec
    assert "prefetch" not in none["predicted"]["expert_cache"] and "prefetch" not in none["inputs"]["offload"]
    table = auto["predicted"]["expert_cache"]["prefetch"]
    # each prefetcher with and without host compute on a miss (the trace has no speculation: no speculative one)
    assert set(table) == {m + h for m in ("none", "moe-infinity", "moeplan") for h in ("", "+host")}
    chosen = auto["communication"]["expert_cache"]
    label = chosen["prefetch"] + ("+host" if chosen.get("host_compute") == "cheaper" else "")
    assert table[label]["seconds_per_token"] == min(v["seconds_per_token"] for v in table.values())


@pytest.mark.parametrize("args, message", [
    (["--prefetch", "moeplan"], "error: --prefetch needs --gpu-memory"),
    (["--expert-cache", "4", "--prefetch", "moeplan", "--eviction", "lru"], "error: --prefetch moeplan needs --eviction moeplan"),
])
def test_bad_prefetch_flags_are_refused_in_one_line(offload_inputs, args, message):
    root, model_dir = offload_inputs
    code, out = cli(["compile", str(model_dir), "--trace", str(root / "t.npz"), *args, "--out", str(root / "x")])
    assert code == 2 and out.strip().splitlines()[-1].startswith(message) and len(out.strip().splitlines()) == 1, out
    assert not (root / "x").exists()


def test_the_offload_target_compares_prefetchers_itself(offload_inputs):
    root, model_dir = offload_inputs
    code, out = cli(["plan", str(model_dir), "--trace", str(root / "t.npz"), "--target", "offload", "--expert-cache", "5",
                     "--prefetch", "moeplan", "--out", str(root / "p.json")])
    assert code == 2 and out.strip() == ("error: --prefetch does not apply to --target offload; it applies to --target "
                                         "torchrun, kubernetes: drop it or choose one of those targets")


@pytest.mark.parametrize("name, eviction", list(PAIRS.items()) + [(None, "lru")])
def test_a_windowed_request_log_decides_as_the_whole_log(shard, fitted, name, eviction):
    """A long-running service keeps only the last steps of the cache's request log
    (`ExpertCache.keep_steps`): the same requests, hits, loads and prefetches as with the whole log."""
    path, tensors = shard
    model, eamc, held = fitted
    timing = Timing(layer_s=50e-6, expert_compute_s=1e-6, pcie_copy_s=12e-6, expert_bytes=EXPERT_BYTES)
    stream = build_stream(held, prompt_tokens=10)

    def new_stepper(st_, c, r):
        return TimedCache(st_, c, make_policy(eviction, model), timing,
                          make_prefetcher(name, eamc) if name else None, r)

    stats = []
    for keep in (None, 3):
        cache = ExpertCache(5, ShardStore(path, owner), pool_of(5), L, E, new_stepper, resident=[0, 7, 11, 15, 20])
        cache.keep_steps = keep
        for s in range(len(stream.step_layer)):
            keys = stream.keys[stream.step_start[s]:stream.step_start[s + 1]]
            cache.token, cache.seq = int(stream.step_token[s]), int(stream.step_seq[s])
            for _ in cache.serve(int(stream.step_layer[s]), (keys % E).tolist()):
                pass
        cache.flush()
        if keep:
            assert cache.stream.first_step > 0 and len(cache.stream.step_layer.items) < 2 * keep
        stats.append({k: v for k, v in cache.stats().items() if k not in ("prefetch_waits", "prefetch_wait_s")})
    assert stats[0] == stats[1] and stats[0]["hits"] < stats[0]["requests"]
