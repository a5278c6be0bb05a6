"""`moeplan trace import PATH [--format auto|sglang|trtllm|vllm-jsonl] --out T.npz`.

Conversion and validation live in `passes/analysis/trace/` (`engine_import.py` picks the format;
each format's mapping is documented in its module); this command reads, converts and writes
atomically.
"""
from __future__ import annotations

from pathlib import Path

import click

from moeplan.core import cli_types as T
from moeplan.passes.analysis.trace.engine_import import FORMATS


@click.command("import")
@click.argument("log", metavar="PATH", type=click.Path(path_type=Path))
@click.option("--out", "out", required=True, type=click.Path(path_type=Path), help="Trace file to write (.npz).")
@click.option("--format", "fmt", type=click.Choice(FORMATS), default="auto", show_default=True,
              help="sglang: expert-distribution dumps (.pt file or directory); trtllm: EXPERT_STATISTIC_PATH "
                   "directory; vllm-jsonl: one JSON record per token and layer; auto: decide from the path.")
@click.option("--num-experts", type=T.POSITIVE_INT, default=None,
              help="Experts per MoE layer (default: from the records); ids >= it are an error.")
@click.option("--top-k", type=T.POSITIVE_INT, default=1, show_default=True,
              help="sglang stat dumps: experts per token, kept in the loads-only trace (the dump omits it).")
@click.option("--trtllm-assignments", type=click.Path(path_type=Path), default=None,
              help="trtllm: load-balancer YAML of the run (its initial_global_assignments map slot counts to experts).")
@click.option("--quiet", is_flag=True, help="No summary line.")
def import_log(log, out, fmt, num_experts, top_k, trtllm_assignments, quiet):
    """Convert routing records from a serving engine (SGLang, TensorRT-LLM, vLLM-style JSONL) into a trace file."""
    from moeplan.passes.analysis.trace.engine_import import import_engine_trace
    from moeplan.passes.analysis.trace.format import save_trace
    from moeplan.core.errors import UserError

    if num_experts is not None and num_experts <= 0:
        raise UserError(f"--num-experts must be positive, got {num_experts}")
    if Path(out).resolve() == Path(log).resolve():
        raise UserError(f"--out '{out}' is the input; write the trace to another file")
    trace = import_engine_trace(log, fmt, num_experts=num_experts, top_k=top_k,
                                trtllm_assignments=str(trtllm_assignments) if trtllm_assignments else None)
    save_trace(trace, out)
    if quiet:
        return
    if trace.loads_only:
        click.echo(f"wrote {out}: loads-only trace, {int(trace.loads.sum())} expert assignments x {trace.num_layers} "
                   f"MoE layers, {trace.num_experts} experts (balance-only policies: eplb, contiguous)")
        return
    sequences = len(set(trace.sequence.tolist())) if trace.sequence is not None else 0
    click.echo(f"wrote {out}: {trace.num_tokens} tokens in {sequences} sequences x {trace.num_layers} MoE layers, "
               f"top-{trace.top_k} of {trace.num_experts} experts")
