"""The runtime expert cache (CPU).

* Unit: driven by a request stream, its measured requests, hits, loads and bytes moved equal the
  simulator's for the same requests and policy; the pool holds exactly the cached experts' weights,
  read from a safetensors file.
* End to end (real CLI, real torchrun, 1 rank): `moeplan compile --expert-cache N --eviction P`
  then `moeplan run --verify`: logits and tokens as without a cache, and the measured hit ratio
  and bytes equal the simulator's replay of the same requests, for LRU and the moeplan policy; the
  requests are exactly those the run's routing implies.
"""
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import save_file

from moeplan.runtime.offload.expert_cache import ExpertCache, ExpertPool, ShardStore
from moeplan.passes.analysis.activation import popularity_by_layer
from synth_routing import synthesize_routed_tokens
from moeplan.runtime.offload.next_use import fit_next_use
from moeplan.runtime.offload.policies import make_policy
from moeplan.passes.optimize.offload.simulator import simulate_demand
from moeplan.runtime.offload.stepper import TimedCache
from moeplan.passes.optimize.offload.stream import build_stream
from moeplan.planner.cli import main
from runtime_fixtures import small_model_dir

L, E, K = 3, 8, 2
SHAPE = (8, 4)


def shard(path):
    """A shard with one expert (two tensors) per (layer, expert) plus a dense tensor."""
    torch.manual_seed(0)
    tensors = {"embed.weight": torch.randn(4, 4)}
    for l in range(L):
        for e in range(E):
            for p in ("up", "down"):
                tensors[f"blocks.{l}.experts.{e}.{p}"] = torch.randn(*SHAPE)
    save_file(tensors, str(path))
    return tensors


def owner(name):
    parts = name.split(".")
    return (int(parts[1]), int(parts[3]), parts[4]) if len(parts) == 5 else None


def pool_of(capacity):
    """A stacked-experts pool ([C, 8, 4] per parameter) for L identical layers."""
    containers = [SimpleNamespace(kind="experts", moe=l, num_experts=E, params=(("up", (E, *SHAPE)), ("down", (E, *SHAPE))))
                  for l in range(L)]
    return ExpertPool(containers, None, capacity, "cpu")


