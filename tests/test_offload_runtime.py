"""The runtime expert cache (CPU): driven by a request stream, its measured requests, hits, loads
and bytes moved equal the simulator's for the same requests and policy, and the weights dict holds
exactly the cached experts' tensors, read from a safetensors file."""
import numpy as np
import torch
from safetensors.torch import save_file

from moeplan.backends.runtime.expert_cache import ExpertCache, ShardStore
from moeplan.passes.analysis.activation import popularity_by_layer
from moeplan.passes.analysis.trace.synth_routing import synthesize_routed_tokens
from moeplan.passes.optimize.offload.next_use import fit_next_use
from moeplan.passes.optimize.offload.policies import make_policy
from moeplan.passes.optimize.offload.simulate import simulate_demand
from moeplan.passes.optimize.offload.stream import build_stream

L, E, K = 3, 8, 2


def shard(path):
    """A shard with one SwiGLU expert per (layer, expert) plus a dense tensor; names as TinyMoE's."""
    torch.manual_seed(0)
    tensors = {"embed.weight": torch.randn(4, 4)}
    names = {}
    for l in range(L):
        for e in range(E):
            for p in ("w_gate", "w_up", "w_down"):
                name = f"blocks.{l}.moe.experts.{e}.{p}.weight"
                tensors[name] = torch.randn(8, 4)
                names.setdefault((l, e), []).append(name)
    save_file(tensors, str(path))
    return names


def test_runtime_cache_matches_simulator_exactly(tmp_path):
    names = shard(tmp_path / "rank-0.safetensors")
    fit = synthesize_routed_tokens(tokens=800, layers=L, experts=E, top_k=K, seq_len=100, seed=0)
    held = synthesize_routed_tokens(tokens=300, layers=L, experts=E, top_k=K, seq_len=60, seed=1)
    model = fit_next_use(build_stream(fit), popularity_by_layer(fit)).with_mix(0.5)
    mixed = 0
    for prompt in (0, 20):
        stream = build_stream(held, prompt_tokens=prompt)
        for capacity in (3, 7, 12):
            resident = list(range(0, L * E, (L * E) // capacity))[:capacity]
            for name in ("lru", "lfu", "lifo", "moe-infinity", "moeplan"):
                weights = {}
                cache = ExpertCache(capacity, ShardStore(tmp_path / "rank-0.safetensors", names), weights, L, E, "cpu",
                                    policy=None if name == "lru" else make_policy(name, model), resident=resident)
                for s in range(len(stream.step_layer)):
                    keys = stream.keys[stream.step_start[s]:stream.step_start[s + 1]]
                    for e in cache.serve(int(stream.step_layer[s]), (keys % E).tolist(), int(stream.step_token[s]),
                                         int(stream.step_seq[s])):
                        assert f"blocks.{stream.step_layer[s]}.moe.experts.{e}.w_up.weight" in weights  # resident when served
                    assert len(weights) == 3 * int(cache.cached.sum()) <= 3 * capacity
                sim = simulate_demand(stream, capacity, make_policy(name, model), resident=resident)
                m = cache.stats()
                assert (m["requests"], m["hits"], m["loads"]) == (sim.requests, sim.hits, sim.loads), (prompt, capacity, name)
                assert m["bytes_moved"] == sim.loads * 3 * 8 * 4 * 4
                mixed += 0 < m["hits"] < m["requests"]
    assert mixed >= 20  # the comparison covers real hits and misses, not only all-miss runs
