"""Operator profiling pass: time and memory of every dense stage and every expert on this machine.

Why measure: serverless cost is memory x seconds, and the seconds of a small expert at a small
vCPU share are dominated by per-call overheads no FLOP count predicts. The pass
* times each unit (each expert; each dense stage; the router is counted from its FLOPs) at
  several token batch sizes and thread counts: one warm-up call, then repeated calls until at
  least `MIN_REPS` calls and `MIN_TIME_S` have passed (see `_time_call` for why CPU-time medians
  at one thread and wall-time minima at several; timings on a loaded machine stay noisy, so
  plans made from a fresh profile can differ - profiles are cached by model hash so re-planning
  is repeatable);
* counts peak intermediate memory exactly (`peak_memory.py`);
* fits XGBoost predictors and reports their RMSLE on held-out measurements;
* derives per-token expert compute time U_j at every memory option of a platform from its
  vCPU share v_j: U_j(n) = min over measured thread counts t of time_t(n)/n * max(1, t / v_j)
  (below one vCPU a function gets v_j of one core; above it, t threads need t vCPUs).
Units whose module cannot run (meta-device weights, unknown structure) are estimated from their
FLOPs and a measured GEMM rate, and marked `estimated`.
The profiling budget (seconds) bounds the optional measurements: the first unit of every distinct
shape (kind, FLOPs, parameter bytes, module class) is always measured; the others (the remaining
experts and repeated blocks) are added while budget remains. Every unit of the IR gets a
prediction, measured or not, from the XGBoost predictors.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import platform as pyplatform
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Callable

import numpy as np

from moeplan.passes.analysis.profile.predictor import features, fit_predictors
from moeplan.core.atomic import write_text_atomic
from moeplan.core.ir import ModelIR, dtype_bytes

PROFILE_VERSION = 2
DEFAULT_TOKENS = (8, 64, 512, 2048)
DEFAULT_BUDGET_S = 5.0
MIN_REPS = 3
MIN_TIME_S = 0.002
MIN_TIME_MULTI_S = 0.05
MAX_REPS = 25
SEQ_LEN = 128
DEFAULT_CACHE_DIR = "default"  # sentinel: `default_cache_dir()`, the same directory whatever the cwd


def default_cache_dir() -> Path:
    """$MOEPLAN_CACHE_DIR, else $XDG_CACHE_HOME/moeplan/profiles, else ~/.cache/moeplan/profiles:
    absolute, so the same compile run from another directory finds the same profile."""
    if os.environ.get("MOEPLAN_CACHE_DIR"):
        return Path(os.environ["MOEPLAN_CACHE_DIR"]).expanduser().resolve()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base).resolve() / "moeplan" / "profiles"


@dataclass
class Unit:
    """One thing a function runs: an expert or a dense stage, with how to build its input."""

    name: str
    kind: str           # "expert" | "dense"
    group: str          # "head" | "layer<e>" | "tail"
    flops_per_token: int
    param_bytes: int
    module: object | None = None
    make_input: Callable | None = None
    mandatory: bool = True
    rank: int = 0   # how many units of the same shape come before this one
    hidden: int = 1  # model width, for estimating intermediates of units that cannot run


def default_threads() -> tuple:
    n = os.cpu_count() or 1
    return tuple(sorted({1, min(2, n)}))


def model_units(ir: ModelIR, module=None) -> list:
    """Units of the model in IR order; dense stages grouped into head / per-layer / tail functions."""
    moe_positions = [k for k, s in enumerate(ir.stages) if s.is_moe]
    first_moe, last_moe = moe_positions[0], moe_positions[-1]
    units = []
    moe_seen = 0
    for k, stage in enumerate(ir.stages):
        if stage.is_moe:
            sub = _submodule(module, stage.source)
            experts = getattr(sub, "experts", None) if sub is not None else None
            for i in range(stage.num_experts):
                # one module per expert (ModuleList); fused [E, ...] experts (transformers 5) run as no unit
                per_expert = experts is not None and hasattr(experts, "__len__")
                mod = experts[i] if per_expert and i < len(experts) else None
                units.append(Unit(f"{stage.name}.expert{i}", "expert", f"layer{stage.moe_index}",
                                  stage.expert_flops_per_token, stage.expert_param_bytes,
                                  mod, _float_input(stage.hidden_size)))
            router_bytes = int(stage.router_params * dtype_bytes(stage.dtype))
            units.append(Unit(f"{stage.name}.router", "dense", f"layer{stage.moe_index}",
                              2 * stage.router_params, router_bytes, None, None))
            moe_seen += 1
            continue
        if k < first_moe and stage.kind == "embedding":
            group = "head"
        elif k > last_moe:
            group = "tail"
        else:
            group = f"layer{moe_seen}"
        mod = _submodule(module, stage.source)
        if stage.kind == "embedding":
            make = _id_input(mod)
        else:
            make = _float_input(ir.hidden_size, seq=True)
        units.append(Unit(stage.name, "dense", group, stage.flops_per_token, stage.param_bytes, mod, make))
    seen = {}
    for u in units:
        u.hidden = ir.hidden_size
    for u in units:  # the first unit of every distinct shape is always measured
        sig = (u.kind, u.flops_per_token, u.param_bytes, type(u.module).__name__)
        u.mandatory = sig not in seen or u.module is None
        u.rank = seen.get(sig, 0)
        seen[sig] = u.rank + 1
    return units


def _submodule(module, source):
    if module is None or not source:
        return None
    try:
        sub = module.get_submodule(source)
    except (AttributeError, TypeError):
        return None
    if any(p.is_meta for p in sub.parameters()):
        return None
    return sub


def _float_input(hidden: int, seq: bool = False):
    def make(tokens: int):
        import torch

        g = torch.Generator().manual_seed(tokens)
        if seq:
            s = min(tokens, SEQ_LEN)
            return (torch.randn(math.ceil(tokens / s), s, hidden, generator=g),)
        return (torch.randn(tokens, hidden, generator=g),)
    return make


def _id_input(mod):
    def make(tokens: int):
        import torch

        high = getattr(mod, "num_embeddings", 2) if mod is not None else 2
        s = min(tokens, SEQ_LEN)
        g = torch.Generator().manual_seed(tokens)
        return (torch.randint(0, high, (math.ceil(tokens / s), s), generator=g),)
    return make


def _time_call(fn, inputs, threads: int = 1) -> float:
    """Seconds per call, robust to other processes sharing the CPU.

    One thread: the median of this process's CPU time per call (other processes stretch wall
    time, not the CPU time we consume). Several threads: CPU time would count the intra-op
    pool's spin-waiting, so the minimum wall time over the calls is used (the least disturbed
    run); a disturbed multi-thread measurement only hides a speed-up, which errs on the safe side.
    """
    fn(*inputs)  # warm-up
    samples, start = [], time.perf_counter()
    clock = time.process_time if threads == 1 else time.perf_counter
    min_time = MIN_TIME_S if threads == 1 else MIN_TIME_MULTI_S  # a minimum needs more draws
    while len(samples) < MAX_REPS and (len(samples) < MIN_REPS or time.perf_counter() - start < min_time):
        t0 = clock()
        fn(*inputs)
        samples.append(clock() - t0)
    value = statistics.median(samples) if threads == 1 else min(samples)
    return max(value, 1e-7)


def gemm_flops_per_s(threads: int) -> float:
    """Measured dense matmul rate at `threads`, for units that cannot run."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b = torch.randn(256, 256), torch.randn(256, 256)
        with torch.no_grad():
            t = _time_call(torch.matmul, (a, b), threads)
    finally:
        torch.set_num_threads(old)
    return 2 * 256 ** 3 / t