def test_runtime_cache_matches_simulator_exactly(tmp_path):
    tensors = shard(tmp_path / "rank-0.safetensors")
    fit = synthesize_routed_tokens(tokens=800, layers=L, experts=E, top_k=K, seq_len=100, seed=0)
    held = synthesize_routed_tokens(tokens=300, layers=L, experts=E, top_k=K, seq_len=60, seed=1)
    model = fit_next_use(build_stream(fit), popularity_by_layer(fit)).with_mix(0.5)
    store = ShardStore(tmp_path / "rank-0.safetensors", owner)
    mixed = 0
    for prompt in (0, 20):
        stream = build_stream(held, prompt_tokens=prompt)
        for capacity in (3, 7, 12):
            resident = list(range(0, L * E, (L * E) // capacity))[:capacity]
            for name in ("lru", "lfu", "lifo", "moe-infinity", "moeplan"):
                pool = pool_of(capacity)
                cache = ExpertCache(capacity, store, pool, L, E,
                                    lambda st, c, r: TimedCache(st, c, make_policy(name, model), resident=r), resident=resident)  # noqa: B023 (called within this iteration)
                for s in range(len(stream.step_layer)):
                    keys = stream.keys[stream.step_start[s]:stream.step_start[s + 1]]
                    cache.token = int(stream.step_token[s])
                    cache.seq = int(stream.step_seq[s])
                    layer = int(stream.step_layer[s])
                    experts = (keys % E).tolist()
                    for i, slot in enumerate(cache.serve(layer, experts)):
                        e = experts[i]
                        # resident when served: the slot holds this expert's weights
                        assert torch.equal(pool.tensors["up"][slot], tensors[f"blocks.{layer}.experts.{e}.up"])
                    assert int(cache.cached.sum()) == len(cache.slot_of) <= capacity
                sim = simulate_demand(stream, capacity, make_policy(name, model), resident=resident)
                m = cache.stats()
                assert (m["requests"], m["hits"], m["loads"]) == (sim.requests, sim.hits, sim.loads), (prompt, capacity, name)
                assert m["bytes_moved"] == sim.loads * 2 * 8 * 4 * 4
                mixed += 0 < m["hits"] < m["requests"]
    assert mixed >= 20  # the comparison covers real hits and misses, not only all-miss runs


def test_a_pool_refuses_layers_with_other_expert_shapes():
    containers = [SimpleNamespace(kind="experts", moe=0, num_experts=E, params=(("up", (E, 8, 4)),)),
                  SimpleNamespace(kind="experts", moe=1, num_experts=E, params=(("up", (E, 8, 6)),))]
    with pytest.raises(ValueError, match="one expert shape"):
        ExpertPool(containers, None, 2, "cpu")


def cli(args):
    result = CliRunner().invoke(main, args)
    return result.exit_code, result.output


@pytest.fixture(scope="module")
def offload_inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("offload_bundle")
    model_dir = small_model_dir(root)
    (root / "data.txt").write_text("the quick brown fox jumps over the lazy dog. " * 40)
    code, out = cli(["trace", str(model_dir), "--data", str(root / "data.txt"), "--out", str(root / "t.npz"),
                     "--seq-len", "32", "--quiet"])
    assert code == 0, out
    (root / "prompts.txt").write_text("hello world\nabc\n")
    return root, model_dir


@pytest.mark.parametrize("eviction", ["lru", "moeplan"])
def test_bundle_with_an_expert_cache_measures_what_the_simulator_predicts(offload_inputs, eviction):
    root, model_dir = offload_inputs
    bundle = root / f"bundle-{eviction}"
    code, out = cli(["compile", str(model_dir), "--trace", str(root / "t.npz"), "--policy", "contiguous", "--mode",
                     "standard", "--expert-cache", "5", "--eviction", eviction, "--out", str(bundle), "--quiet"])
    assert code == 0, out
    plan = json.loads((bundle / "plan.json").read_text())
    spec = plan["communication"]["expert_cache"]
    assert spec["capacity"] == [5] and spec["eviction"] == eviction and len(spec["resident"][0]) == 5
    assert (bundle / "runtime" / "offload" / "policies.py").is_file() and (bundle / "runtime" / "offload" / "next_use.py").is_file()
    assert f"numpy=={np.__version__}" in (bundle / "requirements.txt").read_text().splitlines()
    mode = ["--mode", "standard"] if eviction == "moeplan" else []  # without --mode: the mode the plan chose
    code, out = cli(["run", str(bundle), "--verify", "--new-tokens", "6", *mode,
                     "--prompts", str(root / "prompts.txt"), "--json"])
    assert code == 0, out
    report = json.loads(out.strip().splitlines()[-1])
    assert report["mode"] == "standard"
    assert report["verified"] and report["tokens_match"] and report["max_abs_logit_diff"] <= 1e-4
    cache = report["expert_cache"]
    m, s = cache["measured"], cache["simulated"]
    assert cache["requests_match_routing"] and cache["matches_simulation"]
    assert (m["requests"], m["hits"], m["loads"], m["bytes_moved"]) == (s["requests"], s["hits"], s["loads"], s["bytes_moved"])
    assert m["hit_ratio"] == s["hit_ratio"] and 0 < m["hits"] < m["requests"]  # real hits and misses
    assert m["bytes_moved"] == m["loads"] * spec["runtime_expert_bytes"] > 0


def test_cache_flags_without_a_cache_or_with_both_sizes_are_refused_in_one_line(offload_inputs):
    root, model_dir = offload_inputs
    code, out = cli(["compile", str(model_dir), "--trace", str(root / "t.npz"), "--eviction", "lru", "--out", str(root / "x")])
    assert code == 2 and out.strip().splitlines()[-1].startswith("error: --eviction needs --gpu-memory")
    code, out = cli(["compile", str(model_dir), "--trace", str(root / "t.npz"), "--expert-cache", "4", "--gpu-memory", "1GiB",
                     "--out", str(root / "x")])
    assert code == 2 and "exactly one of --gpu-memory" in out
    assert not (root / "x").exists()


def test_expert_cache_bundles_ship_the_simulators_own_policy_modules_verbatim(tmp_path):
    """The simulator imports its policy, next-use, prefetch, stepper and EAM modules from the
    runtime package; bundles with expert caches ship those very files (the whole runtime/offload/
    subpackage, no rewriting), others do not ship the subpackage at all."""
    from moeplan.backends.common.files import EXPERT_CACHE_SUBPACKAGE, copy_runtime
    from moeplan.passes.optimize.offload import rank_caches as ranks

    runtime = Path(__file__).resolve().parents[1] / "runtime"
    assert ranks.make_policy.__module__ == "moeplan.runtime.offload.policies"
    copy_runtime(tmp_path / "cache", "torchrun", expert_cache=True)
    copy_runtime(tmp_path / "plain", "torchrun")
    offload = sorted(p.name for p in (runtime / EXPERT_CACHE_SUBPACKAGE).glob("*.py"))
    assert {"policies.py", "next_use.py", "prefetch.py", "stepper.py", "eam_match.py"} <= set(offload)
    for name in offload:
        assert (tmp_path / "cache" / EXPERT_CACHE_SUBPACKAGE / name).read_bytes() == \
            (runtime / EXPERT_CACHE_SUBPACKAGE / name).read_bytes()
    assert not (tmp_path / "plain" / EXPERT_CACHE_SUBPACKAGE).exists()
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == sorted(
        [p.name for p in runtime.glob("*.py")] + ["ep", "model", "offload", "serving"])


@pytest.mark.parametrize("cache_flags", [["--eviction", "lru"], ["--prefetch", "moe-infinity"]])
def test_plan_then_codegen_gives_the_compiled_offload_bundle_byte_for_byte(offload_inputs, tmp_path, cache_flags):
    root, model_dir = offload_inputs
    flags = ["--trace", str(root / "t.npz"), "--policy", "contiguous", "--mode", "standard", "--expert-cache", "5",
             *cache_flags]
    code, out = cli(["compile", str(model_dir), *flags, "--out", str(tmp_path / "compiled"), "--quiet"])
    assert code == 0, out
    code, out = cli(["plan", str(model_dir), *flags, "--target", "torchrun", "--out", str(tmp_path / "plan.json"), "--quiet"])
    assert code == 0, out
    assert json.loads((tmp_path / "plan.json").read_text())["communication"]["expert_cache"]["capacity"] == [5]
    code, out = cli(["codegen", str(tmp_path / "plan.json"), "--out", str(tmp_path / "generated")])
    assert code == 0, out

    def files(d):
        return {p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}

    assert files(tmp_path / "compiled") == files(tmp_path / "generated")
