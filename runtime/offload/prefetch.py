"""Prefetchers for the timed simulation: MoE-Infinity's EAMC-guided one and the planner's.

Interface (see stepper.TimedCache): `start(stream, cached, policy)`, `after_step(s)` -> keys
to copy next in order, `victim_for(key, exclude)` -> the key to evict for it, or None to decline.
`allowed` (bool [L * E], optional): the only keys it may queue (a rank of an expert-parallel
bundle caches its own experts only). The simulator imports it from here, and bundles with expert
caches ship it as it is.

* `EAMCPrefetch` (MoE-Infinity Alg. 1): after each router, add the step to the sequence's running
  EAM, match the nearest EAMC entry R (the paper's distance over the layers that ran), and queue
  the experts of every later layer f of this token by (R[f][j] / sum_k R[f][k] + EPS)(1 - f/L),
  highest first. Only experts with R[f][j] > 0 are queued (the EPS-only tail would churn the
  cache on a fast link; our reading). The incoming expert is always admitted (its victim: the
  cache policy's, MoE-Infinity's priority in the paper).
* `NextUsePrefetch` (ours): after each router, queue the next layer's experts that are not cached
  (the next token's first layer after the last), most wanted first by the next-use model (the
  next layer's probabilities use this token's routing: inter-layer affinity); admit one only if
  the model prefers it to the victim it would evict, and only into link time that is idle until
  the next router (when a copy takes longer than a layer computes, nothing is prefetched).
* `SpeculativePrefetch` (issue 33): after each step, the experts that the routers of the next
  `depth` MoE layers pick from this step's hidden state (the stream's speculation, recorded by
  `moeplan trace --speculate` or computed live by the runtime with the same router modules), layer
  l+1's first, each in the speculation's order; copies start as soon as the speculation is known
  (`after_experts`: from the block's output, once the step's experts have computed), limited by
  the link's bandwidth: a copy is issued only while it arrives early enough to pay, weighed by the
  speculation's recall (`latest_arrival`), so on a link much slower than a layer's compute it
  copies little. A victim is never one of this step's keys nor a key speculated for the layers
  ahead; when the cache holds nothing else, the copy is declined. After the last MoE layer no
  speculation reaches the next token's first layer (its input is a token not yet sampled): there,
  with a policy that scores keys (next-use), it queues that layer's experts as `NextUsePrefetch`
  does (most wanted first, only into link time idle until the next router, only in place of a
  victim the policy wants less). With that policy it also weighs evictions by cost
  (`price_misses`): a first layer's miss costs its whole copy, a later layer's only what a right
  guess leaves unhidden, so the cache keeps what speculation cannot bring back in time.
"""
from __future__ import annotations

import numpy as np

from .eam_match import nearest_entry, row_normalised
from .policies import EPS


def allowed_mask(allowed, num_keys: int) -> np.ndarray:
    """bool [N]: the keys a prefetcher may copy (None: all; under expert parallelism a rank's own)."""
    return np.ones(num_keys, dtype=bool) if allowed is None else np.asarray(allowed, dtype=bool).reshape(num_keys)


