"""Passes every target starts with: import the model, find its runtime files, load the trace.

Facts: `model_spec` (path as given) -> `model` (LoadedModel: IR + module); `model_spec` ->
`model_files` ({"architecture": runtime family, "files": {bundle path: bytes}}: what a bundle
ships besides weights; only codegen needs it, so `moeplan plan` never asks for it);
`trace_path` -> `trace`, `trace_sha256`.
"""
from __future__ import annotations

from pathlib import Path

from moeplan.core.errors import UserError
from moeplan.core.pass_manager import Pass


def _import(facts):
    from moeplan.passes.importers import load_model

    return {"model": load_model(facts["model_spec"])}


def _model_files(facts):
    from moeplan.backends.common.model_source import model_files

    arch, files = model_files(facts["model_spec"])
    return {"model_files": {"architecture": arch, "files": files}}


def _trace(facts):
    from moeplan.passes.analysis.trace.format import load_trace, trace_file_sha256

    path = Path(facts["trace_path"])
    return {"trace": load_trace(path), "trace_sha256": trace_file_sha256(path)}


def check_trace_matches(ir, trace, trace_name: str = "the trace") -> None:
    """A trace recorded from another model fails here, before any profiling or solving."""
    moe = ir.moe_stages
    if trace.num_layers != len(moe):
        raise UserError(f"{trace_name} has {trace.num_layers} MoE layers but the model has {len(moe)}; record the trace from this model")
    if trace.num_experts > moe[0].num_experts:
        raise UserError(f"{trace_name} routes to {trace.num_experts} experts but the model has {moe[0].num_experts} per layer")
    if trace.top_k != moe[0].top_k:
        raise UserError(f"{trace_name} records top-{trace.top_k} routing but the model routes each token to "
                        f"top-{moe[0].top_k} experts; record the trace from this model")
    vocab = int(getattr(ir, "vocab_size", 0) or 0)
    if trace.token_ids is not None and vocab > 0 and trace.num_tokens and int(trace.token_ids.max()) >= vocab:
        raise UserError(f"{trace_name} holds token id {int(trace.token_ids.max())} but the model's vocabulary has "
                        f"{vocab} entries; record the trace from this model")


def trace_matches_model(facts) -> None:
    """Precondition of every pass that reads both `model` and `trace`."""
    check_trace_matches(facts["model"].ir, facts["trace"])


def needs_weights(facts) -> None:
    """Precondition of codegen: a bundle ships weights, so a config-only (meta) model cannot compile."""
    if facts["model"].module is None or not facts["model"].has_weights:
        raise UserError(f"model '{facts['model_spec']}' has no weights to ship; compiling a bundle needs a runnable model "
                        "('moeplan plan' plans it without weights)")


def plan_reads_back(facts) -> None:
    """Postcondition of every plan pass: plan.json reads back as the plan that wrote it (what
    `moeplan codegen` and `simulate` will read is what was decided)."""
    from moeplan.core.plan import Plan

    text = facts["plan"].to_json()
    if Plan.from_json(text).to_json() != text:
        raise ValueError("plan.json does not read back as the plan that wrote it")


IMPORT = Pass("import", ("model_spec",), ("model",), _import)
MODEL_FILES = Pass("runtime", ("model_spec",), ("model_files",), _model_files)
TRACE = Pass("trace", ("trace_path",), ("trace", "trace_sha256"), _trace)
