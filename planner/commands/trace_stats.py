"""`moeplan trace stats T.npz [--json]`: expert load, imbalance and inter-layer affinity of a trace.

The figures come from `passes/analysis/trace/stats.py`; this command only formats them.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import click


def _render(path: Path, stats) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(soft_wrap=False, width=None if sys.stdout.isatty() else 160)
    console.print(f"[bold]{path}[/bold]: {stats.num_tokens} tokens"
                  + (f" in {stats.num_sequences} sequences" if stats.num_sequences else "")
                  + f", {stats.num_layers} MoE layers, top-{stats.top_k} of {stats.num_experts} experts",
                  highlight=False)

    loads = Table(title="expert load (tokens per expert, all k choices)", title_justify="left")
    for header in ("layer", "min", "mean", "max", "max/mean", "idle experts"):
        loads.add_column(header, justify="right", no_wrap=True)
    for layer in stats.loads:
        counts = layer.tokens_per_expert
        loads.add_row(str(layer.layer), str(min(counts)), f"{sum(counts) / len(counts):.1f}", str(max(counts)),
                      f"{layer.max_over_mean:.2f}", str(layer.idle_experts))
    loads.add_row("mean", "", "", "", f"{stats.mean_max_over_mean:.2f}", "", style="bold")
    console.print(loads)

    if stats.num_layers < 2:
        console.print("affinity: needs at least two MoE layers", highlight=False)
        return
    affinity = Table(title="top-1 transition affinity", title_justify="left")
    for header in ("layers", "affinity", "shuffled baseline", "ratio"):
        affinity.add_column(header, justify="right", no_wrap=True)

    def ratio(a, b):
        return f"{a / b:.2f}x" if b > 0 else "-"
    for l, (a, s) in enumerate(zip(stats.affinity, stats.shuffled_affinity)):
        affinity.add_row(f"{l} -> {l + 1}", f"{a:.3f}", f"{s:.3f}", ratio(a, s))
    affinity.add_row("mean", f"{stats.mean_affinity:.3f}", f"{stats.mean_shuffled_affinity:.3f}",
                     ratio(stats.mean_affinity, stats.mean_shuffled_affinity), style="bold")
    console.print(affinity)
    console.print("affinity: share of tokens sent to their current expert's most common next expert; "
                  "shuffled: each layer's routing permuted over tokens (same loads)", highlight=False)
    console.print(f"uniform random router on {stats.num_tokens} tokens: {stats.uniform_affinity:.3f} "
                  f"(1/{stats.num_experts} = {1 / stats.num_experts:.3f})", highlight=False)
    if stats.speculation_recall is not None:
        console.print(f"speculation recall (real experts of layer l+d named by layer l+d's router on layer l's "
                      f"{stats.speculation_source}): " + ", ".join(f"d={d} {r:.3f}" for d, r in stats.speculation_recall.items()),
                      highlight=False)


@click.command("stats")
@click.argument("trace_file", metavar="TRACE", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of tables.")
def stats(trace_file, as_json):
    """Per-layer expert load and imbalance, and top-1 inter-layer affinity of a TRACE file."""
    from moeplan.passes.analysis.trace.format import load_trace
    from moeplan.passes.analysis.trace.stats import routing_stats

    result = routing_stats(load_trace(trace_file))
    if as_json:
        click.echo(json.dumps({"trace": str(trace_file), **result.to_dict()}, sort_keys=True))
    else:
        _render(trace_file, result)
