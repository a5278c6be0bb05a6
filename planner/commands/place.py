"""`moeplan place`: decide which GPU hosts which experts, or score an existing placement.

    moeplan place --trace T --nodes N --gpus-per-node G [--policy ilp|eplb|contiguous]
                  [--redundant R] [--balance B] [--balance-base mean|eplb] [--solver highs|gurobi]
                  [--effort X] [--time-limit S] --out placement.json [--json]
    moeplan place --evaluate placement.json --trace T2 [--json]

The policies live in `passes/optimize/placement/policies.py`; this command parses flags, writes
`placement.json` atomically and prints the metrics. `--effort` sets how much work the ilp does
(deterministic: same inputs, same bytes on any machine); `--time-limit` is only a safety net, and
when it stops the solve the command warns that the result may not be reproducible.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from moeplan.planner.commands.options import placement_options, topology_options
from moeplan.planner.pipeline.flags import PLACEMENT_FLAGS, pick
from moeplan.core.errors import UserError

METRIC_ORDER = ("gpu_local_fraction", "node_local_fraction", "max_over_mean_load", "objective", "bound", "gap", "solve_seconds",
                "stopped_by")


@click.command("place")
@click.option("--trace", "trace_path", type=click.Path(path_type=Path), required=True, help="Routing trace (.npz).")
@topology_options(required=True)
@placement_options
@click.option("--out", "out", type=click.Path(path_type=Path), help="placement.json to write.")
@click.option("--evaluate", "evaluate", type=click.Path(path_type=Path), help="Score this placement.json on --trace instead.")
@click.option("--timings", is_flag=True, help="Also record solve_seconds in placement.json (its bytes then vary run to run).")
@click.option("--json", "as_json", is_flag=True, help="Print the metrics as one JSON object.")
def place(trace_path, nodes, gpus_per_node, out, evaluate, timings, as_json, **flags):
    """Place experts on GPUs from a routing trace (or --evaluate a placement on a trace)."""
    from moeplan.passes.analysis.trace.format import load_trace
    from moeplan.passes.optimize.placement.schema import load_placement
    from moeplan.passes.optimize.placement.policies import evaluate_placement
    from moeplan.core.pass_manager import PassManager
    from moeplan.planner.pipeline.place import PASSES

    options = pick(flags, PLACEMENT_FLAGS)
    if evaluate is not None:
        placement = load_placement(evaluate)
        metrics = evaluate_placement(placement, load_trace(trace_path))
        _report({"placement": str(evaluate), "trace": str(trace_path), "policy": placement.policy, **metrics}, as_json)
        return
    if nodes is None or gpus_per_node is None:
        raise UserError("--nodes and --gpus-per-node are required to place experts (or pass --evaluate placement.json)")
    if out is None:
        raise UserError("--out is required: where to write placement.json")
    facts = PassManager(PASSES, quiet=True).run({"trace_path": str(trace_path), "out": out, "timings": timings,
                                                 "topology": {"nodes": nodes, "gpus_per_node": gpus_per_node},
                                                 "placement_options": options})
    placement = facts["placement"]
    for note in placement.metrics.get("notes", []):
        click.echo(f"note: {note}", err=True)
    _report({"out": str(out), "policy": options["policy"], **placement.metrics}, as_json)


def _report(result: dict, as_json: bool) -> None:
    if as_json:
        click.echo(json.dumps(result, sort_keys=True))
        return
    from rich.console import Console
    from rich.table import Table

    console = Console(soft_wrap=False, width=None if sys.stdout.isatty() else 160)
    table = Table(title=f"placement ({result.get('policy')})", title_justify="left")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key in METRIC_ORDER:
        if key in result:
            value = result[key]
            table.add_row(key, f"{value:.4f}" if isinstance(value, float) else str(value))
    console.print(table)
    if "out" in result:
        console.print(f"wrote {result['out']}", highlight=False)
