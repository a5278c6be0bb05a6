"""Validation with SGLang's own code (the `sglang` wheel, installed without its dependencies by
`make venv`): its EPLB algorithm and its expert-location construction run on CPU.

* `srt/eplb/eplb_algorithms/deepseek.py` is pure torch and is loaded by path: our `eplb` policy
  must reach the balance it reaches on the same loads.
* `srt/eplb/expert_location.py` imports only `sglang.srt.runtime_context` from SGLang at module
  level (the server's argument accessors, which pull the whole server in); the test registers a
  module under that name whose accessors return this deployment's settings (EP size, nodes,
  a2a backend, dispatch algorithm), then loads the file by path and builds SGLang's
  `ExpertLocationMetadata` from our `init_expert_location.json` exactly as `init_by_mapping` does.
"""
import importlib.util
import json
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from moeplan.core.expert_slots import placement_slots
from moeplan.passes.analysis.trace.format import save_trace
from moeplan.passes.analysis.trace.synth_planted import synthesize_trace
from moeplan.passes.optimize.placement.schema import Topology
from moeplan.passes.optimize.placement.policies import PlacementRequest, plan_placement
from moeplan.planner.cli import main

SGLANG_VERSION = "0.5.23"
spec = importlib.util.find_spec("sglang")
if spec is None or not spec.submodule_search_locations:
    pytest.skip(f"sglang=={SGLANG_VERSION} is not installed (make venv installs it with --no-deps; its wheel is "
                f"cp311/manylinux only): SGLang's own code cannot be run here", allow_module_level=True)
SGLANG = Path(spec.submodule_search_locations[0])
DEEPSEEK = Path(__file__).resolve().parents[1] / "examples" / "configs" / "deepseek-v3.json"
E, GROUPS = 256, 8


def load_by_path(relative: str, name: str):
    module_spec = importlib.util.spec_from_file_location(name, SGLANG / relative)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module  # dataclasses look their module up while the class is built
    module_spec.loader.exec_module(module)
    return module


def slot_balance(p2l: np.ndarray, loads: np.ndarray, gpus: int) -> np.ndarray:
    """float [L]: max/mean GPU load of slot maps [L, slots], slot s on GPU s // (slots / gpus),
    each expert's load split evenly over its slots."""
    out = []
    for row, load in zip(p2l, loads):
        copies = np.bincount(row, minlength=len(load))
        gpu_load = (load[row] / copies[row]).reshape(gpus, -1).sum(axis=1)
        out.append(gpu_load.max() / gpu_load.mean())
    return np.array(out)


@pytest.fixture(scope="module")
def trace():
    return synthesize_trace(layers=58, experts=E, top_k=8, tokens=3000, affinity=0.6, zipf=0.9, seed=5)


@pytest.mark.parametrize("nodes, gpus_per_node, redundant", [(4, 8, 32), (2, 8, 16), (1, 8, 0), (4, 8, 0)])
def test_our_eplb_matches_sglang_eplb_balance(trace, nodes, gpus_per_node, redundant):
    deepseek = load_by_path("srt/eplb/eplb_algorithms/deepseek.py", "sglang_eplb_deepseek")
    loads = trace.expert_loads().astype(np.float64)
    gpus = nodes * gpus_per_node
    # SGLang's compute_algorithm("auto"): hierarchical when the groups divide over the nodes.
    phy2log, _, _ = deepseek.rebalance_experts(torch.tensor(loads), E + redundant, GROUPS, nodes, gpus,
                                               GROUPS % nodes == 0)
    theirs = slot_balance(phy2log.numpy(), loads, gpus)
    placement = plan_placement(trace, PlacementRequest(topology=Topology(nodes, gpus_per_node), policy="eplb",
                                                       redundant=redundant, expert_groups=GROUPS))
    ours = slot_balance(np.array(placement_slots(json.loads(placement.to_json()), E, redundant)), loads, gpus)
    assert ours.mean() == pytest.approx(placement.metrics["max_over_mean_load"], rel=1e-6)
    assert ours.mean() <= theirs.mean() * 1.005  # the same balance on average ...
    assert np.all(ours <= theirs + 0.02)  # ... and on every layer


@pytest.fixture(scope="module")
def sglang_expert_location():
    settings = types.SimpleNamespace(moe=types.SimpleNamespace(moe_a2a_backend="deepep", ep_join_mode="none",
                                                               ep_dispatch_algorithm="static"))
    deployment = {"ep_size": 32, "nnodes": 4}
    context = types.ModuleType("sglang.srt.runtime_context")
    context.get_exec = lambda: settings
    context.get_parallel = lambda: types.SimpleNamespace(**deployment)
    context.get_device = lambda: types.SimpleNamespace(device="cpu")
    context.get_resources = lambda: None
    saved = sys.modules.get(context.__name__)
    sys.modules[context.__name__] = context
    try:
        module = load_by_path("srt/eplb/expert_location.py", "sglang_expert_location")
    finally:
        if saved is None:
            sys.modules.pop(context.__name__)
        else:
            sys.modules[context.__name__] = saved
    module.get_exec, module.get_parallel = context.get_exec, context.get_parallel
    # Its default with elastic EP off: prefer a replica on the same node (reads the elastic-EP module).
    module._prefer_same_node_experts = lambda: True
    return module


