"""The trace pass (`trace_path` -> `trace`, `trace_sha256`) and the check that a trace was recorded
from the model it plans (the precondition of every pass that reads both)."""
from __future__ import annotations

from pathlib import Path

from moeplan.core.errors import UserError
from moeplan.core.pass_manager import Pass


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


TRACE = Pass("trace", ("trace_path",), ("trace", "trace_sha256"), _trace)