def measure(units: list, tokens_grid, threads, budget_s: float) -> list:
    """Rows {unit, kind, group, flops_per_token, param_bytes, tokens, threads, seconds, peak_bytes, estimated}."""
    import torch

    from moeplan.passes.analysis.profile.peak_memory import peak_intermediate_bytes

    rates = {t: gemm_flops_per_s(t) for t in threads}
    old = torch.get_num_threads()
    rows, peaks = [], {}
    start = time.perf_counter()
    # optional units round-robin over shapes: every shape gets a second sample before any a third
    optional = sorted((u for u in units if not u.mandatory), key=lambda u: u.rank)
    order = [u for u in units if u.mandatory] + optional
    try:
        for u in order:
            if not u.mandatory and time.perf_counter() - start > budget_s:
                break
            for tokens in tokens_grid:
                inputs = u.make_input(tokens) if (u.module is not None and u.make_input) else None
                real = tokens
                if inputs is not None:
                    real = int(np.prod(inputs[0].shape[:-1])) if inputs[0].dim() == 3 else int(inputs[0].shape[0])
                    if inputs[0].dtype == torch.long:
                        real = int(inputs[0].numel())
                for th in threads:
                    torch.set_num_threads(th)
                    estimated = inputs is None
                    if not estimated:
                        try:
                            with torch.no_grad():
                                secs = _time_call(u.module, inputs, th) * tokens / real
                        except Exception:  # a stage that cannot run alone: estimate it
                            estimated = True
                    if estimated:
                        secs = 2e-5 + u.flops_per_token * tokens / rates[th]
                    key = (u.name, tokens)
                    if key not in peaks:
                        if estimated:
                            # fp32 intermediates: one value per weight column a token passes
                            # through (FLOPs / 2 / hidden) plus the hidden-sized output
                            width = u.flops_per_token / 2 / max(u.hidden, 1) + u.hidden
                            peaks[key] = 4.0 * tokens * width
                        else:
                            torch.set_num_threads(1)
                            peaks[key] = peak_intermediate_bytes(u.module, *inputs) * tokens / real
                    rows.append({"unit": u.name, "kind": u.kind, "group": u.group,
                                 "flops_per_token": int(u.flops_per_token), "param_bytes": int(u.param_bytes),
                                 "tokens": int(tokens), "threads": int(th), "seconds": float(secs),
                                 "peak_bytes": float(peaks[key]), "estimated": bool(estimated)})
    finally:
        torch.set_num_threads(old)
    return rows


