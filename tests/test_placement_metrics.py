"""The placement metrics on hand-made cases, every figure computed by hand."""
import numpy as np
import pytest

from moeplan.passes.analysis.trace.format import make_trace
from moeplan.passes.optimize.placement.metrics import score_placement
from moeplan.passes.optimize.placement.schema import Placement, Topology


def hosts_of(layers, experts, devices):
    h = np.zeros((len(layers), experts, devices), dtype=bool)
    for l, devs in enumerate(layers):
        for d, es in enumerate(devs):
            h[l, es, d] = True
    return h


def test_two_nodes_no_replicas():
    # tokens: [0, 0], [0, 1], [1, 1]; expert e on device e at both layers; one GPU per node
    trace = make_trace(np.array([[[0], [0]], [[0], [1]], [[1], [1]]]), num_experts=2)
    s = score_placement(trace, hosts_of([[[0], [1]], [[0], [1]]], 2, 2), Topology(2, 1))
    assert s.transitions == 3 and s.cross_gpu_transitions == 1
    assert s.gpu_local_fraction == pytest.approx(2 / 3)
    assert s.node_local_fraction == pytest.approx(2 / 3)
    assert s.max_over_mean_load == pytest.approx(4 / 3)  # loads (2, 1) then (1, 2): max/mean 2/1.5


def test_replica_on_the_current_device_is_used_and_load_splits():
    # one node, two GPUs; expert 0 replicated on both GPUs at layer 1
    layers = [[[0], [1]], [[0], [0, 1]], [[1], [0]]]
    trace = make_trace(np.array([[[1], [0], [0]],    # dev1 -> replica on dev1 (local) -> dev1 hosts 0 (local)
                                 [[0], [0], [0]]]),  # dev0 -> replica on dev0 (local) -> 0 only on dev1 (remote)
                       num_experts=2)
    s = score_placement(trace, hosts_of(layers, 2, 2), Topology(1, 2))
    assert s.gpu_local_fraction == pytest.approx(3 / 4)
    assert s.node_local_fraction == pytest.approx(1.0)
    # layer loads: (1, 1) -> 1; expert 0's 2 tokens split (1, 1) -> 1; (0, 2) -> 2
    assert s.max_over_mean_load == pytest.approx(4 / 3)


def test_replica_choice_prefers_same_node_then_first_listed():
    # 2 nodes x 2 GPUs (devices 0,1 | 2,3); K = 1; E = 4
    layers = [
        [[0], [1], [2], [3]],
        [[1], [2], [0, 3], [0]],   # expert 0 on devices 2 and 3 (node 1 only)
        [[0], [1], [2], [3]],
    ]
    # token A starts on dev1 (node 0), goes to expert 0 (no replica on node 0): first listed = dev2;
    #   then expert 2 at layer 2 lives on dev2: local.
    # token B starts on dev3 (node 1), goes to expert 0: replica on dev3 itself: stays on dev3;
    #   then expert 2 on dev2: remote GPU, same node.
    trace = make_trace(np.array([[[1], [0], [2]], [[3], [0], [2]]]), num_experts=4)
    s = score_placement(trace, hosts_of(layers, 4, 4), Topology(2, 2))
    # transitions: A l1 remote-node, A l2 local; B l1 local, B l2 same node only
    assert s.transitions == 4
    assert s.gpu_local_fraction == pytest.approx(2 / 4)
    assert s.node_local_fraction == pytest.approx(3 / 4)


def test_same_node_replica_is_taken_over_first_listed():
    # expert 0 at layer 1 on dev0 (node 0) and dev2 (node 1). A token on dev3 moves to dev2 (same
    # node), so expert 1 at layer 2, hosted on dev2 only, is local.
    layers = [[[0], [1], [2], [3]], [[0], [1], [0, 2], [3]], [[0], [2], [1], [3]]]
    trace = make_trace(np.array([[[3], [0], [1]]]), num_experts=4)
    s = score_placement(trace, hosts_of(layers, 4, 4), Topology(2, 2))
    assert s.transitions == 2 and s.gpu_local_fraction == pytest.approx(0.5)  # l1: dev3 lacks 0; l2: local


def test_missing_choices_keep_the_current_device_and_are_not_counted():
    layers = [[[0], [1]], [[0], [1]], [[0], [1]]]
    # token: expert 1 (dev1), none, expert 1 again: counts one transition at layer 2, local
    trace = make_trace(np.array([[[1], [-1], [1]]]), num_experts=2)
    s = score_placement(trace, hosts_of(layers, 2, 2), Topology(1, 2))
    assert s.transitions == 1 and s.gpu_local_fraction == 1.0


def test_topk_counts_every_choice_from_the_heaviest_experts_device():
    # K = 2: heaviest expert at layer 0 is the second choice (weight 0.7) on dev1
    trace = make_trace(np.array([[[0, 1], [1, 0]]]), np.array([[[0.3, 0.7], [0.5, 0.5]]], dtype=np.float32), num_experts=2)
    s = score_placement(trace, hosts_of([[[0], [1]], [[0], [1]]], 2, 2), Topology(1, 2))
    assert s.transitions == 2 and s.gpu_local_fraction == pytest.approx(0.5)


def test_placement_json_round_trip_keeps_hosts():
    from moeplan.passes.optimize.placement.schema import placement_from_dict
    import json
    hosts = hosts_of([[[0, 1], [1, 2]], [[2], [0, 1]]], 3, 2)
    p = Placement.from_hosts("eplb", Topology(1, 2), hosts, {"gpu_local_fraction": 0.5})
    q = placement_from_dict(json.loads(p.to_json()))
    assert np.array_equal(q.hosts(), hosts) and q.metrics["gpu_local_fraction"] == 0.5


def test_the_placement_contract_and_the_runtime_read_the_same_dispatch_rule():
    """`Placement.expert_table()` (the planner's) and the runtime's table built from placement.json agree copy for copy."""
    import json

    from moeplan.runtime.ep.expert_table import ExpertTable

    hosts = np.zeros((2, 4, 4), dtype=bool)
    hosts[:, np.arange(4), np.arange(4)] = True
    hosts[0, 0, 3] = hosts[1, 2, 0] = True  # a replica on the other node
    placement = Placement.from_hosts("ilp", Topology(2, 2), hosts)
    runtime = ExpertTable.from_placement(json.loads(placement.to_json()))
    planner = placement.expert_table()
    assert np.array_equal(runtime.hosts, planner.hosts)
    ids, current = np.array([[2, 0], [2, 0], [0, 1]]), np.array([3, 1, 0])
    for layer in (0, 1):
        assert planner.choose(layer, ids, current).tolist() == runtime.choose(layer, ids, current).tolist()
    assert planner.choose(1, ids, current)[:, 0].tolist() == [2, 0, 0]  # 2's copy on node 1, on node 0; local
