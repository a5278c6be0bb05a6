"""Where rank 0's time goes while the service is under load, from its own stack sampler.

`moeplan serve` started with MOEPLAN_PROFILE=FILE makes rank 0 sample every thread's Python stack
100 times a second and keep the cumulative counts in FILE (benchmarks/stack_sampler.py;
attaching profilers such as py-spy cannot read another process's memory on this project's sandboxed
machines). `snapshot(FILE)` reads the counts; `shares(before, after)` gives the share of the window's
non-idle samples per category, each stack counted once under the first category it touches, in
this order: exchange (the expert-parallel collectives: runtime/ep/exchange.py, context_exchange.py,
torch.distributed; a rank waiting for its peers counts here), attention (the library's attention
modules and kernels), experts (the routed experts the runtime runs: moe_adapter.py), sampling
(serving/sampler.py), other model compute (the rest of the library's forward: norms, routers,
embeddings, head), HTTP front (serving's front files, uvicorn, starlette, asyncio), engine Python
(the step loop, plans, cache rows, batch bookkeeping), other. Samples are wall-clock per thread:
the engine thread's share is where a step's time goes, the front's what serving HTTP costs.

Class names come from the source: each frame's (file, line) is placed in its innermost enclosing
class by parsing the file, so `forward` of `Qwen3MoeAttention` and of `Qwen3MoeSparseMoeBlock` differ.
"""
from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

ORDER = ("exchange", "attention", "experts", "sampling", "other model compute", "HTTP front", "engine Python", "other")
FRONT = ("serving/http_server.py", "serving/openai_service.py", "serving/generation.py", "serving/text_stream.py",
         "serving/api_", "serving/prompt_check.py", "serving/prometheus.py", "uvicorn/", "starlette/", "asyncio/",
         "anyio/", "h11/", "json/")
ENGINE = ("serving/engine_loop.py", "serving/engine_process.py", "serving/scheduler.py", "serving/step_plan.py", "serving/worker.py",
          "serving/row_cache.py", "serving/ranks.py", "runtime/ep/engine.py", "runtime/counters.py", "runtime/ep/expert_table.py")
FRAME = re.compile(r"^(?P<func>.*) \((?P<file>.*):(?P<line>\d+)\)$")


def snapshot(path) -> dict:
    """{collapsed stack: samples} as the sampler last wrote them ({} before its first write)."""
    try:
        text = Path(path).read_text()
    except OSError:
        return {}
    out = {}
    for line in text.splitlines():
        stack, _, n = line.rpartition(" ")
        if stack and n.isdigit():
            out[stack] = int(n)
    return out


def shares(before: dict, after: dict) -> dict:
    """{category: share} of the non-idle samples taken between two snapshots."""
    counts = dict.fromkeys(ORDER, 0)
    for stack, n in after.items():
        n -= before.get(stack, 0)
        if n > 0 and stack != "idle":
            counts[category(stack.split(";"))] += n
    total = sum(counts.values())
    return {c: n / total for c, n in counts.items()} if total else {}


def category(frames: list) -> str:
    found = set()
    for frame in frames:
        m = FRAME.match(frame.strip())
        if not m:
            continue
        path, func = m["file"], m["func"]
        owner = enclosing_class(path, int(m["line"])) or ""
        if any(k in path for k in ("runtime/ep/exchange.py", "context_exchange.py", "distributed_c10d.py")):
            found.add("exchange")
        elif "Attention" in owner or "attention" in func or "sdpa" in path or "attention" in Path(path).name:
            found.add("attention")
        elif "moe_adapter.py" in path:
            found.add("experts")
        elif "serving/sampler.py" in path:
            found.add("sampling")
        elif "/transformers/" in path or "torch/nn/" in path or path.endswith("model.py"):
            found.add("other model compute")
        elif any(k in path for k in FRONT):
            found.add("HTTP front")
        elif any(k in path for k in ENGINE):
            found.add("engine Python")
    return next((c for c in ORDER if c in found), "other")


@functools.cache
def _classes(path: str) -> tuple:
    try:
        tree = ast.parse(Path(path).read_text())
    except (OSError, SyntaxError, ValueError):
        return ()
    return tuple((n.lineno, n.end_lineno, n.name) for n in ast.walk(tree) if isinstance(n, ast.ClassDef))


def enclosing_class(path: str, line: int) -> str | None:
    spans = [(hi - lo, name) for lo, hi, name in _classes(path) if lo <= line <= (hi or lo)]
    return min(spans)[1] if spans else None
