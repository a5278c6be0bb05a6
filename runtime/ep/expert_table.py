"""Where every expert's copies are, and which copy each routed slot of a token uses: moeplan's one
replica rule, for the runtime that runs it and for the planner that predicts it.

Ranks are devices in placement order: device d of the placement is rank d, on node
d // gpus_per_node. A token's slots come heaviest first (`heaviest_first`; the trace format
stores them so, and the runtime reorders what the library's router returns, which need not be
sorted: DeepSeek-V2/V3's `torch.topk(..., sorted=False)`):

* primary (slot 0, the token's heaviest expert): the copy on the token's current rank if any, else
  the first copy on its node, else the first listed (lowest rank). With no current rank (before
  the first MoE layer, and at MoE layer 0 always) the first listed. The primary is where the token
  is current after the layer: the placement metric follows tokens by this rule
  (`passes/optimize/placement/metrics.py`), so measured and predicted locality agree;
* other slots: the copy on the current rank if any, else rotate over the copies on its node (over
  all copies if the node has none), in the order the tokens' slots come; only slots that leave the
  rank take a turn, so replicated hot experts share the traffic that crosses ranks.

One implementation, vectorised over tokens (numpy): the runtime (`engine.py`) calls it on each
rank's tokens per MoE layer, the cost model (`passes/cost/cost_model.py`) replays runs with it
and the placement metric follows 100k-token traces with `primary` inside the placement search.
The tables are shaped after SGLang's `ExpertLocationMetadata` (python/sglang/srt/eplb/
expert_location.py, sglang 0.5.23: a logical expert's physical copies, `logical_to_all_physical_map`)
with a static, rank-aware dispatch in the role of its `expert_location_dispatch.py`.
"""
from __future__ import annotations

import numpy as np


def heaviest_order(weights: np.ndarray) -> np.ndarray:
    """int [..., K]: the order that puts each row's slots heaviest first (ties keep the router's
    order), for gate weights [..., K]."""
    return np.argsort(-np.asarray(weights, dtype=np.float64), axis=-1, kind="stable")


def heaviest_first(ids: np.ndarray, weights: np.ndarray) -> tuple:
    """(ids, weights) [..., K] with each row's slots reordered heaviest first (`heaviest_order`)."""
    order = heaviest_order(weights)
    return np.take_along_axis(np.asarray(ids), order, -1), np.take_along_axis(np.asarray(weights), order, -1)


