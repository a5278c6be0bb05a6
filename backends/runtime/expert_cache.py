"""A bounded cache of expert weights on the compute device, backed by the rank's safetensors shard.

Why: a GPU that holds the dense weights but only some experts (offloading, issue 13) keeps a
planned number C of (MoE layer, expert) entries resident and loads the others when the router asks
for them. The cache wraps the one function the runtime runs experts through
(`MoEAdapter.local_expert_output`), so it works for every block kind the adapter supports: the
library's own experts module computes, on weights the cache put in place.

* `ExpertPool`: C slots of expert weights, shared by every MoE layer of the rank (so device memory
  holds exactly C experts whatever the layer mix). For a stacked experts module the pool is one
  tensor [C, ...] per expert parameter, set as that parameter of every layer's module (its expert
  count becomes C: the library indexes slots); TinyMoE gets C expert modules.
* `ExpertCache.output`: for one MoE layer step, the step's distinct experts in request order (row
  by row, each row's top-k order: the order of the simulator's request stream); each is made
  resident just before its rows compute (evicting the policy's victim), so C may be smaller than a
  prefill step's expert count. It counts requests, hits, loads and bytes moved and keeps the request
  log (`OnlineStream`), which `moeplan run --verify` replays through the simulator.
* The store (`expert_store.py`: the copied shard, or the original checkpoint through the rank's
  reference index) hands over one expert's float32 tensors per load, pinned on CUDA, where the
  cache copies them on a side stream that the compute stream waits for (that path cannot run on
  this CPU-only machine); the store counts bytes read from disk and served from host memory.
* Policies: the simulator's own classes (passes/optimize/offload/policies.py and next_use.py,
  copied into the bundle as `runtime/offload_policies.py` and `runtime/offload_next_use.py` by the
  offload codegen), driven through `OnlineStream` exactly as the simulator drives them.
Nothing here imports moeplan: bundles run without it.
"""
from __future__ import annotations

import copy

import numpy as np
import torch
import torch.nn as nn

from .expert_store import ExpertStore, ShardStore  # noqa: F401  (ShardStore: the copy form)


class OnlineStream:
    """The request stream as it happens: same fields as the simulator's `Stream`, grown per step."""

    def __init__(self, num_layers: int, num_experts: int):
        self.num_layers, self.num_experts = num_layers, num_experts
        self.num_keys = num_layers * num_experts
        self._keys = np.zeros(1024, dtype=np.int64)
        self.step_start, self.step_layer, self.step_token, self.step_seq = [0], [], [], []

    @property
    def keys(self) -> np.ndarray:
        return self._keys[: self.step_start[-1]]

    def add_step(self, layer: int, token: int, seq: int, keys: list) -> int:
        """Append one step's keys; returns its index."""
        end = self.step_start[-1] + len(keys)
        while end > len(self._keys):
            self._keys = np.concatenate([self._keys, np.zeros(len(self._keys), dtype=np.int64)])
        self._keys[self.step_start[-1]:end] = keys
        self.step_start.append(end)
        self.step_layer.append(layer)
        self.step_token.append(token)
        self.step_seq.append(seq)
        return len(self.step_layer) - 1

    def to_record(self) -> dict:
        """The log as int64 tensors: keys [R], step_start [S+1], step_layer/step_token/step_seq [S]."""
        as_t = lambda v: torch.tensor(np.asarray(v, dtype=np.int64))
        return {"keys": as_t(self.keys), "step_start": as_t(self.step_start), "step_layer": as_t(self.step_layer),
                "step_token": as_t(self.step_token), "step_seq": as_t(self.step_seq),
                "num_layers": self.num_layers, "num_experts": self.num_experts}


