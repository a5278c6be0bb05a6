"""`moeplan trace import LOG.jsonl --out T.npz`: convert a vLLM-style routing log into a trace.

Conversion and validation live in `passes/analysis/trace/vllm_jsonl.py` (the mapping is documented
there); this command reads, converts and writes atomically.
"""
from __future__ import annotations

from pathlib import Path

import click

from moeplan.planner import cli_types as T


@click.command("import")
@click.argument("log", type=click.Path(path_type=Path))
@click.option("--out", "out", required=True, type=click.Path(path_type=Path), help="Trace file to write (.npz).")
@click.option("--num-experts", type=T.POSITIVE_INT, default=None,
              help="Experts per MoE layer (default: the largest logged id + 1); ids >= it are an error.")
@click.option("--quiet", is_flag=True, help="No summary line.")
def import_log(log, out, num_experts, quiet):
    """Convert a JSONL routing LOG (one record per token and layer) into a trace file."""
    from moeplan.passes.analysis.trace.format import save_trace
    from moeplan.passes.analysis.trace.vllm_jsonl import import_routing_log

    trace = import_routing_log(log, num_experts=num_experts)
    save_trace(trace, out)
    if not quiet:
        sequences = len(set(trace.sequence.tolist())) if trace.sequence is not None else 0
        click.echo(f"wrote {out}: {trace.num_tokens} tokens in {sequences} sequences x {trace.num_layers} MoE layers, "
                   f"top-{trace.top_k} of {trace.num_experts} experts")