@dataclass
class Profile:
    """Measured rows plus what planning derives from them (per thread count, per token grid)."""

    model_hash: str
    tokens_grid: tuple
    threads: tuple
    rows: list
    time_rmsle: float
    memory_rmsle: float
    seconds_spent: float
    groups: dict = field(default_factory=dict)  # group -> {"seconds": [threads][grid], ...}
    cached: bool = False
    time_rmsle_by_threads: dict = field(default_factory=dict)
    load_average: float = 0.0   # 1-minute load when measured: above the core count, timings are disturbed

    def to_dict(self) -> dict:
        return {"version": PROFILE_VERSION, "model_hash": self.model_hash, "tokens_grid": list(self.tokens_grid),
                "threads": list(self.threads), "rows": self.rows, "time_rmsle": self.time_rmsle,
                "memory_rmsle": self.memory_rmsle, "seconds_spent": self.seconds_spent, "groups": self.groups,
                "time_rmsle_by_threads": {str(k): v for k, v in self.time_rmsle_by_threads.items()},
                "load_average": self.load_average}

    @classmethod
    def from_dict(cls, d: dict) -> Profile:
        return cls(d["model_hash"], tuple(d["tokens_grid"]), tuple(d["threads"]), d["rows"], d["time_rmsle"],
                   d["memory_rmsle"], d["seconds_spent"], d["groups"],
                   time_rmsle_by_threads={int(k): v for k, v in d.get("time_rmsle_by_threads", {}).items()},
                   load_average=d.get("load_average", 0.0))


