"""Balance of our `eplb` beside SGLang's own EPLB on the same loads, as the slot maps the engine loads.

For each topology: a DeepSeek-V3-shaped trace (58 MoE layers x 256 experts, top-8, planted
affinity, Zipf popularity; `--tokens`, `--seed`), its expert loads, then
- sglang: `rebalance_experts` of SGLang's `srt/eplb/eplb_algorithms/deepseek.py` (the installed
  wheel, loaded by path; hierarchical when the 8 expert groups divide over the nodes, as its
  `compute_algorithm("auto")` picks);
- ours: `moeplan`'s `eplb` policy with 8 expert groups, turned into the same slot map the
  sglang target writes;
- contiguous: expert e on GPU e // (E / GPUs), no replicas (what SGLang's trivial layout is
  without redundant slots).
Balance = mean over layers of max/mean GPU load, each expert's load split evenly over its slots.

    python benchmarks/engine_eplb.py [--tokens 4000] [--seed 0] [--json]

With --json the last line is {"cases": [{"nodes", "gpus_per_node", "redundant", "sglang", "ours",
"contiguous", "ours_over_sglang"}, ...]}.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import numpy as np

CASES = ((1, 8, 0), (2, 8, 16), (4, 8, 0), (4, 8, 32), (8, 8, 64))
E, LAYERS, TOP_K, GROUPS = 256, 58, 8, 8


def sglang_eplb():
    spec = importlib.util.find_spec("sglang")
    if spec is None:
        sys.exit("error: the sglang wheel is not installed; run 'make venv' (it installs sglang==0.5.23 --no-deps)")
    path = Path(spec.submodule_search_locations[0]) / "srt" / "eplb" / "eplb_algorithms" / "deepseek.py"
    module_spec = importlib.util.spec_from_file_location("sglang_eplb_deepseek", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def slot_balance(p2l: np.ndarray, loads: np.ndarray, gpus: int) -> float:
    """Mean over layers of max/mean GPU load for slot maps [L, slots] (slot s on GPU s // (slots / gpus))."""
    ratios = []
    for row, load in zip(p2l, loads):
        copies = np.bincount(row, minlength=len(load))
        gpu_load = (load[row] / copies[row]).reshape(gpus, -1).sum(axis=1)
        ratios.append(gpu_load.max() / gpu_load.mean())
    return float(np.mean(ratios))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=4000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    import torch

    from moeplan.core.expert_slots import placement_slots
    from moeplan.passes.analysis.trace.synth_planted import synthesize_trace
    from moeplan.passes.optimize.placement.schema import Topology
    from moeplan.passes.optimize.placement.policies import PlacementRequest, plan_placement

    deepseek = sglang_eplb()
    trace = synthesize_trace(layers=LAYERS, experts=E, top_k=TOP_K, tokens=args.tokens, affinity=0.6, zipf=0.8,
                             seed=args.seed)
    loads = trace.expert_loads().astype(np.float64)
    rows = []
    for nodes, gpn, redundant in CASES:
        gpus = nodes * gpn
        phy2log, _, _ = deepseek.rebalance_experts(torch.tensor(loads), E + redundant, GROUPS, nodes, gpus,
                                                   GROUPS % nodes == 0)
        placement = plan_placement(trace, PlacementRequest(topology=Topology(nodes, gpn), policy="eplb",
                                                           redundant=redundant, expert_groups=GROUPS))
        ours = np.array(placement_slots(json.loads(placement.to_json()), E, redundant))
        contiguous = np.tile(np.arange(E), (LAYERS, 1))
        row = {"nodes": nodes, "gpus_per_node": gpn, "redundant": redundant,
               "sglang": slot_balance(phy2log.numpy(), loads, gpus), "ours": slot_balance(ours, loads, gpus),
               "contiguous": slot_balance(contiguous, loads, gpus)}
        row["ours_over_sglang"] = row["ours"] / row["sglang"]
        rows.append(row)
    print(f"{'topology':>16} {'sglang':>8} {'ours':>8} {'contig.':>8} {'ours/sglang':>12}")
    for r in rows:
        print(f"{r['nodes']}x{r['gpus_per_node']} +{r['redundant']:<3}     {r['sglang']:8.4f} {r['ours']:8.4f} "
              f"{r['contiguous']:8.4f} {r['ours_over_sglang']:12.4f}")
    if args.json:
        print(json.dumps({"cases": rows}, sort_keys=True))


if __name__ == "__main__":
    main()
