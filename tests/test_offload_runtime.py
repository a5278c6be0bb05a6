"""The runtime expert cache (1 rank, CPU): same tokens as without it, and the measured hit ratio,
loads and bytes moved equal the simulator's for the same tokens and policy."""
import numpy as np
import pytest
import torch

from moeplan.backends.runtime.counters import Counters
from moeplan.backends.runtime.engine import Engine
from moeplan.backends.runtime.exchange import Exchanger
from moeplan.backends.runtime.expert_cache import ExpertCache, ShardStore
from moeplan.backends.runtime.expert_table import ExpertTable
from moeplan.backends.runtime.tiny_moe import TinyMoEArch, encode, is_expert_tensor
from moeplan.passes.analysis.activation import popularity_by_layer
from moeplan.passes.analysis.trace.format import make_trace
from moeplan.passes.analysis.trace.synth_routing import synthesize_routed_tokens
from moeplan.passes.optimize.offload.next_use import fit_next_use
from moeplan.passes.optimize.offload.policies import make_policy
from moeplan.passes.optimize.offload.simulate import simulate_demand
from moeplan.passes.optimize.offload.stream import build_stream
from runtime_fixtures import contiguous_placement, load_small, small_model_dir

PROMPT = "offloaded experts, exact tokens"
NEW = 6


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    directory = small_model_dir(tmp_path_factory.mktemp("offload_rt"), num_layers=3, num_experts=8, top_k=2)
    return directory, load_small(directory)


def run(directory, model, capacity=None, policy=None, resident=()):
    torch.set_num_threads(1)
    cfg = model.config.to_dict()
    full = {k: v.detach().float() for k, v in model.state_dict().items()}
    weights = dict(full) if capacity is None else {k: v for k, v in full.items() if is_expert_tensor(k) is None}
    arch = TinyMoEArch(cfg, weights)
    table = ExpertTable.from_placement(contiguous_placement(cfg["num_layers"], cfg["num_experts"], 1, 1))
    counters = Counters(arch.num_layers)
    engine = Engine(arch, table, Exchanger(0, 1, counters, torch.device("cpu")), counters, 0, 1, "coherent", torch.device("cpu"))
    if capacity is not None:
        names = {}
        for name in sorted(full):
            owner = is_expert_tensor(name)
            if owner is not None:
                names.setdefault(owner, []).append(name)
        store = ShardStore(directory / "model.safetensors", names)
        engine.expert_cache = ExpertCache(capacity, store, weights, cfg["num_layers"], cfg["num_experts"], "cpu",
                                          policy=policy, resident=resident)
    out = engine.generate([encode(PROMPT)], NEW)
    return out, engine


def routing_trace(engine, num_layers, num_experts) -> tuple:
    """The tokens' routing as the engine recorded it, as a trace (rows by position)."""
    by_key = {}
    for layer, keys, ids, _ in engine.trace:
        for key, row in zip(keys.tolist(), ids.tolist()):
            by_key.setdefault(key, [None] * num_layers)[layer] = row
    keys = sorted(by_key)
    experts = np.array([by_key[k] for k in keys])
    positions = np.array(keys) % engine.max_len
    return make_trace(experts, num_experts=num_experts, positions=positions, sequence=np.zeros(len(keys), dtype=np.int64))


def test_runtime_cache_matches_simulator_exactly(small):
    directory, model = small
    reference, _ = run(directory, model)
    fit = synthesize_routed_tokens(tokens=800, layers=3, experts=8, top_k=2, seq_len=100, seed=0)
    next_use = fit_next_use(build_stream(fit), popularity_by_layer(fit)).with_mix(0.5)
    mixed = 0
    for capacity in (3, 7, 12):
        resident = list(range(0, 24, 24 // capacity))[:capacity]
        for name in ("lru", "lfu", "lifo", "moe-infinity", "moeplan"):
            policy = None if name == "lru" else make_policy(name, next_use)  # lru: the runtime's own
            out, engine = run(directory, model, capacity, policy, resident)
            assert out["generated"] == reference["generated"]  # offloading never changes a token
            measured = engine.expert_cache.stats()
            trace = routing_trace(engine, 3, 8)
            stream = build_stream(trace, prompt_tokens=len(encode(PROMPT)))
            sim = simulate_demand(stream, capacity, make_policy(name, next_use), resident=resident)
            assert (measured["requests"], measured["hits"], measured["loads"]) == (sim.requests, sim.hits, sim.loads), (capacity, name)
            expert_bytes = 3 * 32 * 32 * 4  # SwiGLU gate/up/down [32 x 32] float32
            assert measured["bytes_moved"] == sim.loads * expert_bytes
            mixed += 0 < measured["hits"] < measured["requests"]
    assert mixed >= 10  # the comparison covers real hits and misses, not only all-miss runs