def model_hash(ir: ModelIR, tokens_grid, threads, budget_s) -> str:
    """Key of a profile: the model's IR and the profiling settings on this kind of machine."""
    import torch

    key = json.dumps({"ir": ir.to_dict(), "source_format": ir.source_format, "tokens": list(tokens_grid), "threads": list(threads),
                      "budget": budget_s, "torch": torch.__version__, "machine": pyplatform.machine(),
                      "cpus": os.cpu_count(), "version": PROFILE_VERSION}, sort_keys=True)
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def profile_model(ir: ModelIR, module=None, *, tokens_grid=DEFAULT_TOKENS, threads=None,
                  budget_s: float = DEFAULT_BUDGET_S, cache_dir: str | Path | None = DEFAULT_CACHE_DIR,
                  refresh: bool = False, seed: int = 0, onnx_path: str | None = None) -> Profile:
    """Profile (or load the cached profile of) a model; `cache_dir=None` disables the cache.

    A torch `module` is timed unit by unit; without one, an `onnx_path` is profiled with
    onnxruntime (`profile/onnx_session.py`); with neither, every unit is estimated from its FLOPs.
    """
    threads = tuple(threads or default_threads())
    tokens_grid = tuple(sorted(int(t) for t in tokens_grid))
    h = model_hash(ir, tokens_grid, threads, budget_s)
    if cache_dir == DEFAULT_CACHE_DIR:
        cache_dir = default_cache_dir()
    path = Path(cache_dir) / f"profile-{h}.json" if cache_dir is not None else None
    if path is not None and path.is_file() and not refresh:
        try:
            prof = Profile.from_dict(json.loads(path.read_text()))
            prof.cached = True
            return prof
        except (ValueError, KeyError, TypeError, UnicodeDecodeError, OSError):
            pass  # unreadable cache entry: profile again
    start = time.perf_counter()
    units = model_units(ir, module)
    if module is None and onnx_path is not None:
        from moeplan.passes.analysis.profile.onnx_session import measure_onnx

        rows = measure_onnx(onnx_path, ir, units, tokens_grid, threads)
        measured = {r["unit"] for r in rows}
        rows += list(measure([u for u in units if u.name not in measured], tokens_grid, threads, 0.0))
    else:
        rows = measure(units, tokens_grid, threads, budget_s)
    seconds = time.perf_counter() - start
    X = features([r["flops_per_token"] for r in rows], [r["param_bytes"] for r in rows],
                 [r["tokens"] for r in rows], [r["threads"] for r in rows], [r["kind"] == "expert" for r in rows])
    preds = fit_predictors(X, np.array([r["seconds"] for r in rows]), np.array([r["peak_bytes"] for r in rows]), seed=seed)
    groups = _derive_groups(units, preds, tokens_grid, threads)
    prof = Profile(h, tokens_grid, threads, rows, round(preds.time_rmsle, 6), round(preds.memory_rmsle, 6),
                   round(seconds, 3), groups,
                   time_rmsle_by_threads={k: round(v, 6) for k, v in (preds.time_rmsle_by_threads or {}).items()},
                   load_average=round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else 0.0)
    if path is not None:
        write_text_atomic(path, json.dumps(prof.to_dict(), sort_keys=True) + "\n")
    return prof


def _derive_groups(units, preds, tokens_grid, threads) -> dict:
    """Predicted seconds per token per group/thread/grid point; expert memory as fixed + per token."""
    grid = np.asarray(tokens_grid, float)
    out = {}
    by_group = {}
    for u in units:
        r = {"flops_per_token": u.flops_per_token, "param_bytes": u.param_bytes}
        by_group.setdefault((u.group, u.kind), []).append(r)
    for (group, kind), members in sorted(by_group.items()):
        key = f"{group}.{kind}"
        if kind == "expert":
            members = members[:1]  # experts of a layer share one shape: one prediction
        per_thread = []
        for th in threads:
            total = np.zeros(len(grid))
            for m in members:
                X = features(m["flops_per_token"], m["param_bytes"], grid, th, kind == "expert")
                total += preds.time(X)
            per_thread.append([float(v) for v in total / grid])
        entry = {"s_per_token": per_thread}
        if kind == "expert":
            m = members[0]
            mem = preds.memory(features(m["flops_per_token"], m["param_bytes"], grid, 1, True))
            slope, intercept = np.polyfit(grid, mem, 1)
            entry["mem_per_token"] = float(max(slope, 0.0))
            entry["mem_fixed"] = float(max(intercept, 0.0, float(np.max(mem - max(slope, 0.0) * grid))))
        out[key] = entry
    return out


def u_per_token(s_per_token_by_threads, threads, vcpus: float) -> np.ndarray:
    """Per-token time at a vCPU share: min over thread counts t of time_t * max(1, t / vcpus)."""
    arr = np.asarray(s_per_token_by_threads, float)
    factors = np.array([max(1.0, t / vcpus) for t in threads])[:, None]
    return (arr * factors).min(axis=0)

