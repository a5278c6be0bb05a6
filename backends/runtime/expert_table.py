"""Which ranks host which experts (placement.json), and which replica a dispatched token uses.

Ranks are devices in placement order: device d of the placement is rank d, on node
d // gpus_per_node. The primary (highest-weight) slot of a token follows exactly the rule of the
planner's placement metric, so the measured share of local slots equals the planner's prediction:
the replica on the token's current rank if any, else the first listed on its node, else the first
listed (at MoE layer 0, where the metric knows no previous device, the first listed). Other
slots prefer the current rank, then the node, then rotate over the remaining
replicas so that replicated hot experts share their load.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ExpertTable:
    """hosts[l][e]: ranks holding expert e of MoE layer l, in placement (device) order."""

    hosts: tuple
    gpus_per_node: int
    world_size: int

    @classmethod
    def from_placement(cls, placement: dict) -> "ExpertTable":
        topology = placement["topology"]
        world = int(topology["nodes"]) * int(topology["gpus_per_node"])
        hosts = []
        for layer in placement["layers"]:
            devices = layer["devices"]
            if len(devices) != world:
                raise ValueError(f"placement layer {layer['layer']} lists {len(devices)} devices, topology has {world}")
            per_expert: dict = {}
            for rank, experts in enumerate(devices):
                for e in experts:
                    ranks = per_expert.setdefault(int(e), [])
                    if rank not in ranks:
                        ranks.append(rank)
            num_experts = max(per_expert) + 1 if per_expert else 0
            missing = [e for e in range(num_experts) if e not in per_expert]
            if missing:
                raise ValueError(f"placement layer {layer['layer']} hosts no replica of experts {missing}")
            hosts.append(tuple(tuple(per_expert[e]) for e in range(num_experts)))
        return cls(hosts=tuple(hosts), gpus_per_node=int(topology["gpus_per_node"]), world_size=world)

    def experts_on(self, rank: int) -> list:
        """(layer, expert) pairs whose weights rank must hold."""
        return [(l, e) for l, layer in enumerate(self.hosts) for e, ranks in enumerate(layer) if rank in ranks]

    def node_of(self, rank: int) -> int:
        return rank // self.gpus_per_node

    def primary_rank(self, layer: int, expert: int, current: int) -> int:
        """The metric's rule: current rank, else first replica on its node, else first listed."""
        ranks = self.hosts[layer][expert]
        if current in ranks:
            return current
        for r in ranks:
            if self.node_of(r) == self.node_of(current):
                return r
        return ranks[0]

    def secondary_rank(self, layer: int, expert: int, current: int, turn: int) -> int:
        """Current rank, else a replica on its node, else rotate over replicas by `turn`."""
        ranks = self.hosts[layer][expert]
        if current in ranks:
            return current
        same_node = [r for r in ranks if self.node_of(r) == self.node_of(current)]
        pool = same_node or list(ranks)
        return pool[turn % len(pool)]

    def sole_hosts(self, layer: int) -> torch.Tensor:
        """int64 [E]: the one rank holding each expert of `layer`, -1 where it is replicated."""
        cache = self.__dict__.setdefault("_sole", {})
        if layer not in cache:
            cache[layer] = torch.tensor([r[0] if len(r) == 1 else -1 for r in self.hosts[layer]], dtype=torch.int64)
        return cache[layer]

    def choose(self, layer: int, experts: torch.Tensor, current: torch.Tensor) -> torch.Tensor:
        """Destination rank of every slot: int64 [n, k] for expert ids [n, k] of tokens on `current` [n].
        An expert with one host goes there whatever the rule (a table lookup); only slots of
        replicated experts walk the rule, in slot order (their rotation counts turns per expert)."""
        out = self.sole_hosts(layer)[experts]
        replicated = (out < 0).nonzero().tolist()
        if not replicated:
            return out
        turns: dict = {}
        ids = experts.tolist()
        cur = current.tolist()
        for i, s in replicated:  # row-major, as the rotation has always counted
            e = ids[i][s]
            if s == 0:
                # the metric has no current device before MoE layer 0: first listed replica
                out[i, s] = self.primary_rank(layer, e, cur[i] if layer > 0 else -1)
            else:
                turn = turns.get(e, 0)
                turns[e] = turn + 1
                out[i, s] = self.secondary_rank(layer, e, cur[i], turn)
        return out