class EAMCPrefetch:
    name = "moe-infinity"

    def __init__(self, eamc: np.ndarray, allowed=None):
        self.eamc = np.asarray(eamc, dtype=float)
        self.unit = row_normalised(self.eamc)
        self.allowed = allowed

    def start(self, stream, cached, policy):
        self.stream, self.cached, self.policy = stream, cached, policy
        self.may_copy = allowed_mask(self.allowed, stream.num_keys)
        self.eam = np.zeros((stream.num_layers, stream.num_experts))
        self.seq = -1

    def after_step(self, s: int) -> list:
        st = self.stream
        L, E = st.num_layers, st.num_experts
        if st.step_seq[s] != self.seq:
            self.seq = st.step_seq[s]
            self.eam[:] = 0
        keys = st.keys[st.step_start[s]:st.step_start[s + 1]]
        self.eam[keys // E, keys % E] += 1
        lc = int(st.step_layer[s])
        if lc == L - 1 or len(self.eamc) == 0:
            return []
        R = self.eamc[nearest_entry(self.eam, self.unit)][lc + 1:]
        rows = R.sum(axis=1, keepdims=True)
        share = np.divide(R, rows, out=np.zeros_like(R), where=rows > 0)
        prio = (share + EPS) * (1.0 - np.arange(lc + 1, L)[:, None] / L)
        f, j = np.nonzero(R > 0)
        order = np.lexsort((j, f, -prio[f, j]))
        cand = (f[order] + lc + 1) * E + j[order]
        return [int(k) for k in cand if not self.cached[k] and self.may_copy[k]]

    def victim_for(self, key: int, exclude) -> int:
        return self.policy.victim(-1, exclude)


class NextUsePrefetch:
    name = "moeplan"
    idle_only = True  # a copy must arrive before the next router: prefetching never delays demand

    def __init__(self, allowed=None):
        self.allowed = allowed

    def start(self, stream, cached, policy):
        if not hasattr(policy, "scores"):
            raise ValueError("the moeplan prefetcher needs the moeplan eviction policy")
        self.stream, self.cached, self.policy = stream, cached, policy
        self.may_copy = allowed_mask(self.allowed, stream.num_keys)
        self.L, self.E = stream.num_layers, stream.num_experts

    def after_step(self, s: int) -> list:
        nxt = (int(self.stream.step_layer[s]) + 1) % self.L
        span = slice(nxt * self.E, (nxt + 1) * self.E)
        cand = nxt * self.E + np.flatnonzero(~self.cached[span] & self.may_copy[span])
        if len(cand) == 0:
            return []
        score = self.policy.scores(cand)
        order = np.lexsort((cand, score))
        self.queued = dict(zip(cand[order].tolist(), score[order].tolist()))
        return list(self.queued)

    def victim_for(self, key: int, exclude):
        v = self.policy.victim(-1, exclude)
        sv = float(self.policy.state.all_scores()[v])
        return v if self.queued.get(key, np.inf) < sv else None


class SpeculativePrefetch:
    name = "speculative"

    def __init__(self, allowed=None, depth: int = 1, after_experts: bool = True, recall=None):
        if depth < 1:
            raise ValueError(f"the speculative prefetcher looks at least 1 MoE layer ahead, got {depth}")
        self.allowed, self.depth, self.after_experts = allowed, int(depth), bool(after_experts)
        self.recall = {int(d): float(r) for d, r in (recall or {}).items()}  # distance -> share of guesses right

    def start(self, stream, cached, policy):
        if not stream.spec_depth:
            raise ValueError("the speculative prefetcher needs a stream with speculation (a trace recorded with "
                             "'moeplan trace --speculate D', or the runtime's live speculation)")
        self.stream, self.cached, self.policy = stream, cached, policy
        self.may_copy = allowed_mask(self.allowed, stream.num_keys)
        self.predicted = set()
        self.first_layer = NextUsePrefetch(self.allowed) if hasattr(policy, "scores") else None
        if self.first_layer is not None:
            self.first_layer.start(stream, cached, policy)
        self.queued_first = {}

    def price_misses(self, timing) -> None:
        """Cost-aware eviction (with a policy that scores keys): a miss at a token's first MoE
        layer costs m, the cheaper of its copy and its host time (no speculation reaches it); at
        a later layer the speculation from the layer before names the key with probability
        recall(1), and a right guess, copied from the block's output on, leaves unhidden only the
        copy's part beyond the window to the next router (`timing.layer_s`), if it is copied at
        all (`latest_arrival`'s rule for a lone copy). The policy evicts by its expected steps to
        the next use divided by that expected cost (float [N]), so it keeps what speculation
        cannot bring back in time."""
        if not hasattr(self.policy, "weigh_misses"):
            return
        st = self.stream
        keys = np.arange(st.num_keys)
        copy = np.array([timing.copy_s(int(k)) for k in keys])
        m = np.minimum(copy, [timing.host_s(int(k), 1) for k in keys]) if timing.host_compute else copy
        r1 = self.recall.get(1, 1.0)
        late = np.maximum(copy - timing.layer_s, 0.0)  # a right guess's copy past the next router
        issued = late < r1 * m
        hidden = np.where(issued, (1.0 - r1) * m + r1 * np.minimum(m, late), m)
        cost = np.where(keys // st.num_experts == 0, m, hidden)
        self.policy.weigh_misses(np.maximum(cost, 1e-3 * m))

    def after_step(self, s: int) -> list:
        self.distance = {}
        for d in range(1, self.depth + 1):
            for k in self.stream.speculated(s, d):
                self.distance.setdefault(int(k), d)
        self.predicted = set(self.distance)
        self.queued_first = {}
        if self.first_layer is not None and int(self.stream.step_layer[s]) == self.stream.num_layers - 1:
            self.queued_first = dict.fromkeys(self.first_layer.after_step(s))
        return [k for k in self.distance if not self.cached[k] and self.may_copy[k]] + list(self.queued_first)

    def latest_arrival(self, key: int, next_router: float, step_s: float, timing) -> float:
        """The latest arrival at which copying `key` still pays (the bandwidth limit): its layer
        starts at R (the next router, plus a layer of `step_s` per distance beyond 1); a miss there
        costs m = the cheaper of a copy and the host's time; a copy arriving at A saves m if the
        guess is right and delays the link by A - R if it is wrong, so it pays while
        A - R < recall x m (recall of the key's distance on the planning trace; 1 when unknown)."""
        if key in self.queued_first:
            return next_router  # idle link time only, as NextUsePrefetch
        d = self.distance[key]
        miss = timing.copy_s(key)
        if timing.host_compute:
            miss = min(miss, timing.host_s(key, 1))
        return next_router + (d - 1) * step_s + self.recall.get(d, 1.0) * miss

    def victim_for(self, key: int, exclude):
        if key in self.queued_first:
            return self.first_layer.victim_for(key, exclude)
        keep = set(exclude) | self.predicted
        v = int(self.policy.victim(-1, keep))
        return None if v in keep else v


PREFETCHERS = ("none", "moe-infinity", "moeplan", "speculative")


def make_prefetcher(name: str, eamc=None, allowed=None, depth: int = 1, speculation=None):
    """A fresh prefetcher by name (None for "none"); "moe-infinity" needs the EAMC [P, L, E];
    "speculative" looks `depth` MoE layers ahead, with the trace's `speculation` settings
    ({"after_experts", "recall"}; default: from the block output, every guess trusted)."""
    if name == "none":
        return None
    if name == "moe-infinity":
        if eamc is None:
            raise ValueError("the moe-infinity prefetcher needs the EAMC")
        return EAMCPrefetch(eamc, allowed)
    if name == "moeplan":
        return NextUsePrefetch(allowed)
    if name == "speculative":
        speculation = speculation or {}
        return SpeculativePrefetch(allowed, depth, speculation.get("after_experts", True), speculation.get("recall"))
    raise ValueError(f"unknown prefetcher '{name}'; use one of {', '.join(PREFETCHERS)}")
