"""One entry point for routing records written by serving engines: detect the format, convert.

Formats (each documented in its own module):
* `sglang`: SGLang expert-distribution dumps (`.pt`, per_token or stat), `sglang_dump.py`;
* `trtllm`: a TensorRT-LLM EXPERT_STATISTIC_PATH directory, `trtllm_stats.py`;
* `vllm-jsonl`: JSONL routing logs, one record per token and layer, `vllm_jsonl.py`.
`auto` decides from the path alone: a directory with `meta_info.json` is TensorRT-LLM, a `.pt`
file or a directory of them is SGLang, anything else is read as JSONL.
"""
from __future__ import annotations

import os
from pathlib import Path

from moeplan.passes.analysis.trace.format import Trace
from moeplan.passes.analysis.trace.sglang_dump import import_sglang_dump
from moeplan.passes.analysis.trace.trtllm_stats import import_trtllm_stats, read_assignments
from moeplan.passes.analysis.trace.vllm_jsonl import import_routing_log
from moeplan.core.errors import UserError

FORMATS = ("auto", "sglang", "trtllm", "vllm-jsonl")


def detect_format(path: Path) -> str:
    """The format `auto` picks for `path` (see module doc)."""
    if path.is_dir():
        if (path / "meta_info.json").is_file():
            return "trtllm"
        if any(p.suffix == ".pt" for p in path.iterdir()):
            return "sglang"
        raise UserError(f"cannot tell the format of directory '{path}': it has neither meta_info.json (TensorRT-LLM "
                        f"statistics) nor .pt files (SGLang dumps); pass --format")
    if path.suffix == ".pt":
        return "sglang"
    return "vllm-jsonl"


def import_engine_trace(path: str | os.PathLike, fmt: str = "auto", num_experts: int | None = None,
                        top_k: int = 1, trtllm_assignments: str | None = None) -> Trace:
    """Convert routing records at `path` into a validated trace.

    `top_k` labels loads-only traces from SGLang stat dumps (which do not record it);
    `trtllm_assignments`: load-balancer YAML mapping TensorRT-LLM slot counts back to experts."""
    path = Path(path)
    if fmt not in FORMATS:
        raise UserError(f"--format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    if not path.exists():
        raise UserError(f"'{path}' does not exist; give the file or directory the serving engine wrote")
    if fmt == "auto":
        fmt = detect_format(path)
    if trtllm_assignments is not None and fmt != "trtllm":
        raise UserError("--trtllm-assignments applies to TensorRT-LLM statistics only (--format trtllm)")
    if fmt == "sglang":
        return import_sglang_dump(path, num_experts=num_experts, top_k=top_k)
    if fmt == "trtllm":
        assignments = read_assignments(trtllm_assignments) if trtllm_assignments is not None else None
        return import_trtllm_stats(path, num_experts=num_experts, assignments=assignments)
    return import_routing_log(path, num_experts=num_experts)
