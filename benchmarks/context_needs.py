"""How much coherent-mode context could be skipped by sending it only to the ranks that need it,
with hindsight (issue 12, item 5).

A token's context (hidden state or K/V) at block b is needed by rank r if some token of the same
sequence at the same or a later position is current on r at block b, now or at any later step.
Which rank a later token lands on is decided by its own routing at the MoE block before b, which
is not known when this token's context is sent; this script counts, on a routing replayed with
the runtime's replica rule (`runtime/ep/expert_table.py`), the share of the context rows
that a scheme knowing every future routing could skip: an upper bound on what "only to the ranks
that need it" can save.

    python benchmarks/context_needs.py [--model DIR] [--ranks 2 4] [--workload 8x32+8] [--json]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
TOPOLOGIES = {2: (1, 2), 4: (2, 2), 8: (2, 4)}


def needed_share(hosts: np.ndarray, gpus_per_node: int, moe_blocks: tuple, num_blocks: int, workload, routing: dict) -> float:
    """Share of coherent-mode context rows (token, block, other rank) some rank needs, with hindsight."""
    from moeplan.runtime.ep.expert_table import ExpertTable

    table = ExpertTable(hosts, gpus_per_node)
    W = hosts.shape[2]
    moe_of = {b: m for m, b in enumerate(moe_blocks)}
    tokens = [t for step in workload.steps() for t in step]
    current = {}  # (token, block) -> rank current at that block's attention
    for t in tokens:
        cur = None
        for b in range(num_blocks):
            if cur is not None:
                current[(t, b)] = cur
            if b in moe_of:
                m = moe_of[b]
                cur = int(table.primary(m, [int(routing[t][m][0])], [-1 if cur is None else cur])[0])
    sent = needed = 0
    by_seq = {}
    for (t, b), r in current.items():
        by_seq.setdefault((t[0], b), []).append((t[1], r))
    for (_s, _b), entries in by_seq.items():
        entries.sort()
        later = set()
        for _pos, r in reversed(entries):  # ranks current for this or a later position of the sequence
            later.add(r)
            sent += W - 1
            needed += len(later - {r})
    return needed / sent if sent else 0.0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(REPO / "examples" / "tiny_moe"))
    ap.add_argument("--trace", default=None, help="routing trace; default: record one on the model's training corpus")
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8], choices=sorted(TOPOLOGIES))
    ap.add_argument("--workload", default="8x32+8")
    ap.add_argument("--policies", nargs="+", default=["contiguous", "ilp"])
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    import tempfile

    from moeplan.passes.cost.cost_model import ModelShape, routing_from_trace
    from moeplan.passes.analysis.trace.format import load_trace
    from moeplan.passes.optimize.placement.schema import Topology
    from moeplan.passes.optimize.placement.policies import PlacementRequest, plan_placement
    from moeplan.passes.importers import load_model
    from moeplan.passes.cost.options import parse_workload

    loaded = load_model(args.model)
    shape = ModelShape.from_ir(loaded.ir)
    workload = parse_workload(args.workload)
    with tempfile.TemporaryDirectory() as tmp:
        if args.trace is None:
            sys.path.insert(0, str(REPO / "benchmarks"))
            from runtime import record

            args.trace = str(record(args.model, Path(args.model) / "corpus_train.txt", 4096, Path(tmp) / "trace.npz"))
        trace = load_trace(args.trace)
        per = sum(len(s) for s in workload.steps())
        rows = []
        for ranks in args.ranks:
            nodes, per_node = TOPOLOGIES[ranks]
            for policy in args.policies:
                placement = plan_placement(trace, PlacementRequest(topology=Topology(nodes, per_node), policy=policy, time_limit=20,
                                                                         balance_base="eplb"))
                shares = [needed_share(placement.hosts(), per_node, shape.moe_blocks, shape.num_blocks, workload,
                                       routing_from_trace(trace.experts, workload, offset=i * per)) for i in range(4)]
                rows.append({"ranks": ranks, "placement": policy, "needed_share": float(np.mean(shares)),
                             "skippable_share": 1.0 - float(np.mean(shares))})
                print(f"{ranks} ranks {policy:>10}: context rows needed with hindsight {rows[-1]['needed_share']:.3f}")
    if args.json:
        print(json.dumps({"rows": rows, "workload": args.workload, "model": args.model}, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