def per_expert_shape(full_shape, num_experts: int) -> tuple:
    """[E, ...] -> [...]; [E * r, ...] (DBRX) -> [r, ...]."""
    if full_shape[0] == num_experts:
        return tuple(full_shape[1:])
    return (full_shape[0] // num_experts, *full_shape[1:])


class ExpertPool:
    """C slots of expert weights on `device`, shared by every MoE layer (see module docstring)."""

    def __init__(self, containers: list, template_block, capacity: int, device):
        first = containers[0]
        self.kind, self.capacity, self.device = first.kind, int(capacity), torch.device(device)
        if self.kind == "tiny_moe":
            spec = sorted({p.split(".", 1)[1] for p, _ in first.params})
            self.modules = nn.ModuleList(copy.deepcopy(template_block.experts[0]) for _ in range(self.capacity)).to(self.device)
            self.params = tuple(spec)
        else:
            spec = tuple((p, per_expert_shape(full, first.num_experts)) for p, full in first.params)
            self.tensors = {}
            for (p, per), (_, full) in zip(spec, first.params):
                shape = (self.capacity, *per) if full[0] == first.num_experts else (self.capacity * per[0], *per[1:])
                self.tensors[p] = torch.zeros(shape, device=self.device)
            self.params = tuple(p for p, _ in spec)
        for c in containers[1:]:
            other = (sorted({p.split(".", 1)[1] for p, _ in c.params}) if self.kind == "tiny_moe"
                     else tuple((p, per_expert_shape(s, c.num_experts)) for p, s in c.params))
            if c.kind != self.kind or (list(other) != list(spec)):
                raise ValueError(f"MoE layer {c.moe}'s experts differ from layer {first.moe}'s; the expert cache needs "
                                 "one expert shape across MoE layers")

    def slot_view(self, param: str) -> torch.Tensor:
        """[C, ...] view of one parameter's pool (DBRX's [C * r, ...] regrouped per slot)."""
        t = self.tensors[param]
        return t if t.shape[0] == self.capacity else t.view(self.capacity, t.shape[0] // self.capacity, *t.shape[1:])

    def write(self, slot: int, tensors: dict) -> None:
        """Copy one expert's tensors {param: tensor} into `slot`."""
        with torch.no_grad():
            if self.kind == "tiny_moe":
                own = dict(self.modules[slot].named_parameters())
                for p, t in tensors.items():
                    own[p].copy_(t, non_blocking=True)
                return
            for p, t in tensors.items():
                self.slot_view(p)[slot].copy_(t.reshape(self.slot_view(p).shape[1:]), non_blocking=True)


class ExpertCache:
    """At most `capacity` (MoE layer, expert) entries in `pool`, loaded from `store` on demand."""

    def __init__(self, capacity: int, store: ExpertStore, pool: ExpertPool, num_layers: int, num_experts: int,
                 policy_factory, resident=()):
        if capacity < 1 or capacity > pool.capacity:
            raise ValueError(f"expert cache capacity {capacity} must be between 1 and the pool's {pool.capacity} slots")
        self.capacity, self.store, self.pool = capacity, store, pool
        self.L, self.E = num_layers, num_experts
        self.policy_factory = policy_factory
        self.initial = [int(k) for k in list(resident)[:capacity]]
        self.copy_stream = torch.cuda.Stream(pool.device) if pool.device.type == "cuda" else None
        self.token, self.seq = -1, 0
        self.restart()

    def restart(self) -> None:
        """Back to the planned residents with fresh counters, log and policy (one run = one stream)."""
        self.stream = OnlineStream(self.L, self.E)
        self.policy = self.policy_factory()
        self.cached = np.zeros(self.L * self.E, dtype=bool)
        self.slot_of, self.free = {}, list(range(self.capacity - 1, -1, -1))
        self.loads = self.bytes_moved = 0
        for k in self.initial:
            self._install(k)
        self.requests = self.hits = self.loads = self.bytes_moved = 0  # the initial fill is not traffic of the run
        self.store.reset_counters()  # store hook: disk/host counters of the run only
        self.policy.start(self.stream, self.cached, self.initial)
        self.size = len(self.initial)
        self.token = -1

    def new_forward(self) -> None:
        """A library forward begins: its steps get the next token index (the simulator's step_token)."""
        self.token += 1

    def _install(self, key: int) -> int:
        tensors = self.store.load(key // self.E, key % self.E)
        slot = self.free.pop()
        if self.copy_stream is not None:  # pinned host -> device on the side stream
            with torch.cuda.stream(self.copy_stream):
                self.pool.write(slot, tensors)
            torch.cuda.current_stream(self.pool.device).wait_stream(self.copy_stream)
        else:
            self.pool.write(slot, tensors)
        self.slot_of[key] = slot
        self.cached[key] = True
        self.loads += 1
        self.bytes_moved += sum(t.numel() * t.element_size() for t in tensors.values())
        return slot

    def _drop(self, key: int) -> None:
        self.free.append(self.slot_of.pop(key))
        self.cached[key] = False

    def serve(self, layer: int, experts: list):
        """Yield the slot of each of the step's experts (distinct, request order), each made resident
        just before its turn (evicting by the policy): an expert computes before the next one loads."""
        keys = [layer * self.E + int(e) for e in experts]
        s = self.stream.add_step(layer, self.token, self.seq, keys)
        self.policy.begin_step(s)
        r0 = self.stream.step_start[s]
        for i, key in enumerate(keys):
            r = r0 + i
            self.requests += 1
            if self.cached[key]:
                self.hits += 1
                self.policy.touch(r, key, True)
            else:
                if self.size >= self.capacity:
                    v = int(self.policy.victim(r))
                    self._drop(v)
                    self.policy.evicted(v)
                else:
                    self.size += 1
                self._install(key)
                self.policy.inserted(key, r)
                self.policy.touch(r, key, False)
            yield self.slot_of[key]

    def output(self, adapter, h: torch.Tensor, local_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """`adapter.local_expert_output` through the cache: h [M, D], local_ids [M] (index in
        adapter.local), weights [M] -> weighted outputs [M, D], expert by expert in request order."""
        out = torch.zeros_like(h)
        experts = torch.tensor([adapter.local[i] for i in local_ids.tolist()], dtype=torch.int64)
        order = list(dict.fromkeys(experts.tolist()))
        for e, slot in zip(order, self.serve(adapter.moe, order)):
            rows = (experts == e).nonzero().flatten().to(h.device)
            slots = torch.full((rows.numel(),), slot, dtype=torch.int64, device=h.device)
            out[rows] = adapter.slot_output(h[rows], slots, weights[rows]).to(out.dtype)
        return out

    def stats(self) -> dict:
        return {"requests": self.requests, "hits": self.hits, "loads": self.loads, "bytes_moved": self.bytes_moved,
                "hit_ratio": self.hits / self.requests if self.requests else 0.0, "capacity": self.capacity,
                **self.store.counters()}  # store hook: bytes read from disk vs served from host memory

    def record(self) -> dict:
        """Counters and the request log, for results (rank-<r>.pt)."""
        return {"stats": self.stats(), "log": self.stream.to_record(), "resident": list(self.initial)}


# --- building a rank's cache from a bundle --------------------------------------------------------

def runtime_policy_factory(spec: dict):
    """() -> a fresh policy of the plan's eviction rule, from the simulator's classes shipped in the
    bundle (`runtime/offload_policies.py`, `runtime/offload_next_use.py`)."""
    from .offload_policies import DEMAND_POLICIES, make_policy  # written into bundles by the offload codegen

    name = spec["eviction"]
    if name == "belady" or name not in DEMAND_POLICIES:
        raise ValueError(f"eviction policy '{name}' cannot run online; plan with lru, lfu, lifo, moe-infinity or moeplan")
    model = None
    if name == "moeplan":
        from .offload_next_use import NextUseModel

        model = NextUseModel.from_dict(spec["policy_model"])
    return lambda: make_policy(name, model)


def expert_tensor_owner(containers: list):
    """name -> (MoE layer, expert, param relative to the expert) for per-expert bundle tensors."""
    owners = {}
    for c in containers:
        for p, _ in c.params:
            if c.kind == "tiny_moe":
                e, rel = p.split(".", 1)
                owners[f"{c.path}.{p}"] = (c.moe, int(e), rel)
            else:
                for e in range(c.num_experts):
                    owners[f"{c.path}.{e}.{p}"] = (c.moe, e, p)
    return owners.get


def attach_expert_cache(rank_model, pool: ExpertPool, store: ExpertStore, spec: dict, rank: int, local: dict) -> ExpertCache:
    """Give every adapter of `rank_model` the pool and the cache (spec: the plan's expert_cache
    section; local: {MoE layer: this rank's experts}); forwards advance the cache's token index."""
    containers = rank_model.containers
    E = containers[0].num_experts
    resident = [int(l) * E + int(e) for l, e in spec["resident"][rank]]
    cache = ExpertCache(int(spec["capacity"][rank]), store, pool, len(containers), E, runtime_policy_factory(spec),
                        resident)
    for adapter in rank_model.adapters:
        adapter.use_pool(rank_model.model, pool, local.get(adapter.moe, []), cache)
    forward = rank_model.forward

    def counted_forward(*args, **kwargs):
        cache.new_forward()
        return forward(*args, **kwargs)

    rank_model.forward = counted_forward
    rank_model.expert_cache = cache
    return cache


def offloaded_rank_model(shard_path, model, arch: str, spec: dict, rank: int, local: dict, max_positions: int, device,
                         checkpoint_dir=None):
    """A RankModel whose experts live in an expert cache: dense weights from the rank's shard (or,
    for a reference index, from the checkpoint in `checkpoint_dir`), expert tensors read from it on
    demand through the host tier (`spec["host"]`), `spec["capacity"][rank]` slots on `device`."""
    from .expert_store import open_rank_store
    from .library_model import RankModel, decoder_layers
    from .moe_adapter import find_containers

    prefix, layers = decoder_layers(model)
    containers = find_containers(layers, prefix)
    owner = expert_tensor_owner(containers)
    device = torch.device(device)
    pool = ExpertPool(containers, model.get_submodule(containers[0].block), int(spec["capacity"][rank]), device)
    host = spec.get("host")  # plans without a host tier read every load from the files
    store, dense = open_rank_store(shard_path, owner, pinned=device.type == "cuda",
                                   host_keys=host["resident"][rank] if host else (), checkpoint_dir=checkpoint_dir)
    rank_model = RankModel(model, arch, None, {}, dense, max_positions)
    model.to(device)
    attach_expert_cache(rank_model, pool, store, spec, rank, local)
    return rank_model
