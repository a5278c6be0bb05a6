"""Where the placement gap with redundant slots comes from (issue 15, target "gap below 0.2 on the
8-GPU cases").

For each 8-GPU corpus case (`placement_corpus.py`), `ilp` with the case's redundant slots (and
without, with --without-replicas) is planned on the planning half at 1.1 x mean (EPLB's max load + 5% where that is infeasible, as in
`benchmarks/placement.py`). On the planning half, for that placement:
- objective, bound, gap: what the placement reports (the metric's cross-GPU transitions, the
  bound of `bounds/pairwise.py` / `bounds/chain.py`, and their relative gap);
- free_routing_cross, colocation_cross: the same placement's cross transitions when each token
  picks its best copy, and when a transition is local as soon as its two experts share a GPU
  (`research/relaxed_routing.py`);
- gap_floor_free_routing = 1 - free_routing_cross / objective and gap_floor_colocation = 1 -
  colocation_cross / objective: no bound on the free-routing (co-location) relaxation can exceed
  that relaxation's count for this placement, so no such bound can report a smaller gap. Every
  bound in `bounds/pairwise.py` and `bounds/chain.py` bounds the free-routing count; all but the per-token
  caps (`bounds.pairwise.source_token_caps`, binding only where top-k exceeds a GPU's slots) bound the
  co-location count too.

With --pair-milp NODES, rows without replicas also solve each layer pair's own placement as a
compact MILP (`research/pair_milp.py`, NODES branch-and-bound nodes per pair, started from the placement):
- pair_milp_bound, pair_milp_gap: the sum of the pairs' MILP bounds, a valid bound on the
  placement problem (stronger than the LPs where the MILP gets far), and the gap against it;
- pair_best_cross, gap_floor_pairwise = 1 - pair_best_cross / objective: the sum over pairs of
  the best pair placements found; every bound argued one layer pair at a time is at most the
  sum of the pairs' optima, so none can report a smaller gap than this floor.
The caps are the request's (1.1 x mean, or EPLB's max load + 5%), which the placement meets.

    python benchmarks/placement_gap.py [--corpus-cases mixtral qwen] [--without-replicas] [--pair-milp 1000] [--effort 1] [--json]

With --json the last line is {"cases": [{"case", "policy", "objective", "bound", "gap", "bound_method",
"free_routing_cross", "colocation_cross", "gap_floor_free_routing", "gap_floor_colocation",
"transitions", "seconds"} and, with --pair-milp, "pair_milp_bound", "pair_milp_gap", "pair_best_cross",
"gap_floor_pairwise", "pair_milp_seconds", ...]}.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def gap_row(case, plan_trace, effort: float, time_limit: float, log, redundant: int, pair_nodes: int = 0) -> dict:
    from moeplan.passes.optimize.placement.schema import Topology
    from moeplan.passes.optimize.placement.policies import PlacementRequest, plan_placement
    from research.relaxed_routing import colocation_cross, free_routing_cross
    from moeplan.core.errors import UserError

    topology = Topology(case.nodes, case.gpus_per_node)
    start = time.perf_counter()
    options = dict(policy="ilp", redundant=redundant, time_limit=time_limit, effort=effort)
    cap_rule = (0.1, "mean")
    try:
        placement = plan_placement(plan_trace, PlacementRequest(topology, balance=0.1, **options))
    except UserError as exc:
        log(f"  {case.name}: {exc}; rerun at EPLB's max load + 5%")
        cap_rule = (0.05, "eplb")
        placement = plan_placement(plan_trace, PlacementRequest(topology, balance=0.05, balance_base="eplb", **options))
    seconds = time.perf_counter() - start
    m = placement.metrics
    hosts = placement.hosts()
    objective = m["objective"]
    free, coloc = free_routing_cross(plan_trace, hosts), colocation_cross(plan_trace, hosts)
    return {"case": case.name, "policy": f"ilp+{redundant}" if redundant else "ilp", "objective": objective, "bound": m["bound"], "gap": m["gap"],
            "bound_method": m["bound_method"], "transitions": m["transitions"],
            "free_routing_cross": free, "colocation_cross": coloc,
            "gap_floor_free_routing": 1 - free / objective if objective else 0.0,
            "gap_floor_colocation": 1 - coloc / objective if objective else 0.0,
            "seconds": seconds, **(pair_milp_columns(plan_trace, hosts, topology, cap_rule, objective, m["bound"], pair_nodes)
                                   if pair_nodes and not redundant else {})}


def pair_milp_columns(plan_trace, hosts, topology, cap_rule, objective: float, bound: float, nodes: int) -> dict:
    """The --pair-milp columns (module docstring) for a placement without replicas, hosts bool [L, E, D]."""
    from moeplan.passes.analysis.affinity import transition_counts
    from moeplan.passes.optimize.milp import relative_gap
    from moeplan.passes.optimize.placement.algorithms.ilp_caps import eplb_replicas_and_caps
    from research.pair_milp import pair_cross_milp

    start = time.perf_counter()
    counts = transition_counts(plan_trace, "current")
    loads = plan_trace.expert_loads().astype(float)
    D = topology.devices
    _, caps = eplb_replicas_and_caps(loads, D, 0, *cap_rule)
    pairs = [pair_cross_milp(c, loads[l], loads[l + 1], caps[l], caps[l + 1], D, plan_trace.num_experts // D, nodes,
                             start=hosts[l:l + 2]) for l, c in enumerate(counts)]
    pair_bound = float(sum(p[0] for p in pairs))
    best = float(sum(p[1] for p in pairs))
    return {"pair_milp_bound": pair_bound, "pair_milp_gap": relative_gap(objective, max(bound, pair_bound)),
            "pair_best_cross": best, "gap_floor_pairwise": 1 - best / objective if objective else 0.0,
            "pair_milp_seconds": time.perf_counter() - start}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus-cases", nargs="*", default=None, help="8-GPU corpus cases whose name contains one of these")
    parser.add_argument("--effort", type=float, default=1.0)
    parser.add_argument("--time-limit", type=float, default=3000.0, help="safety net only (work limits decide)")
    parser.add_argument("--without-replicas", action="store_true", help="also plan ilp without redundant slots")
    parser.add_argument("--pair-milp", type=int, default=0, metavar="NODES",
                        help="rows without replicas: also solve each layer pair as a compact MILP to NODES nodes")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    def log(message):
        print(message, file=sys.stderr if args.json else sys.stdout, flush=True)

    sys.path.insert(0, str(REPO / "benchmarks"))
    from placement import split_by_sequence
    from placement_corpus import CORPUS, load_case_trace

    rows = []
    for case in CORPUS:
        if case.nodes * case.gpus_per_node != 8 or not case.redundant:
            continue
        if args.corpus_cases and not any(c in case.name for c in args.corpus_cases):
            continue
        plan_trace, _ = split_by_sequence(load_case_trace(case, log))
        for redundant in ([0] if args.without_replicas else []) + [case.redundant]:
            row = gap_row(case, plan_trace, args.effort, args.time_limit, log, redundant, args.pair_milp)
            rows.append(row)
            log(f"  {row['case']:22s} {row['policy']:6s}: cross {row['objective']:9.0f}  bound {row['bound']:9.0f}  "
                f"gap {row['gap']:.3f}  | free routing {row['free_routing_cross']:9.0f} (gap floor {row['gap_floor_free_routing']:.3f})"
                f"  co-location {row['colocation_cross']:9.0f} (gap floor {row['gap_floor_colocation']:.3f})  {row['seconds']:.1f}s")
            if "pair_milp_bound" in row:
                log(f"  {'':22s} {'':6s}  pair MILPs: bound {row['pair_milp_bound']:9.0f}  gap {row['pair_milp_gap']:.3f}  | "
                    f"pairs' best {row['pair_best_cross']:9.0f} (pairwise gap floor {row['gap_floor_pairwise']:.3f})  "
                    f"{row['pair_milp_seconds']:.0f}s")
    if args.json:
        print(json.dumps({"cases": rows}, sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
