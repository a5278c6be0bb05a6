"""The replica rule of `expert_table.py` on the device, for a gathered decode step's rows: which copy of its
expert each routed slot uses, with fixed shapes and no host sync, so that a compiled step can hold it.

Why: the rule (`ExpertTable.choose`) runs in numpy on the host, where each rank applies it to its own tokens.
A gathered step (`gathered_moe.py`) sends every rank every rank's rows; each receiver must find the slots the
rule gives it, for rows of every source rank at once, inside the graph. The rule is the same, written with
tensor lookups: slot 0 takes its primary (the copy on the source rank, else the first on its node, else the first
listed; at MoE layer 0 always the first listed); every other slot the copy on the source rank if any, else turns
over the copies on its node (over all copies if the node has none), counted per source rank and expert in the
order the source holds its slots (a stable sort of (source, expert) keys gives each slot its turn).
Shapes: M rows, k slots, E experts, W ranks, N nodes of G GPUs, R the most copies of an expert.
"""
from __future__ import annotations

import numpy as np
import torch


class DeviceReplicaRule:
    """`ExpertTable`'s rule over device tensors (module docstring)."""

    def __init__(self, table, device):
        hosts = np.asarray(table.hosts, dtype=bool)
        copies, count, node_copies, node_count = table.copy_tables()
        as_tensor = lambda a: torch.as_tensor(np.ascontiguousarray(a), device=device)
        self.E, self.G = hosts.shape[1], table.gpus_per_node
        self.hosts = as_tensor(hosts)                              # bool [L, E, W]
        self.first_copy = as_tensor(table.first_copy)              # int [L, E]
        self.first_on_node = as_tensor(table.first_on_node)        # int [L, E, N]
        self.copies, self.count = as_tensor(copies), as_tensor(count)                  # [L, E, R], [L, E]
        self.node_copies, self.node_count = as_tensor(node_copies), as_tensor(node_count)  # [L, E, N, G], [L, E, N]

    def choose(self, moe: int, experts: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        """int64 [M, k]: the rank of each slot of expert ids [M, k] (heaviest first; -1: no slot) of rows held by
        source ranks [M], the rows of each source in the order it holds them; -1 where there is no slot."""
        M, k = experts.shape
        valid = experts >= 0
        e = experts.clamp(min=0)
        src = source[:, None].expand(M, k)
        node = src // self.G
        hosts = self.hosts[moe]
        local = hosts[e, src] & valid                                                   # [M, k]
        first_on_node = self.first_on_node[moe][e, node]
        primary = torch.where(first_on_node >= 0, first_on_node, self.first_copy[moe][e])
        if moe > 0:
            primary = torch.where(local, src, primary)
        else:  # no current rank before the first MoE layer: the first listed copy
            primary = self.first_copy[moe][e]
        taking = ~local & valid
        taking[:, 0] = False                                   # slot 0 takes its primary, no turn
        turns = _turns(src * self.E + e, taking)
        on_node = self.node_count[moe][e, node]
        pool = torch.where(on_node > 0, on_node, self.count[moe][e])
        index = turns % pool
        node_pick = self.node_copies[moe][e, node, index.clamp(max=self.node_copies.shape[-1] - 1)]
        any_pick = self.copies[moe][e, index.clamp(max=self.copies.shape[-1] - 1)]
        other = torch.where(local, src, torch.where(on_node > 0, node_pick, any_pick))
        ranks = torch.cat([primary[:, :1], other[:, 1:]], dim=1)
        return torch.where(valid, ranks, -1)


def _turns(keys: torch.Tensor, taking: torch.Tensor) -> torch.Tensor:
    """int64 [M, k]: for each slot that takes a turn (bool [M, k]), how many slots before it (row by row, slot by
    slot) with the same key took one; 0 where it takes none."""
    flat = torch.where(taking, keys, torch.iinfo(torch.int64).max).reshape(-1)
    ordered, order = torch.sort(flat, stable=True)
    first = torch.searchsorted(ordered, ordered)            # each key's first position among the sorted
    turns = torch.empty_like(order).index_copy_(0, order, torch.arange(flat.numel(), device=flat.device) - first)
    return torch.where(taking, turns.reshape(keys.shape), 0)
