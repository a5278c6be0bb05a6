"""Eviction policies of the GPU expert cache, over a request `Stream` (passes/optimize/offload/stream.py).

A policy sees the stream in order. The driver (passes/optimize/offload/simulator.py, or the stepper) calls `begin_step(s)` when a step's
router has run (all of the step's keys are then known), `touch(r, key)` once request r is served
(key now cached), and `victim(r, exclude)` when a key must leave a full cache; `evicted(key)`
follows. `cached` is the driver's bool [N] residency mask, shared with the policy.

* `lru`: least recently used (exact; tested against a brute force).
* `lfu`: fewest requests since the start of the stream (perfect LFU), ties LRU.
* `lifo`: the Expert Buffer rule (Towards MoE Deployment): evict first experts inactive in the
  current step; among candidates the last one loaded (last in, first out).
* `moe-infinity`: Alg. 2 of MoE-Infinity: lowest (C[l][j]/sum_k C[l][k] + EPS) * (1 - l/L), C the
  current sequence's EAM; ties LRU.
* `belady`: evict the key whose next request is farthest (offline optimum for demand paging with
  forced admission; tested against a brute force).
* `moeplan`: evict the largest expected distance to the next request, from a model fitted on the
  planning trace (next_use.py); ties LRU.
"""
from __future__ import annotations

import heapq
from collections import OrderedDict

import numpy as np

EPS = 1e-3  # MoE-Infinity's EPS (unspecified in the paper; small)
NEVER = np.iinfo(np.int64).max


class Policy:
    """Base: bookkeeping every policy shares (last use, current step)."""

    name = "base"

    def start(self, stream, cached: np.ndarray, resident) -> None:
        self.stream, self.cached = stream, cached
        self.last_req = np.full(stream.num_keys, -1, dtype=np.int64)
        self.step = -1
        for i, key in enumerate(resident):  # the initial fill counts as used in that order, before the stream
            self.last_req[key] = i - len(resident) - 1
            self.inserted(int(key), i - len(resident) - 1)

    def begin_step(self, s: int) -> None:
        self.step = s

    def step_keys(self) -> np.ndarray:
        st = self.stream.step_start
        return self.stream.keys[st[self.step]:st[self.step + 1]]

    def touch(self, r: int, key: int, hit: bool) -> None:
        self.last_req[key] = r

    def inserted(self, key: int, r: int) -> None:
        pass

    def evicted(self, key: int) -> None:
        pass

    def victim(self, r: int, exclude=()) -> int:
        raise NotImplementedError

    def _lru_among(self, keys: np.ndarray) -> int:
        return int(keys[np.lexsort((keys, self.last_req[keys]))[0]])

    def _candidates(self, exclude) -> np.ndarray:
        """Cached keys not in `exclude` (all cached keys if that leaves none)."""
        if len(exclude):
            mask = self.cached.copy()
            mask[list(exclude)] = False
            if mask.any():
                return np.flatnonzero(mask)
        return np.flatnonzero(self.cached)


class LRU(Policy):
    name = "lru"

    def start(self, stream, cached, resident):
        self.order = OrderedDict()
        super().start(stream, cached, resident)

    def inserted(self, key, r):
        self.order[key] = None

    def touch(self, r, key, hit):
        super().touch(r, key, hit)
        self.order.move_to_end(key)

    def evicted(self, key):
        del self.order[key]

    def victim(self, r, exclude=()):
        for key in self.order:
            if key not in exclude:
                return key
        return next(iter(self.order))


class LFU(Policy):
    name = "lfu"

    def start(self, stream, cached, resident):
        self.count = np.zeros(stream.num_keys, dtype=np.int64)
        self.heap = []
        super().start(stream, cached, resident)

    def inserted(self, key, r):
        heapq.heappush(self.heap, (int(self.count[key]), int(self.last_req[key]), key))

    def touch(self, r, key, hit):
        super().touch(r, key, hit)
        self.count[key] += 1
        heapq.heappush(self.heap, (int(self.count[key]), r, key))

    def victim(self, r, exclude=()):
        if len(exclude):
            c = self._candidates(exclude)
            return int(c[np.lexsort((c, self.last_req[c], self.count[c]))[0]])
        while True:
            count, last, key = self.heap[0]
            if self.cached[key] and count == self.count[key] and last == self.last_req[key]:
                return key
            heapq.heappop(self.heap)


class LIFO(Policy):
    """Expert Buffer: inactive-in-this-step experts first, then last in, first out."""

    name = "lifo"

    def start(self, stream, cached, resident):
        self.loaded = OrderedDict()  # insertion order
        super().start(stream, cached, resident)

    def inserted(self, key, r):
        self.loaded[key] = None

    def evicted(self, key):
        del self.loaded[key]

    def victim(self, r, exclude=()):
        active = set(self.step_keys().tolist()) | {int(k) for k in exclude}
        for key in reversed(self.loaded):
            if key not in active:
                return key
        for key in reversed(self.loaded):
            if key not in exclude:
                return key
        return next(reversed(self.loaded))


