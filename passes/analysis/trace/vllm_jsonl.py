"""Convert vLLM-style JSONL routing logs into a moeplan routing trace.

Serving stacks log routing one record per token and MoE layer:

    {"problem_id": "req-7", "layer": 3, "token_idx": 0, "experts": [5, 1], "gating_probs": [0.7, 0.3]}

Mapping onto the trace format (docs/formats.md, "Routing trace"):
* `sequence`: problem ids (any JSON string or integer) numbered 0, 1, ... in the order each
  first appears in the log; the trace's tokens are ordered by that number, then by `token_idx`.
* `positions`: `token_idx`.
* MoE layers: the distinct `layer` values sorted ascending; trace layer l is the l-th of them
  (so logs that number layers 3..60 because layers 0..2 are dense still give 58 MoE layers).
* `experts` / `weights`: each record's choices, reordered heaviest first by `gating_probs`
  (ties keep the logged order); without `gating_probs`, weights are 1/K in logged order.
  -1 means "no expert". Every record must have the same number of choices K.
* Every (problem, token) must have a record for every layer, exactly once.
Any malformed record stops the import with one `UserError` naming the file, the line and the fix.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from collections.abc import Iterable

import numpy as np

from moeplan.runtime.ep.expert_table import heaviest_first
from moeplan.passes.analysis.trace.format import INT32_MAX, VALUE_BOUNDS, Trace, make_trace
from moeplan.core.errors import UserError

REQUIRED_KEYS = ("problem_id", "layer", "token_idx", "experts")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)) and math.isfinite(value)


class _LogParser:
    """Accumulates validated records; `where(n)` names the file and line in every error."""

    def __init__(self, source: str):
        self.source = source
        self.problems: dict = {}  # problem id -> sequence number, first-seen order
        self.records: dict = {}  # (sequence, token_idx, layer) -> (line, experts, probs)
        self.top_k: int | None = None
        self.has_probs: bool | None = None

    def fail(self, line: int, problem: str) -> None:
        raise UserError(f"{self.source} line {line}: {problem}; fix or remove that line")

    def add_line(self, line_no: int, text: str) -> None:
        if not text.strip():
            return
        try:
            record = json.loads(text)
        except (json.JSONDecodeError, RecursionError) as exc:
            msg = exc.msg if isinstance(exc, json.JSONDecodeError) else "nested too deeply"
            self.fail(line_no, f"not valid JSON ({msg})")
        if not isinstance(record, dict):
            self.fail(line_no, f"expected a JSON object, got {type(record).__name__}")
        missing = [key for key in REQUIRED_KEYS if key not in record]
        if missing:
            self.fail(line_no, f"record has no {', '.join(repr(k) for k in missing)} "
                               f"(each record needs {', '.join(REQUIRED_KEYS)}, optionally gating_probs)")
        problem = record["problem_id"]
        if not (isinstance(problem, str) or _is_int(problem)):
            self.fail(line_no, f"'problem_id' must be a string or an integer, got {json.dumps(problem)[:40]}")
        for key in ("layer", "token_idx"):
            if not _is_int(record[key]) or not 0 <= record[key] <= INT32_MAX:
                self.fail(line_no, f"'{key}' must be a non-negative integer (at most {INT32_MAX}), got {json.dumps(record[key])[:40]}")
        experts = record["experts"]
        if not isinstance(experts, list) or not experts or not all(_is_int(e) for e in experts):
            self.fail(line_no, f"'experts' must be a non-empty list of integer expert ids, got {json.dumps(experts)[:60]}")
        if any(e < -1 for e in experts):
            self.fail(line_no, "'experts' holds an id below -1 (use -1 for 'no expert')")
        if any(e > VALUE_BOUNDS["experts"][1] for e in experts):
            self.fail(line_no, f"'experts' holds an id above {VALUE_BOUNDS['experts'][1]}; the ids are corrupt")
        if self.top_k is None:
            self.top_k = len(experts)
        elif len(experts) != self.top_k:
            self.fail(line_no, f"'experts' has {len(experts)} entries but earlier records have {self.top_k}")
        probs = record.get("gating_probs")
        has_probs = probs is not None
        if self.has_probs is None:
            self.has_probs = has_probs
        elif has_probs != self.has_probs:
            self.fail(line_no, "some records have 'gating_probs' and others do not; log them for every record or none")
        if has_probs:
            if not isinstance(probs, list) or not all(_is_number(p) for p in probs):
                self.fail(line_no, f"'gating_probs' must be a list of finite numbers, got {json.dumps(probs)[:60]}")
            if len(probs) != len(experts):
                self.fail(line_no, f"'gating_probs' has {len(probs)} entries but 'experts' has {len(experts)}")
        sequence = self.problems.setdefault(problem, len(self.problems))
        key = (sequence, record["token_idx"], record["layer"])
        if key in self.records:
            first = self.records[key][0]
            self.fail(line_no, f"second record for problem {json.dumps(problem)} token {key[1]} layer {key[2]} "
                               f"(the first is on line {first})")
        self.records[key] = (line_no, experts, probs)

    def trace(self, num_experts: int | None) -> Trace:
        if not self.records:
            raise UserError(f"{self.source} holds no routing records; it should have one JSON object per token and layer")
        layers = sorted({layer for _, _, layer in self.records})
        tokens = sorted({(seq, tok) for seq, tok, _ in self.records})
        layer_index = {layer: i for i, layer in enumerate(layers)}
        if len(self.records) != len(tokens) * len(layers):
            names = {v: k for k, v in self.problems.items()}
            for seq, tok in tokens:
                for layer in layers:
                    if (seq, tok, layer) not in self.records:
                        raise UserError(
                            f"{self.source}: problem {json.dumps(names[seq])} token {tok} has no record for layer "
                            f"{layer} (other tokens have one); log every token at every MoE layer, or drop the token")
        T, L, K = len(tokens), len(layers), self.top_k
        experts = np.empty((T, L, K), dtype=np.int64)
        weights = np.empty((T, L, K), dtype=np.float64) if self.has_probs else None
        row = {token: i for i, token in enumerate(tokens)}
        for (seq, tok, layer), (_, ids, probs) in self.records.items():
            t, l = row[(seq, tok)], layer_index[layer]
            experts[t, l] = ids
            if weights is not None:
                weights[t, l] = probs
        if weights is not None:
            experts, weights = heaviest_first(experts, weights)
        token_arr = np.asarray(tokens, dtype=np.int64).reshape(T, 2)
        try:
            return make_trace(experts, weights, num_experts=num_experts,
                              positions=token_arr[:, 1], sequence=token_arr[:, 0])
        except UserError as exc:
            if num_experts is not None and int(experts.max()) >= num_experts:
                raise UserError(f"{self.source}: {exc}; check --num-experts") from None
            raise UserError(f"{self.source}: {exc}") from None


def parse_routing_log(lines: Iterable[str], source: str = "routing log", num_experts: int | None = None) -> Trace:
    """Trace from JSONL lines (see module doc); `source` names the input in error messages."""
    if num_experts is not None and num_experts <= 0:
        raise UserError(f"--num-experts must be positive, got {num_experts}")
    parser = _LogParser(source)
    for line_no, text in enumerate(lines, start=1):
        parser.add_line(line_no, text)
    return parser.trace(num_experts)


def import_routing_log(path: str | os.PathLike, num_experts: int | None = None) -> Trace:
    """Read a JSONL routing log file into a validated `Trace`."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"routing log '{path}' does not exist; give the JSONL file your routing profiler wrote")
    if not path.is_file():
        raise UserError(f"routing log '{path}' is not a file; give the JSONL file your routing profiler wrote")
    try:
        with open(path, encoding="utf-8") as fh:
            return parse_routing_log(fh, source=str(path), num_experts=num_experts)
    except UnicodeDecodeError:
        raise UserError(f"routing log '{path}' is not UTF-8 text; give the JSONL file your routing profiler wrote") from None
    except OSError as exc:
        raise UserError(f"cannot read routing log '{path}' ({exc.strerror or exc}); check the path and its permissions") from None
