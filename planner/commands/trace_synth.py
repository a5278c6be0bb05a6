"""`moeplan trace synth`: write a synthetic routing trace with planted affinity and Zipf popularity.

The generator lives in `passes/analysis/trace/synth_planted.py`; this command parses flags and writes
the `.npz` atomically.
"""
from __future__ import annotations

import json
from pathlib import Path

import click

from moeplan.core import cli_types as T


@click.command("synth")
@click.option("--layers", type=T.POSITIVE_INT, required=True, help="MoE layers.")
@click.option("--experts", type=T.POSITIVE_INT, required=True, help="Experts per MoE layer.")
@click.option("--k", "top_k", type=T.POSITIVE_INT, default=2, show_default=True, help="Experts chosen per token (top-k).")
@click.option("--tokens", type=T.POSITIVE_INT, default=20000, show_default=True, help="Tokens in the trace.")
@click.option("--affinity", type=T.FRACTION, default=0.6, show_default=True,
              help="Probability that a token's next experts come from its current expert's preferred successor cluster.")
@click.option("--zipf", type=T.NON_NEGATIVE_FLOAT, default=0.8, show_default=True, help="Zipf exponent of expert popularity (0 = uniform).")
@click.option("--group-size", type=T.POSITIVE_INT, default=None, help="Experts per planted cluster (default max(k, experts // 16)).")
@click.option("--seed", type=T.SEED, default=0, show_default=True, help="Random seed; same seed, same trace.")
@click.option("--out", "out", type=click.Path(path_type=Path), required=True, help="Trace file to write (.npz).")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON summary.")
def synth(layers, experts, top_k, tokens, affinity, zipf, group_size, seed, out, as_json):
    """Synthesise a routing trace with planted inter-layer affinity and Zipf-skewed popularity."""
    from moeplan.passes.analysis.trace.synth_planted import synthesize_trace
    from moeplan.passes.analysis.trace.format import check_trace_shape, save_trace

    check_trace_shape(tokens, layers, top_k, experts)
    trace = synthesize_trace(layers=layers, experts=experts, top_k=top_k, tokens=tokens, affinity=affinity,
                             zipf=zipf, seed=seed, group_size=group_size)
    save_trace(trace, out)
    summary = {"out": str(out), "tokens": tokens, "layers": layers, "experts": experts, "k": top_k,
               "affinity": affinity, "zipf": zipf, "seed": seed}
    if as_json:
        click.echo(json.dumps(summary, sort_keys=True))
    else:
        click.echo(f"wrote {out}: {tokens} tokens, {layers} MoE layers, top-{top_k} of {experts} experts "
                   f"(affinity {affinity:g}, zipf {zipf:g}, seed {seed})")