def build_metadata(module, p2l: torch.Tensor, rank: int):
    """What ExpertLocationMetadata.init_by_mapping does once the model config is known."""
    assert p2l.shape[-1] % 32 == 0  # _init_common: num_physical_experts % ep_size == 0
    l2all = module._compute_logical_to_all_physical_map(physical_to_logical_map=p2l, num_logical_experts=E,
                                                         ep_size=32, moe_ep_rank=rank)
    return module.ExpertLocationMetadata._init_raw(ep_size=32, physical_to_logical_map=p2l,
                                                   logical_to_all_physical_map=l2all, moe_ep_rank=rank)


def test_sglang_builds_its_expert_location_from_our_export(sglang_expert_location, trace, tmp_path):
    save_trace(trace, tmp_path / "t.npz")
    out = tmp_path / "sg"
    result = CliRunner().invoke(main, ["compile", str(DEEPSEEK), "--trace", str(tmp_path / "t.npz"), "--target", "sglang",
                                       "--nodes", "4", "--gpus-per-node", "8", "--redundant", "32", "--out", str(out)])
    assert result.exit_code == 0, result.output
    p2l = torch.tensor(json.loads((out / "init_expert_location.json").read_text())["physical_to_logical_map"])
    for rank in (0, 31):
        metadata = build_metadata(sglang_expert_location, p2l, rank)
        assert (metadata.num_layers, metadata.num_physical_experts, metadata.num_logical_experts) == (61, 288, 256)
        assert metadata.num_local_physical_experts == 9
        dispatch = metadata.logical_to_rank_dispatch_physical_map  # static dispatch: a slot per expert
        assert torch.equal(p2l.gather(1, dispatch), torch.arange(E).expand(61, -1))
        on_rank = dispatch[3:] // 9 == rank  # SGLang prefers the rank's own replica: same GPU when we placed one
        hosted = torch.stack([torch.isin(torch.arange(E), p2l[layer, rank * 9:(rank + 1) * 9]) for layer in range(3, 61)])
        assert torch.equal(on_rank, hosted)


def test_sglang_rejects_a_map_that_drops_an_expert(sglang_expert_location):
    p2l = torch.arange(E + 32).remainder(E).repeat(61, 1)
    build_metadata(sglang_expert_location, p2l, 0)  # SGLang's trivial layout is accepted
    p2l[10, 7], p2l[10, E + 7] = 8, 9  # expert 7 has no slot at layer 10
    with pytest.raises((ZeroDivisionError, AssertionError, IndexError)):
        build_metadata(sglang_expert_location, p2l, 0)


def sglang_functions(relative: str, names: tuple) -> dict:
    """Top-level functions of an SGLang file whose module imports the whole server: their own
    source, parsed out of the installed file and run with torch alone (they use nothing else)."""
    import ast

    source = (SGLANG / relative).read_text()
    tree = ast.parse(source)
    chosen = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name in names]
    assert sorted(n.name for n in chosen) == sorted(names), "SGLang renamed a function this test runs"
    namespace = {"torch": torch}
    exec(compile(ast.Module(body=chosen, type_ignores=[]), str(SGLANG / relative), "exec"), namespace)
    return {name: namespace[name] for name in names}


def test_sglang_aggregates_our_per_token_layout_to_the_loads_we_import(tmp_path):
    """SGLang's own per-token -> physical count -> logical count functions (what its stat mode
    dumps) agree with our writer's counts and with the loads our importer reads back."""
    from moeplan.passes.analysis.trace.engine_import import import_engine_trace
    from sglang_dump_writer import per_token_records

    functions = sglang_functions("srt/eplb/expert_distribution.py", (
        "_convert_per_token_to_global_physical_count", "_convert_global_physical_count_to_logical_count"))
    trace = synthesize_trace(layers=3, experts=8, top_k=2, tokens=60, affinity=0.5, zipf=0.8, seed=2)
    rng = np.random.default_rng(1)
    slot_map = np.stack([np.concatenate([rng.permutation(8), rng.integers(0, 8, size=4)]) for _ in range(5)])
    records = per_token_records(trace, [1, 2, 4], slot_map)  # decoder layers 0 and 3 dense
    physical = []
    for record in records:
        topk = record["topk_ids_of_layer"]
        theirs = functions["_convert_per_token_to_global_physical_count"](
            len(record["input_ids"]), num_layers=5, num_physical_experts=12, _topk_ids_of_layer=topk)
        assert torch.equal(theirs, record["global_physical_count"])
        physical.append(theirs)
    logical = functions["_convert_global_physical_count_to_logical_count"](
        torch.stack(physical), num_layers=5, num_logical_experts=8, physical_to_logical_map=torch.tensor(slot_map))
    torch.save({"rank": 0, "logical_count": logical, "average_utilization_rate_over_window": None},
               tmp_path / "expert_distribution_recorder_1.0.pt")
    imported = import_engine_trace(tmp_path / "expert_distribution_recorder_1.0.pt", top_k=2)
    np.testing.assert_array_equal(imported.loads, trace.expert_loads())
