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
  prefill step's expert count. Which requests hit, which keys are evicted and which are prefetched
  is decided by the simulator's own stepper (`TimedCache`: policy, prefetcher and a modelled
  clock), so it depends on the routing only, never on wall-clock timing; the cache moves the
  weights: prefetched experts are read by a background thread while the model computes and
  installed before the next MoE step computes (waiting for the thread if it is not done). It
  counts requests, hits, loads, prefetches and bytes moved and keeps the request log
  (`OnlineStream`), which `moeplan run --verify` replays through the simulator.
* The store (`expert_store.py`: the copied shard, or the original checkpoint through the rank's
  reference index) hands over one expert's float32 tensors per load, pinned on CUDA; the store
  counts bytes read from disk and served from host memory. CUDA copies run on a side stream after
  an event of the last compute that may read the slot, and the compute stream waits for them
  (that path cannot run on this CPU-only machine: written, never run).
* Policies, prefetchers and the stepper: `policies.py`, `next_use.py`,
  `prefetch.py`, `stepper.py` and `eam_match.py` beside this file, the very
  modules the planner's simulator imports, shipped in bundles with expert caches, driven through `OnlineStream` exactly
  as the simulator drives them.
Nothing here imports moeplan: bundles run without it.
"""
from __future__ import annotations

import copy

import numpy as np
import torch
import torch.nn as nn

from .expert_store import ExpertStore, ShardStore, tensor_bytes  # noqa: F401  (ShardStore: the copy form)


class _Tail:
    """A growing list indexed by global position, of which the entries before `offset` are forgotten."""

    def __init__(self, first=()):
        self.items, self.offset = list(first), 0

    def __getitem__(self, i: int):
        return self.items[i if i < 0 else i - self.offset]

    def __len__(self) -> int:
        return self.offset + len(self.items)

    def append(self, value) -> None:
        self.items.append(value)

    def forget(self, count: int) -> None:
        del self.items[:count]
        self.offset += count


class _KeysTail:
    """The request keys by global request index, once the oldest were forgotten (slices only)."""

    def __init__(self, buffer: np.ndarray, offset: int, end: int):
        self.buffer, self.offset, self.end = buffer, offset, end

    def __getitem__(self, span: slice) -> np.ndarray:
        return self.buffer[span.start - self.offset:span.stop - self.offset]

    def __len__(self) -> int:
        return self.end


class OnlineStream:
    """The request stream as it happens: same fields as the simulator's `Stream`, grown per step,
    with each request's token rows and, with `spec_depth` D > 0, each step's speculation (D groups
    of keys, empty until `set_speculation`).

    A service runs for days: `forget_before(step)` drops the log before a step (the online
    policies, prefetchers and the stepper read only the current step's entries and keep global
    request numbers as times), after which `keys` slices by global index and the log cannot be
    recorded any more."""

    def __init__(self, num_layers: int, num_experts: int, spec_depth: int = 0):
        self.num_layers, self.num_experts, self.spec_depth = num_layers, num_experts, int(spec_depth)
        self.num_keys = num_layers * num_experts
        self._keys = np.zeros(1024, dtype=np.int64)
        self._rows = np.zeros(1024, dtype=np.int64)
        self._key_offset = 0
        self.step_start, self.step_layer, self.step_token, self.step_seq = _Tail([0]), _Tail(), _Tail(), _Tail()
        self.spec_groups = _Tail()  # per step: D lists of speculated keys

    @property
    def keys(self):
        end = self.step_start[-1]
        if self._key_offset == 0:
            return self._keys[:end]
        return _KeysTail(self._keys, self._key_offset, end)

    @property
    def num_steps(self) -> int:
        return len(self.step_layer)

    @property
    def first_step(self) -> int:
        return self.step_layer.offset

    def request_rows(self, r: int) -> int:
        return int(self._rows[r - self._key_offset])

    def speculated(self, s: int, d: int) -> list:
        return self.spec_groups[s][d - 1] if d <= self.spec_depth else []

    def add_step(self, layer: int, token: int, seq: int, keys: list, rows=None) -> int:
        """Append one step's keys (and their token rows, default 1 each); returns its index."""
        start = self.step_start[-1] - self._key_offset
        end = start + len(keys)
        while end > len(self._keys):
            self._keys = np.concatenate([self._keys, np.zeros(len(self._keys), dtype=np.int64)])
            self._rows = np.concatenate([self._rows, np.zeros(len(self._rows), dtype=np.int64)])
        self._keys[start:end] = keys
        self._rows[start:end] = 1 if rows is None else rows
        self.step_start.append(end + self._key_offset)
        self.step_layer.append(layer)
        self.step_token.append(token)
        self.step_seq.append(seq)
        self.spec_groups.append([[] for _ in range(self.spec_depth)])
        return self.num_steps - 1

    def forget_before(self, step: int) -> None:
        """Drop the log of the steps before `step` (global step and request numbers stay)."""
        count = step - self.first_step
        if count <= 0:
            return
        cut = self.step_start[step] - self._key_offset
        kept = self.step_start[-1] - self._key_offset - cut
        spare = np.zeros(max(1024, kept), dtype=np.int64)
        self._keys = np.concatenate([self._keys[cut:cut + kept], spare])
        self._rows = np.concatenate([self._rows[cut:cut + kept], spare])
        self._key_offset += cut
        for tail in (self.step_start, self.step_layer, self.step_token, self.step_seq, self.spec_groups):
            tail.forget(count)

    def set_speculation(self, s: int, groups: list) -> None:
        """The last step's speculated keys, one list per distance 1..D."""
        if s != self.num_steps - 1 or len(groups) != self.spec_depth:
            raise ValueError(f"speculation for step {s} with {len(groups)} distances; expected the last step "
                             f"({self.num_steps - 1}) and {self.spec_depth}")
        self.spec_groups.items[-1] = [[int(k) for k in g] for g in groups]

    def to_record(self) -> dict:
        """The log as int64 tensors: keys and rows [R], step_start [S+1], step_layer/step_token/step_seq
        [S]; with speculation spec_keys [Q], spec_start [S * D + 1] and spec_depth."""
        if self.first_step:
            raise RuntimeError("the expert cache's request log was windowed (a service); it cannot be recorded")
        as_t = lambda v: torch.tensor(np.asarray(v, dtype=np.int64))
        out = {"keys": as_t(self.keys), "rows": as_t(self._rows[: self.step_start[-1]]),
               "step_start": as_t(self.step_start.items), "step_layer": as_t(self.step_layer.items),
               "step_token": as_t(self.step_token.items), "step_seq": as_t(self.step_seq.items),
               "num_layers": self.num_layers, "num_experts": self.num_experts}
        if self.spec_depth:
            flat = [g for step in self.spec_groups.items for g in step]
            out.update(spec_keys=as_t([k for g in flat for k in g]), spec_depth=self.spec_depth,
                       spec_start=as_t(np.r_[0, np.cumsum([len(g) for g in flat])]))
        return out


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


