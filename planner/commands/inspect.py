"""`moeplan inspect MODEL [--json]`: what a model weighs and costs, stage by stage.

The summary is what a platform engineer sizes a deployment from: total and per-expert parameter
bytes, the dense part every replica carries, and the parameters/FLOPs one token activates. The
`--json` object has fixed keys (see `summarize`) and embeds the full IR under `ir`.
"""
from __future__ import annotations

import json
import sys
from collections import Counter

import click


def _common(values) -> int:
    """The value most MoE layers share (the larger on a tie); 0 with no MoE layers."""
    counts = Counter(values)
    return max(counts, key=lambda v: (counts[v], v)) if counts else 0


def summarize(ir) -> dict:
    """Model-level figures from the IR. Per-layer MoE figures are the most common layer's.

    Keys: name, architecture, source_format, dtype, hidden_size, vocab_size, stages (count),
    moe_layers, num_experts (routed, per layer), top_k, shared_experts (per layer),
    uniform_moe_layers (all MoE layers alike), total_params, total_param_bytes, expert_params and
    expert_param_bytes (one routed expert), routed_expert_params/_bytes (all routed experts),
    dense_params/dense_param_bytes (everything but routed experts: what every replica carries),
    active_params_per_token (dense + top_k experts per layer, the input embedding included),
    active_params_per_token_excluding_embedding (the model-card convention), quantization
    (checkpoint storage of quantized weights, "" if none), flops_per_token (IR total).
    """
    moe = ir.moe_stages
    routed_params = sum(s.num_experts * s.expert_params for s in moe)
    routed_bytes = sum(s.num_experts * s.expert_param_bytes for s in moe)
    return {
        "name": ir.name,
        "architecture": ir.architecture,
        "source_format": ir.source_format,
        "dtype": ir.dtype,
        "hidden_size": ir.hidden_size,
        "vocab_size": ir.vocab_size,
        "stages": len(ir.stages),
        "moe_layers": len(moe),
        "num_experts": _common(s.num_experts for s in moe),
        "top_k": _common(s.top_k for s in moe),
        "shared_experts": _common(s.shared_experts for s in moe),
        "uniform_moe_layers": len({(s.num_experts, s.top_k, s.expert_params, s.shared_experts) for s in moe}) <= 1,
        "total_params": ir.total_params,
        "total_param_bytes": ir.total_param_bytes,
        "expert_params": _common(s.expert_params for s in moe),
        "expert_param_bytes": _common(s.expert_param_bytes for s in moe),
        "routed_expert_params": routed_params,
        "routed_expert_param_bytes": routed_bytes,
        "dense_params": ir.dense_params,
        "dense_param_bytes": ir.total_param_bytes - routed_bytes,
        "active_params_per_token": ir.active_params,
        "active_params_per_token_excluding_embedding": ir.active_params_excluding_embedding,
        "quantization": ir.quantization,
        "flops_per_token": ir.flops_per_token,
    }


def _count(n: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(int(n))


def _bytes(n: float) -> str:
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def _render(ir, summary: dict, has_weights: bool, notes=(), table_rows: bool = True) -> None:
    from rich.console import Console
    from rich.table import Table

    # Piped output keeps full rows (rich would squeeze it into 80 columns).
    console = Console(soft_wrap=False, width=None if sys.stdout.isatty() else 140)
    title = f"{ir.name} ({ir.architecture}, {ir.dtype}" + (f", {ir.quantization} storage" if ir.quantization else "") + ")"
    if table_rows:
        table = Table(title=title, title_justify="left")
        for header in ("stage", "kind", "params", "bytes", "FLOPs/token", "experts", "top-k", "shared"):
            table.add_column(header, justify="left" if header in ("stage", "kind") else "right", no_wrap=True)
        for s in ir.stages:
            moe = s.is_moe
            table.add_row(
                s.name, s.kind, _count(s.params), _bytes(s.param_bytes), _count(s.flops_per_token),
                str(s.num_experts) if moe else "", str(s.top_k) if moe else "",
                str(s.shared_experts) if moe and s.shared_experts else "",
            )
        console.print(table)
    else:
        kinds = Counter(s.kind for s in ir.stages)
        console.print(f"{title}: {len(ir.stages)} stages (" + ", ".join(f"{n} {k}" for k, n in kinds.items()) + ")",
                      highlight=False)
    lines = [
        ("total", f"{_count(summary['total_params'])} params, {_bytes(summary['total_param_bytes'])}"
                  + ("" if has_weights else " (no weights: built from the config)")),
        ("MoE layers", f"{summary['moe_layers']} x {summary['num_experts']} routed experts, top-{summary['top_k']}"
                       + (f", {summary['shared_experts']} shared" if summary["shared_experts"] else "")),
        ("per expert", f"{_count(summary['expert_params'])} params, {_bytes(summary['expert_param_bytes'])}"),
        ("dense", f"{_count(summary['dense_params'])} params, {_bytes(summary['dense_param_bytes'])}"
                  " (everything but routed experts)"),
        ("active/token", f"{_count(summary['active_params_per_token_excluding_embedding'])} params without the "
                         f"input embedding (model-card convention), {_count(summary['active_params_per_token'])} "
                         f"with it; {_count(summary['flops_per_token'])} FLOPs"),
    ]
    lines += [("note", note) for note in notes]
    for label, text in lines:
        console.print(f"[bold]{label:>12}[/bold]  {text}", highlight=False)


@click.command()
@click.argument("model")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (summary keys + the full IR).")
@click.option("--summary", "summary_only", is_flag=True,
              help="Only the totals (no per-stage table; large models have hundreds of stages). "
                   "With --json: the summary keys without the IR.")
def inspect(model, as_json, summary_only):
    """Show MODEL's stages, experts, top-k, parameter bytes and FLOPs per token.

    Active parameters are printed two ways: without the input embedding (how model cards count
    them: a token looks up one row) and with it.
    """
    from moeplan.passes.importers import load_model

    loaded = load_model(model)
    summary = summarize(loaded.ir)
    if as_json:
        out = {"model": model, "has_weights": loaded.has_weights, **summary, "notes": list(loaded.notes)}
        if not summary_only:
            out["ir"] = loaded.ir.to_dict()
        click.echo(json.dumps(out, indent=2, sort_keys=True))
    else:
        _render(loaded.ir, summary, loaded.has_weights, loaded.notes, table_rows=not summary_only)
