"""The staged ILP's value model, the even split: a token of an expert with r copies sits on each copy
with share 1 / r (the split the load metric uses), so with share[l, a, p] = hosts[l, a, p] / r[l, a]
    local = sum_l sum_{a, b, p} c[l, a, b] * share[l, a, p] * present[l+1, b, p]
(c: `affinity.transition_counts`, mode "current"). Counted at GPU level, and at node level with
partitions = nodes; the searches weigh both levels equally, as ExFlow's two stages do.
`layer_gain_tables` give one layer's terms with its neighbours fixed (linear in the layer), which
every local search of the staged ILP prices its moves with. The metric itself routes tokens
otherwise (`metrics.py`); `local_search/routed.py` values steps by that routing instead.
"""
from __future__ import annotations

import numpy as np


def even_split_value(counts, share, present) -> float:
    """Local transitions under the even-split model, summed over layer pairs: counts float [L-1, E, E],
    share float [L, E, P], present float [L, E, P] (hosts / copies and hosts, at GPU or node level)."""
    return float(sum(((counts[l] @ present[l + 1]) * share[l]).sum() for l in range(len(counts))))


def placement_value(counts, hosts) -> float:
    """`even_split_value` of bool [L, E, D] hosts at GPU level."""
    return even_split_value(counts, hosts / hosts.sum(axis=2, keepdims=True), hosts.astype(float))


def layer_gain_tables(hosts, counts, l, G):
    """Per-expert gain tables of layer l with its neighbours fixed: (inG, outG, inN, outN)."""
    L, E, D = hosts.shape
    N = D // G
    zg, zn = np.zeros((E, D)), np.zeros((E, N))
    in_g, out_g, in_n, out_n = zg, zg, zn, zn
    if l > 0:
        prev = hosts[l - 1].astype(float)
        r = prev.sum(axis=1, keepdims=True)
        in_g = counts[l - 1].T @ (prev / r)
        in_n = counts[l - 1].T @ (prev.reshape(E, N, G).sum(axis=2) / r)
    if l < L - 1:
        nxt = hosts[l + 1]
        out_g = counts[l] @ nxt.astype(float)
        out_n = counts[l] @ nxt.reshape(E, N, G).any(axis=2).astype(float)
    return in_g, out_g, in_n, out_n


def layer_gain_table(hosts, counts, l, G) -> np.ndarray:
    """float [E, D]: the value of each expert of layer l on each GPU with its neighbours fixed, GPU and
    node terms equally weighted, the out-terms charged per copy (exact for an expert with one copy)."""
    in_g, out_g, in_n, out_n = layer_gain_tables(hosts, counts, l, G)
    node_of = np.arange(hosts.shape[2]) // G
    r = hosts[l].sum(axis=1)
    return in_g + out_g / r[:, None] + in_n[:, node_of] + out_n[:, node_of] / r[:, None]
