"""Prefetchers for the timed simulation: MoE-Infinity's EAMC-guided one and the planner's.

Interface (see offload_stepper.TimedCache): `start(stream, cached, policy)`, `after_step(s)` -> keys
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
"""
from __future__ import annotations

import numpy as np

from .offload_eam_match import nearest_entry, row_normalised
from .offload_policies import EPS


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


PREFETCHERS = ("none", "moe-infinity", "moeplan")


def make_prefetcher(name: str, eamc=None, allowed=None):
    """A fresh prefetcher by name (None for "none"); "moe-infinity" needs the EAMC [P, L, E]."""
    if name == "none":
        return None
    if name == "moe-infinity":
        if eamc is None:
            raise ValueError("the moe-infinity prefetcher needs the EAMC")
        return EAMCPrefetch(eamc, allowed)
    if name == "moeplan":
        return NextUsePrefetch(allowed)
    raise ValueError(f"unknown prefetcher '{name}'; use one of {', '.join(PREFETCHERS)}")
