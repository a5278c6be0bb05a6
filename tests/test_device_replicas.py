"""The replica rule on the device (runtime/ep/device_replicas.py) equals the host's (runtime/ep/expert_table.py) as
each source rank applies it to its own tokens: any copies of any experts, any nodes, rows of several sources
interleaved, padding rows."""
from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moeplan.runtime.ep.device_replicas import DeviceReplicaRule
from moeplan.runtime.ep.expert_table import ExpertTable


@st.composite
def cases(draw):
    nodes, gpus = draw(st.sampled_from([(1, 2), (1, 4), (2, 2), (2, 3)]))
    world, layers, experts = nodes * gpus, 2, draw(st.integers(2, 9))
    hosts = np.array(draw(st.lists(st.booleans(), min_size=layers * experts * world,
                                   max_size=layers * experts * world))).reshape(layers, experts, world)
    first = draw(st.lists(st.integers(0, world - 1), min_size=layers * experts, max_size=layers * experts))
    hosts[np.arange(layers).repeat(experts), np.tile(np.arange(experts), layers), first] = True  # a copy each
    k = draw(st.integers(1, min(4, experts)))
    rows = draw(st.integers(1, 24))
    ids = np.array([draw(st.permutations(range(experts)))[:k] for _ in range(rows)]).reshape(rows, k)
    padding = np.array(draw(st.lists(st.booleans(), min_size=rows, max_size=rows)))
    ids[padding] = -1
    source = np.array(draw(st.lists(st.integers(0, world - 1), min_size=rows, max_size=rows)))
    return ExpertTable(hosts, gpus), ids, source


@settings(max_examples=150, deadline=None)
@given(case=cases(), moe=st.integers(0, 1))
def test_the_device_rule_gives_each_source_ranks_tokens_the_copies_the_host_rule_gives(case, moe):
    table, ids, source = case
    got = DeviceReplicaRule(table, torch.device("cpu")).choose(moe, torch.from_numpy(ids), torch.from_numpy(source))
    got = got.numpy()
    assert (got[ids < 0] == -1).all()
    for s in range(table.world_size):
        rows = np.flatnonzero((source == s) & (ids[:, 0] >= 0))
        if rows.size:
            expected = table.choose(moe, ids[rows], np.full(rows.size, s))
            np.testing.assert_array_equal(got[rows], expected)
            assert table.hosts[moe][ids[rows], got[rows]].all()  # every slot goes to a rank holding its expert