class PrefetchReader:
    """Reads the tensors of decided prefetch copies on one background thread (the store's shard;
    pinned host memory on CUDA), so the reading overlaps the step's compute and the next layer's;
    `take` hands them over, waiting if the thread is not done (the wait is counted, in wall time).
    Demand reads on the compute thread go through `read` too: one reader of the store at a time."""

    def __init__(self, store, num_experts: int):
        import threading
        from concurrent.futures import ThreadPoolExecutor

        self.store, self.E = store, num_experts
        self.lock = threading.Lock()  # one reader of the store at a time (its file handle and counters)
        self.thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moeplan-prefetch")
        self.job = None
        self.waits, self.wait_s = 0, 0.0

    def read(self, key: int) -> dict:
        """One expert's tensors from the store, on whichever thread calls it."""
        with self.lock:
            return self.store.load(key // self.E, key % self.E)

    def start(self, keys: list) -> None:
        self.job = self.thread.submit(lambda: [self.read(k) for k in keys])

    def take(self) -> list:
        """[{param: tensor}] of the last `start`'s keys, in order."""
        import time

        job, self.job = self.job, None
        if not job.done():
            t0 = time.perf_counter()
            self.waits += 1
            out = job.result()
            self.wait_s += time.perf_counter() - t0
            return out
        return job.result()

    def drop(self) -> None:
        if self.job is not None:
            self.job.result()
            self.job = None
        self.waits, self.wait_s = 0, 0.0


class ExpertCache:
    """At most `capacity` (MoE layer, expert) entries in `pool`, loaded from `store` on demand and by
    prefetch, as the simulator's stepper decides.

    `new_stepper(stream, capacity, resident)` -> a fresh `TimedCache` (`plan_stepper` of
    stepper.py, the simulator's own) with the plan's
    policy, prefetcher and timing:
    it decides every hit, eviction and prefetch from the routing and a modelled clock; this class
    moves the weights. Per step (`begin_step`): (1) the copies decided after the previous step are
    installed (their tensors read by the background `PrefetchReader`; waited for if not done);
    (2) the stepper serves the step and decides the next copies, whose reading starts at once;
    (3) `make_resident` per request: a hit must already be in the pool, a miss is read now into the
    evicted key's slot (demand), each just before its rows compute. Counters (requests, hits, loads,
    bytes, prefetches, prefetched keys that hit) are counted from what was moved, not copied from
    the stepper; `moeplan run --verify` checks them against the simulator's replay of the log.
    """

    def __init__(self, capacity: int, store: ExpertStore, pool: ExpertPool, num_layers: int, num_experts: int,
                 new_stepper, resident=(), spec_depth: int = 0, host=None):
        if capacity < 1 or capacity > pool.capacity:
            raise ValueError(f"expert cache capacity {capacity} must be between 1 and the pool's {pool.capacity} slots")
        self.capacity, self.store, self.pool = capacity, store, pool
        self.L, self.E = num_layers, num_experts
        self.new_stepper = new_stepper
        self.spec_depth = int(spec_depth)  # > 0: decisions wait for the step's speculation (`speculate`)
        self.host = host  # host_compute.HostExperts, for requests the stepper computes on the host
        self.initial = [int(k) for k in list(resident)[:capacity]]
        self.copy_stream = torch.cuda.Stream(pool.device) if pool.device.type == "cuda" else None
        self.reader = PrefetchReader(store, num_experts)
        self.token, self.seq = -1, 0
        self.keep_steps = None  # a service keeps this many steps of the request log (None: all, to record it)
        self.restart()

    def restart(self) -> None:
        """Back to the planned residents with fresh counters, log and stepper (one run = one stream)."""
        self.reader.drop()
        self.pending, self.computed, self.undecided = [], None, None
        self.stream = OnlineStream(self.L, self.E, self.spec_depth)
        self.slot_of, self.free = {}, list(range(self.capacity - 1, -1, -1))
        for k in self.initial:
            slot = self.free.pop()
            self._write(slot, self.reader.read(k))
            self.slot_of[k] = slot
        self.stepper = self.new_stepper(self.stream, self.capacity, self.initial)
        self.policy, self.cached = self.stepper.policy, self.stepper.cached
        self.requests = self.hits = self.loads = self.bytes_moved = self.prefetches = self.prefetch_hits = 0
        self.host_computed = self.host_rows = 0
        self.unused_prefetch = set()
        self.store.reset_counters()  # store hook: disk/host counters of the run only (not the initial fill)
        self.token = -1

    def new_forward(self) -> None:
        """A library forward begins: its steps get the next token index (the simulator's step_token)."""
        self.token += 1

    # --- moving weights ----------------------------------------------------------------------
    def _write(self, slot: int, tensors: dict, after=None) -> None:
        """Copy one expert into `slot`. CUDA: on the side stream, after `after` (an event: the last
        compute that may read the slot's old expert) or else everything enqueued so far."""
        if self.copy_stream is None:
            self.pool.write(slot, tensors)
            return
        compute = torch.cuda.current_stream(self.pool.device)
        if after is not None:
            self.copy_stream.wait_event(after)
        else:
            self.copy_stream.wait_stream(compute)
        with torch.cuda.stream(self.copy_stream):
            self.pool.write(slot, tensors)
        compute.wait_stream(self.copy_stream)

    def _vacate(self, victim) -> int:
        """The slot a new key takes: the evicted key's, or a free one."""
        if victim is None:
            return self.free.pop()
        self.unused_prefetch.discard(victim)
        return self.slot_of.pop(victim)

    def _install(self, key: int, victim, tensors: dict, after=None) -> int:
        slot = self._vacate(victim)
        self._write(slot, tensors, after)
        self.slot_of[key] = slot
        self.loads += 1
        self.bytes_moved += tensor_bytes(tensors)
        return slot

    def _install_pending(self) -> None:
        """The copies decided after the previous step, into their slots (before this step computes)."""
        if not self.pending:
            return
        staged = self.reader.take()
        for (key, victim), tensors in zip(self.pending, staged):
            self._install(key, victim, tensors, after=self.computed)
            self.prefetches += 1
            self.unused_prefetch.add(key)
        self.pending = []

    # --- one step ------------------------------------------------------------------------------
    def begin_step(self, layer: int, experts: list, rows=None) -> list:
        """Log one MoE layer step (distinct experts, request order, their token rows), install the
        pending copies, serve it with the stepper; returns its requests [(key, hit, evicted key or
        None, on host)]. The copies decided after it start reading at once, or, with speculation,
        once `speculate` gives the step's speculated keys (a step left without is decided on empty
        groups before the next one)."""
        self._decide_open(None)
        keys = [layer * self.E + int(e) for e in experts]
        s = self.stream.add_step(layer, self.token, self.seq, keys, rows)
        if self.keep_steps is not None and s - self.stream.first_step >= 2 * self.keep_steps:
            self.stream.forget_before(s + 1 - self.keep_steps)
        self._install_pending()
        served = self.stepper.serve(s)
        self.undecided = s
        if not self.spec_depth:
            self._decide_open(None)
        return served

    def speculate(self, layer: int, groups: list) -> None:
        """The speculation after MoE layer `layer` ran here (per distance 1..D, keys of the layers
        ahead): decides the copies of the step it belongs to. Ignored when this rank served no
        step of that layer in this forward."""
        s = self.undecided
        if s is not None and self.stream.step_layer[s] == layer and self.stream.step_token[s] == self.token:
            self._decide_open(groups)

    def _decide_open(self, groups) -> None:
        s, self.undecided = self.undecided, None
        if s is None:
            return
        if groups is not None:
            self.stream.set_speculation(s, groups)
        self.pending = self.stepper.decide(s)
        if self.pending:
            self.reader.start([k for k, _ in self.pending])

    def make_resident(self, key: int, hit: bool, evicted, host: bool = False):
        """The slot of one served request: a hit must be in the pool; a miss is read now (demand);
        None for a request computed on the host (nothing moves into the pool)."""
        self.requests += 1
        if host:
            self.host_computed += 1
            return None
        if hit:
            if key not in self.slot_of:
                raise RuntimeError(f"expert cache out of step with its stepper: key {key} is a hit but not in the pool")
            self.hits += 1
            if key in self.unused_prefetch:
                self.prefetch_hits += 1
                self.unused_prefetch.discard(key)
            return self.slot_of[key]
        return self._install(key, evicted, self.reader.read(key))

    def end_step(self) -> None:
        """The step's compute is enqueued (CUDA: an event the next step's copies wait for)."""
        if self.copy_stream is not None:
            self.computed = torch.cuda.current_stream(self.pool.device).record_event()

    def serve(self, layer: int, experts: list, rows=None):
        """Yield the slot of each of the step's experts (distinct, request order; None: computed on
        the host), each made resident just before its turn: an expert computes before the next one
        loads. Exhaust it."""
        for request, n in zip(self.begin_step(layer, experts, rows), rows or [1] * len(experts)):
            slot = self.make_resident(*request)
            self.host_rows += n if slot is None else 0
            yield slot
        self.end_step()

    def flush(self) -> None:
        """Decide a step still open, then install the copies decided after the last step (every
        decided copy moves)."""
        self._decide_open(None)
        self._install_pending()

    def output(self, adapter, h: torch.Tensor, local_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """`adapter.local_expert_output` through the cache: h [M, D], local_ids [M] (index in
        adapter.local), weights [M] -> weighted outputs [M, D], expert by expert in request order;
        an expert the stepper computes on the host runs there on its host weights (`host_compute.py`)."""
        out = torch.zeros_like(h)
        experts = torch.tensor([adapter.local[i] for i in local_ids.tolist()], dtype=torch.int64)
        order = list(dict.fromkeys(experts.tolist()))
        rows_of = [(experts == e).nonzero().flatten().to(h.device) for e in order]
        for rows, request in zip(rows_of, self.begin_step(adapter.moe, order, [r.numel() for r in rows_of])):
            slot = self.make_resident(*request)
            if slot is None:
                self.host_rows += rows.numel()
                out[rows] = self.host.output(adapter, request[0], h[rows], weights[rows]).to(out.dtype)
                continue
            slots = torch.full((rows.numel(),), slot, dtype=torch.int64, device=h.device)
            out[rows] = adapter.slot_output(h[rows], slots, weights[rows]).to(out.dtype)
        self.end_step()
        return out

    def stats(self) -> dict:
        """Counted from the weights moved, plus the stepper's modelled figures (resident at layer
        start, seconds) and the reader's waits (wall clock, not deterministic)."""
        return {"requests": self.requests, "hits": self.hits, "loads": self.loads, "bytes_moved": self.bytes_moved,
                "prefetches": self.prefetches, "prefetch_hits": self.prefetch_hits,
                "host_computed": self.host_computed, "host_rows": self.host_rows,
                "resident_at_layer_start": int(self.stepper.resident_at_start), "modelled_seconds": float(self.stepper.now),
                "prefetch_waits": self.reader.waits, "prefetch_wait_s": self.reader.wait_s,
                "hit_ratio": self.hits / self.requests if self.requests else 0.0, "capacity": self.capacity,
                **self.store.counters()}  # store hook: bytes read from disk vs served from host memory

    def record(self) -> dict:
        """Counters and the request log, for results (rank-<r>.pt)."""
        self.flush()
        return {"stats": self.stats(), "log": self.stream.to_record(), "resident": list(self.initial)}


# --- building a rank's cache from a bundle --------------------------------------------------------

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
    from .stepper import pair_keys, plan_stepper  # the simulator's own stepper (shipped with expert caches)

    from .host_compute import HostExperts
    from .speculation import LiveSpeculation

    containers = rank_model.containers
    E = containers[0].num_experts
    allowed = np.zeros(len(containers) * E, dtype=bool)  # the rank's experts: the only keys it prefetches
    for layer, experts in local.items():
        allowed[pair_keys([(layer, e) for e in experts], E)] = True
    speculative = spec.get("prefetch") == "speculative"
    depth = int(spec["speculation"]["depth"]) if speculative else 0
    host = HostExperts(pool, store, E) if spec.get("host_compute") == "cheaper" else None
    cache = ExpertCache(int(spec["capacity"][rank]), store, pool, len(containers), E,
                        plan_stepper(spec, rank, allowed, E), pair_keys(spec["resident"][rank], E), depth, host)
    for adapter in rank_model.adapters:
        adapter.use_pool(rank_model.model, pool, local.get(adapter.moe, []), cache)
    if speculative:  # the engine installs its hooks (the rows real on this rank decide what is speculated)
        rank_model.speculation = LiveSpeculation(rank_model, cache, depth, spec["speculation"]["source"])
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
    from ..model.library_model import RankModel, decoder_layers
    from ..model.moe_adapter import find_containers

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