class MoEInfinity(Policy):
    """MoE-Infinity's cache priority over the current sequence's EAM (Alg. 2)."""

    name = "moe-infinity"

    def start(self, stream, cached, resident):
        L, E = stream.num_layers, stream.num_experts
        self.eam = np.zeros((L, E), dtype=np.float64)
        self.decay = np.repeat(1.0 - np.arange(L) / L, E)
        self.seq = -1
        super().start(stream, cached, resident)

    def begin_step(self, s):
        super().begin_step(s)
        if self.stream.step_seq[s] != self.seq:
            self.seq = self.stream.step_seq[s]
            self.eam[:] = 0
        keys = self.step_keys()
        E = self.stream.num_experts
        self.eam[keys // E, keys % E] += 1
        self._prio = None

    def priority(self) -> np.ndarray:
        """cprio of every key [N] (the EAM changes only when a step begins)."""
        if getattr(self, "_prio", None) is None:
            rows = self.eam.sum(axis=1, keepdims=True)
            share = np.divide(self.eam, rows, out=np.zeros_like(self.eam), where=rows > 0)
            self._prio = (share.reshape(-1) + EPS) * self.decay
        return self._prio

    def victim(self, r, exclude=()):
        c = self._candidates(exclude)
        prio = self.priority()[c]
        return int(c[np.lexsort((c, self.last_req[c], prio))[0]])


class Belady(Policy):
    """Evict the cached key requested farthest in the future (never again = farthest)."""

    name = "belady"

    def start(self, stream, cached, resident):
        keys = stream.keys
        R = len(keys)
        self.next_req = np.full(R, NEVER, dtype=np.int64)
        self.next_of_key = np.full(stream.num_keys, NEVER, dtype=np.int64)
        last = {}
        for r in range(R - 1, -1, -1):  # next request of the same key after r
            k = int(keys[r])
            self.next_req[r] = last.get(k, NEVER)
            last[k] = r
        self.first_req = last
        self.heap = []
        super().start(stream, cached, resident)

    def _push(self, key):
        heapq.heappush(self.heap, (-int(self.next_of_key[key]), key))

    def inserted(self, key, r):
        if r < 0:  # initial fill: its next use is its first request
            self.next_of_key[key] = self.first_req.get(key, NEVER)
            self._push(key)

    def touch(self, r, key, hit):
        super().touch(r, key, hit)
        self.next_of_key[key] = self.next_req[r]
        self._push(key)

    def victim(self, r, exclude=()):
        if len(exclude):
            c = self._candidates(exclude)
            return int(c[np.lexsort((c, -self.next_of_key[c]))[0]])
        while True:
            neg, key = self.heap[0]
            if self.cached[key] and -neg == self.next_of_key[key]:
                return key
            heapq.heappop(self.heap)


class Moeplan(Policy):
    """The planner's policy: evict the largest expected distance (in steps) to the next request."""

    name = "moeplan"

    def __init__(self, model):
        self.model = model  # next_use.NextUseModel

    def start(self, stream, cached, resident):
        self.state = self.model.new_state(stream)
        super().start(stream, cached, resident)

    def begin_step(self, s):
        super().begin_step(s)
        self.state.begin_step(s, self.step_keys())

    def touch(self, r, key, hit):
        super().touch(r, key, hit)
        self.state.touch(key)

    def scores(self, keys: np.ndarray) -> np.ndarray:
        """Eviction scores (higher = evict first) of `keys` now."""
        return self.state.scores(keys)

    miss_cost = None  # float [N] or None: a miss's relative cost per key (`weigh_misses`)

    def weigh_misses(self, cost: np.ndarray) -> None:
        """Evict by expected steps to the next use per unit of a miss's cost (float [N], > 0): a
        prefetcher that hides some misses better than others sets it (a method, not an attribute
        write, so that wrappers which delegate to the policy pass it on)."""
        self.miss_cost = np.asarray(cost, dtype=float)

    def victim(self, r, exclude=()):
        all_scores = self.state.all_scores()
        if self.miss_cost is not None:  # expected steps to the next use per unit of a miss's cost: cheap misses go first
            all_scores = np.where(all_scores > 0, all_scores / self.miss_cost, all_scores)
        s = np.where(self.cached, all_scores, -np.inf)
        if len(exclude):
            s[list(exclude)] = -np.inf
            if not np.isfinite(s.max()):
                s = np.where(self.cached, all_scores, -np.inf)
        best = np.flatnonzero(s == s.max())
        if len(best) == 1:
            return int(best[0])
        return self._lru_among(best)


def make_policy(name: str, model=None) -> Policy:
    """A fresh policy by name (`moeplan` needs the fitted next-use model)."""
    table = {"lru": LRU, "lfu": LFU, "lifo": LIFO, "moe-infinity": MoEInfinity, "belady": Belady}
    if name == "moeplan":
        return Moeplan(model)
    return table[name]()


DEMAND_POLICIES = ("lru", "lfu", "lifo", "moe-infinity", "belady", "moeplan")