class ExpertTable:
    """The copies of every expert (bool hosts [L, E, W]) and the replica rule over them."""

    def __init__(self, hosts: np.ndarray, gpus_per_node: int):
        hosts = np.asarray(hosts, dtype=bool)
        L, E, W = hosts.shape
        G = int(gpus_per_node)
        if G < 1 or W % G:
            raise ValueError(f"{W} ranks do not fill nodes of {G} GPUs")
        N = W // G
        self.hosts, self.gpus_per_node, self.world_size = hosts, G, W
        self.node_of = np.arange(W) // G
        by_node = hosts.reshape(L, E, N, G)
        self.node_hosts = by_node.any(axis=3)  # bool [L, E, N]
        self.first_copy = np.argmax(hosts, axis=2)  # int [L, E]
        # int [L, E, N]: the first copy on each node, -1 where the node has none
        self.first_on_node = np.where(self.node_hosts, np.argmax(by_node, axis=3) + np.arange(N) * G, -1)
        self._copies = None

    @classmethod
    def from_placement(cls, placement: dict) -> ExpertTable:
        """From placement.json's dict (a device's list may repeat an expert another device holds)."""
        topology = placement["topology"]
        G = int(topology["gpus_per_node"])
        world = int(topology["nodes"]) * G
        layers = sorted(placement["layers"], key=lambda entry: entry["layer"])
        ids = [int(e) for layer in layers for experts in layer["devices"] for e in experts]
        num_experts = int(placement.get("num_experts", max(ids, default=-1) + 1))
        hosts = np.zeros((len(layers), num_experts, world), dtype=bool)
        for l, layer in enumerate(layers):
            devices = layer["devices"]
            if len(devices) != world:
                raise ValueError(f"placement layer {layer['layer']} lists {len(devices)} devices, topology has {world}")
            for rank, experts in enumerate(devices):
                hosts[l, [int(e) for e in experts], rank] = True
            missing = np.flatnonzero(~hosts[l].any(axis=1)).tolist()
            if missing:
                raise ValueError(f"placement layer {layer['layer']} hosts no replica of experts {missing}")
        return cls(hosts, G)

    def experts_on(self, rank: int) -> list:
        """(layer, expert) pairs whose weights rank must hold, layer by layer."""
        return [(int(l), int(e)) for l, e in np.argwhere(self.hosts[:, :, rank])]

    def node_of_rank(self, rank: int) -> int:
        return rank // self.gpus_per_node

    def primary(self, layer: int, experts: np.ndarray, current: np.ndarray) -> np.ndarray:
        """int [n]: where each token is current after MoE layer `layer`, from its heaviest expert
        there (int [n], -1: none, the token stays) and its current rank before it (int [n], -1: none)."""
        experts = np.asarray(experts, dtype=np.int64)
        current = np.asarray(current, dtype=np.int64)
        has = experts >= 0
        e = np.where(has, experts, 0)
        known = current >= 0
        c = np.where(known, current, 0)
        stay = known & self.hosts[layer][e, c]
        same_node = np.where(known, self.first_on_node[layer][e, self.node_of[c]], -1)
        moved = np.where(stay, c, np.where(same_node >= 0, same_node, self.first_copy[layer][e]))
        return np.where(has, moved, current)

    def choose(self, layer: int, experts: np.ndarray, current: np.ndarray) -> np.ndarray:
        """int64 [n, k]: the rank each slot goes to, for expert ids [n, k] (heaviest first) of tokens
        current on ranks [n], in the order the caller holds them (the rotation follows that order)."""
        return self._choose(layer, experts, current, per_rank=False)

    def choose_per_rank(self, layer: int, experts: np.ndarray, current: np.ndarray) -> np.ndarray:
        """`choose` as every rank calls it on its own tokens (those current on it, in the order given),
        all ranks in one call: the rotation over copies restarts on each rank. The cost model replays
        a step's ranks with it."""
        return self._choose(layer, experts, current, per_rank=True)

    def _choose(self, layer: int, experts: np.ndarray, current: np.ndarray, per_rank: bool) -> np.ndarray:
        experts = np.asarray(experts, dtype=np.int64)
        current = np.asarray(current, dtype=np.int64)
        n, k = experts.shape
        out = np.empty((n, k), dtype=np.int64)
        if n == 0 or k == 0:
            return out
        out[:, 0] = self.primary(layer, experts[:, 0], current if layer > 0 else np.full(n, -1))
        if k == 1:
            return out
        copies, count, node_copies, node_count = self.copy_tables()
        e = experts[:, 1:].ravel()  # token by token, slot by slot: the order turns are taken in
        cur = np.repeat(current, k - 1)
        local = self.hosts[layer][e, cur]
        node = self.node_of[cur]
        on_node = node_count[layer][e, node]
        pool = np.where(on_node > 0, on_node, count[layer][e])
        index = _turns(e + cur * self.hosts.shape[1] if per_rank else e, ~local) % pool
        pick = np.where(on_node > 0, node_copies[layer][e, node, np.minimum(index, node_copies.shape[3] - 1)],
                        copies[layer][e, index])
        out[:, 1:] = np.where(local, cur, pick).reshape(n, k - 1)
        return out

    def copy_tables(self) -> tuple:
        """(copies int [L, E, R] ranks in order, -1 padded; their count int [L, E]; the same per node:
        int [L, E, N, G] and int [L, E, N]). Built once, on the first `choose`."""
        if self._copies is None:
            L, E, W = self.hosts.shape
            G = self.gpus_per_node
            count = self.hosts.sum(axis=2)
            copies = np.argsort(~self.hosts, axis=2, kind="stable")[:, :, :max(int(count.max(initial=1)), 1)]
            by_node = self.hosts.reshape(L, E, W // G, G)
            node_count = by_node.sum(axis=3)
            node_copies = np.argsort(~by_node, axis=3, kind="stable") + (np.arange(W // G) * G)[:, None]
            self._copies = (copies, count, node_copies, node_count)
        return self._copies


def _turns(experts: np.ndarray, taking: np.ndarray) -> np.ndarray:
    """int [m]: for each entry that takes a turn (bool [m]), how many earlier entries of the same
    expert took one (0 where it takes none)."""
    turns = np.zeros(len(experts), dtype=np.int64)
    idx = np.flatnonzero(taking)
    if len(idx) == 0:
        return turns
    order = np.argsort(experts[idx], kind="stable")
    grouped = experts[idx][order]
    starts = np.flatnonzero(np.r_[True, grouped[1:] != grouped[:-1]])
    sizes = np.diff(np.r_[starts, len(grouped)])
    turns[idx[order]] = np.arange(len(grouped)) - np.repeat(starts, sizes)
    return turns
