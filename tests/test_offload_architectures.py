"""The expert cache wraps the adapter's local expert computation, so every transformers MoE
architecture the runtime supports runs offloaded: 2 ranks (each caching 3 of its own experts,
LRU), both modes, one torchrun launch for all of them. Each must reproduce transformers' model
(max |logit diff| <= 1e-4, identical tokens), and its measured cache counters must equal the
simulator's replay of the requests the ranks logged, which are the ones the routing implies.
Every architecture whose experts module the runtime can run one expert at a time (all but
Llama-4 and JetMoE) also computes some misses on the host (issue 33: a clock on which the host
beats the first copy of a step but not the second), through the library's own experts module on
that expert's CPU weights: same logits, and the host-computed requests equal the replay's."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moeplan.runtime.offload.expert_cache import per_expert_shape
from moeplan.planner.launch.torchrun_verify import compare
from moeplan.passes.importers.resolve import import_file
from moeplan.backends.common.files import copy_runtime
from moeplan.passes.optimize.offload.run_check import cache_beside_simulation
from runtime_fixtures import contiguous_placement, write_hf_bundle

REPO = Path(__file__).resolve().parents[1]
tiny = import_file(REPO / "examples" / "hf_tiny" / "architectures.py")
NEW_TOKENS = 3
CAPACITY = 3
HOST_KINDS = ("experts", "tiny_moe")  # runtime/offload/host_compute.py


def _containers(model):
    from moeplan.runtime.model.library_model import decoder_layers
    from moeplan.runtime.model.moe_adapter import find_containers

    prefix, layers = decoder_layers(model)
    return find_containers(layers, prefix)


def with_expert_cache(bundle: Path, placement: dict, containers: list) -> None:
    """Give a bundle's ranks LRU caches of CAPACITY keys, their first local keys resident."""
    plan = json.loads((bundle / "plan.json").read_text())
    c = containers[0]
    if c.kind == "tiny_moe":
        per = [tuple(s) for p, s in c.params if p.startswith("0.")]
    else:
        per = [per_expert_shape(s, c.num_experts) for _, s in c.params]
    expert_bytes = sum(int(torch.Size(s).numel()) for s in per) * 4
    resident = [[[layer["layer"], e] for layer in placement["layers"] for e in layer["devices"][r]][:CAPACITY]
                for r in range(2)]
    plan["communication"]["expert_cache"] = {"capacity": [CAPACITY, CAPACITY], "eviction": "lru", "prefetch": "none",
                                             "resident": resident, "policy_model": None, "runtime_expert_bytes": expert_bytes}
    if c.kind in HOST_KINDS:  # host 8 us vs copy 10 us: a step's first miss goes to the host, a second one is copied
        plan["communication"]["expert_cache"].update(host_compute="cheaper", timing={
            "layer_ns": 50000.0, "expert_compute_ns": 100.0, "pcie_copy_ns": 10000.0, "nvme_copy_ns": 0.0,
            "expert_bytes": expert_bytes, "host_expert_ns": 7000.0, "host_row_ns": 100.0, "host_overhead_ns": 1000.0})
    (bundle / "plan.json").write_text(json.dumps(plan, indent=2, sort_keys=True) + "\n")
    copy_runtime(bundle / "runtime", "torchrun", expert_cache=True)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    import transformers

    root = tmp_path_factory.mktemp("offload_architectures")
    bundles = {}
    for arch in tiny.ARCHITECTURES:
        directory = tiny.build(arch, root / "models")
        model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
        containers = _containers(model)
        placement = contiguous_placement(len(containers), 8, 1, 2)
        bundles[arch] = write_hf_bundle(root / arch, directory, model, placement)
        with_expert_cache(bundles[arch], placement, containers)
    prompts = root / "prompts.txt"
    prompts.write_text("ids: 5 9 11 3 40 2\nids: 60 12 33\n")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "runtime.serve", "--prompts", str(prompts), "--new-tokens", str(NEW_TOKENS),
           "--mode", "coherent,standard", "--out", str(root / "out")]
    for bundle in bundles.values():
        cmd += ["--bundle", str(bundle)]
    import os

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    # the first bundle's runtime/ serves them all (it holds the shipped policy modules)
    proc = subprocess.run(cmd, cwd=next(iter(bundles.values())), capture_output=True, text=True, timeout=900,
                          env={**env, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return bundles, root / "out"


@pytest.mark.slow
@pytest.mark.parametrize("arch", tiny.ARCHITECTURES)
def test_architecture_runs_offloaded_and_measures_the_simulated_hits(served, arch):
    bundles, out = served
    bundle = bundles[arch]
    plan = json.loads((bundle / "plan.json").read_text())
    reference = {}
    for mode in ("coherent", "standard"):
        run_dir = out / bundle.name / mode
        result = compare(bundle, plan, run_dir, NEW_TOKENS, reference)
        assert result["tokens_match"] and result["max_abs_logit_diff"] <= 1e-4, (mode, result)
        summary = json.loads((run_dir / "result.json").read_text())
        cache = cache_beside_simulation(bundle, plan, run_dir, summary)["expert_cache"]
        assert cache["matches_simulation"] and cache["requests_match_routing"], (mode, cache)
        m = cache["measured"]
        assert 0 < m["hits"] < m["requests"] and m["bytes_moved"] == m["loads"] * plan["communication"]["expert_cache"]["runtime_expert_bytes"]
        if plan["communication"]["expert_cache"].get("host_compute"):
            assert 0 < m["host_computed"] < m["requests"] - m["hits"] and m["host_rows"] >= m["host_computed"], (mode, m)
            assert m["host_computed"] + m["hits"] + m["loads"] == m["requests"]  # every miss: one or the other
