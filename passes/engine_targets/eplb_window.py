"""vLLM's `--eplb-config` sized from the trace: how fast its expert loads drift, measured across windows.

vLLM 0.32 places experts at startup by a fixed rule (`expert_placement_strategy` linear or
round_robin; `vllm/config/parallel.py`) and, with `--enable-eplb`, re-places them every
`step_interval` engine steps with DeepSeek's EPLB on the expert loads of the last `window_size`
steps (`vllm/config/parallel.py: EPLBConfig`, `vllm/distributed/eplb/policy/default.py`). A short
window follows noise, a long one remembers traffic that has moved on; a placement is worth
keeping until the loads have drifted away from it. Both are measured on the trace:

* the trace is cut into `BLOCKS` consecutive blocks of whole sequences, in sequence-id order (the
  order requests arrived in), or of tokens in trace order where it has no sequence ids (an engine
  dump's order, which is already the engine's), as `passes/optimize/placement/held_out.py` cuts it;
  each block's expert loads float [L, E]. Whole sequences, because an engine step mixes the tokens
  of every running request: the drift it sees is that of the request mix, not the topic changes
  inside one request;
* window: for W in 1, 2, 4, ... blocks (up to half the trace), EPLB is run on the loads of blocks
  t-W .. t-1 and scored on block t (mean over MoE layers of max/mean EP-rank load, each expert's
  load split evenly over its copies, as vLLM dispatches over replicas), averaged over up to
  `MAX_STARTS` ends t; the window is the W of lowest held-out max/mean (ties: the longer). When
  that is the longest W tried, the trace cannot show where a longer window stops helping, and
  vLLM's default window is kept where it is longer;
* interval: the best window's placements are scored a = 0, 1, ... blocks later; `drift[a]` is the
  mean rise of max/mean over a = 0, and the rise per block is its least-squares slope through the
  origin (one number from every age, so that the noise of single blocks averages out). A placement
  is kept until it has lost `DRIFT_TOLERANCE` (one point of max/mean: about 1 % of the MoE layers'
  time): tolerance / slope blocks. When the slope is not positive, or that is longer than the ages
  the trace measures, no drift was seen: the interval is the measured span, or vLLM's default
  where that is longer;
* blocks become engine steps at `tokens_per_step` tokens a step: every running request decodes one
  token per step, so a full batch of `max_running_requests` (vLLM's `max_num_seqs` per
  data-parallel engine times the engines where it is not set). Under a lighter load a step carries
  fewer tokens and the same number of steps spans fewer tokens than measured.

A block that mixes fewer requests than one engine step (fewer sequences, or tokens without sequence ids,
than `tokens_per_step`) varies more than the engine's steps do, and that noise reads as drift: the
measurement then carries a `caveat` saying so (plan.json `predicted.load_drift.caveat`, the bundle's
README); the config is still the measured one.

Loads-only traces, and traces too short to cut (fewer than `BLOCKS` sequences, or fewer than
`MIN_BLOCK_TOKENS` tokens a block), have no order to measure: vLLM's own defaults are kept and the
plan says why. For speed the measure runs on at most `MAX_LAYERS` MoE layers, evenly spaced (drift
is a property of the traffic, which every layer sees).
"""
from __future__ import annotations

import math

import numpy as np

from moeplan.passes.optimize.placement.algorithms.eplb import eplb_placement
from moeplan.passes.optimize.placement.schema import Topology

BLOCKS = 32
MIN_BLOCK_TOKENS = 16
MAX_LAYERS = 8
MAX_STARTS = 8  # scored window ends per W, evenly spaced over those the trace allows
DRIFT_TOLERANCE = 0.01
# vLLM 0.32 `EPLBConfig` defaults, kept where nothing can be measured
VLLM_WINDOW_SIZE, VLLM_STEP_INTERVAL = 1000, 3000
# vLLM 0.32 `SchedulerConfig.DEFAULT_MAX_NUM_SEQS`: max_num_seqs per engine where none is given
VLLM_DEFAULT_MAX_NUM_SEQS = 128


def too_short(trace, blocks: int = BLOCKS) -> str | None:
    """Why the trace cannot be cut into `blocks` blocks (module docstring), or None when it can."""
    if trace.loads_only:
        return "the trace holds loads only: no order to measure drift in"
    if trace.num_tokens < blocks * MIN_BLOCK_TOKENS:
        return f"the trace's {trace.num_tokens} tokens are fewer than {blocks} blocks of {MIN_BLOCK_TOKENS}"
    if trace.sequence is not None and len(np.unique(trace.sequence)) < blocks:
        return f"the trace's {len(np.unique(trace.sequence))} sequences are fewer than {blocks} blocks"
    return None


def block_loads(trace, blocks: int = BLOCKS) -> np.ndarray:
    """float [blocks, L, E]: expert loads of consecutive blocks (whole sequences in id order, else tokens in
    trace order) of a trace that `too_short` accepts."""
    if trace.sequence is None:
        parts = np.array_split(np.arange(trace.num_tokens), blocks)
    else:
        parts = [np.isin(trace.sequence, ids) for ids in np.array_split(np.unique(trace.sequence), blocks)]
    return np.stack([trace.expert_loads(rows).astype(np.float64) for rows in parts])


def max_over_mean(hosts: np.ndarray, loads: np.ndarray) -> float:
    """Mean over layers of max/mean GPU load of bool [L, E, D] hosts on float [L, E] loads."""
    copies = hosts.sum(axis=2)  # [L, E]
    gpu = np.einsum("le,led->ld", loads / copies, hosts.astype(np.float64))  # [L, D]
    mean = gpu.mean(axis=1)
    ok = mean > 0
    return float(np.mean(gpu.max(axis=1)[ok] / mean[ok])) if ok.any() else 1.0


def _starts(first: int, last: int) -> list:
    """At most MAX_STARTS window ends in first..last, evenly spaced."""
    if last < first:
        return []
    return sorted(set(np.linspace(first, last, min(MAX_STARTS, last - first + 1)).round().astype(int).tolist()))


def measure_drift(blocks: np.ndarray, topology: Topology, redundant: int, expert_groups: int) -> dict:
    """Held-out max/mean per window W (blocks) and the rise with age of the best window's placements.

    blocks: float [B, L, E]. Returns {"windows": [{"blocks": W, "max_over_mean"}, ...], "window_blocks",
    "longest_window" (bool: the best is the longest tried), "drift": [rise at age a], "rise_per_block",
    "interval_blocks" (float, or None when no drift was seen within the "span_blocks" measured)}."""
    B, L, _ = blocks.shape
    layers = np.unique(np.linspace(0, L - 1, min(MAX_LAYERS, L)).round().astype(int))
    blocks = blocks[:, layers]
    place = {}  # (W, t) -> hosts, shared by the window and the age measures

    def hosts(W: int, t: int) -> np.ndarray:
        if (W, t) not in place:
            place[W, t] = eplb_placement(blocks[t - W:t].sum(axis=0), topology, redundant, expert_groups)
        return place[W, t]

    windows = {}
    W = 1
    while W <= B // 2:
        windows[W] = float(np.mean([max_over_mean(hosts(W, t), blocks[t]) for t in _starts(W, B - 1)]))
        W *= 2
    best = min(windows, key=lambda w: (round(windows[w], 6), -w))
    ends = _starts(best, (B + best) // 2)  # every end leaves at least a quarter of the trace's blocks of ages
    span = B - max(ends)
    fresh = np.mean([max_over_mean(hosts(best, t), blocks[t]) for t in ends])
    drift = [float(np.mean([max_over_mean(hosts(best, t), blocks[t + age]) for t in ends]) - fresh)
             for age in range(span)]
    ages = np.arange(span, dtype=np.float64)
    slope = float(ages @ np.array(drift) / (ages @ ages)) if span > 1 else 0.0
    interval = DRIFT_TOLERANCE / slope if slope > 0 and DRIFT_TOLERANCE / slope < span else None
    return {"windows": [{"blocks": w, "max_over_mean": v} for w, v in windows.items()], "window_blocks": best,
            "longest_window": best == max(windows), "drift": drift, "rise_per_block": slope,
            "interval_blocks": interval, "span_blocks": span}


def tokens_per_step(max_running_requests: int | None, attention_dp: int) -> int:
    """Tokens one engine step decodes over the deployment (module docstring)."""
    if max_running_requests is not None:
        return int(max_running_requests)
    return VLLM_DEFAULT_MAX_NUM_SEQS * attention_dp


def _steps(tokens: float, per_step: int) -> int:
    return max(1, math.ceil(tokens / per_step))


def eplb_config(trace, topology: Topology, redundant: int, expert_groups: int, max_running_requests: int | None,
                attention_dp: int) -> tuple:
    """(vLLM's `--eplb-config` {window_size, step_interval, num_redundant_experts}, the measurement for
    plan.json `predicted.load_drift`)."""
    per_step = tokens_per_step(max_running_requests, attention_dp)
    why = too_short(trace)
    if why is not None:
        config = {"window_size": VLLM_WINDOW_SIZE, "step_interval": VLLM_STEP_INTERVAL,
                  "num_redundant_experts": int(redundant)}
        return config, {"measured": False, "reason": why + "; vLLM's default window and interval are kept"}
    measure = measure_drift(block_loads(trace), topology, redundant, expert_groups)
    block_tokens = trace.num_tokens / BLOCKS
    window = _steps(measure["window_blocks"] * block_tokens, per_step)
    if measure["longest_window"]:
        window = max(window, VLLM_WINDOW_SIZE)
    if measure["interval_blocks"] is None:
        interval = max(_steps(measure["span_blocks"] * block_tokens, per_step), VLLM_STEP_INTERVAL)
    else:
        interval = _steps(measure["interval_blocks"] * block_tokens, per_step)
    config = {"window_size": window, "step_interval": interval, "num_redundant_experts": int(redundant)}
    measured = {"measured": True, "blocks": BLOCKS, "block_tokens": round(block_tokens, 3), "tokens_per_step": per_step,
                "tolerance": DRIFT_TOLERANCE, **measure}
    caveat = small_block_caveat(trace, block_tokens, per_step)
    if caveat is not None:
        measured["caveat"] = caveat
    return config, measured


def small_block_caveat(trace, block_tokens: float, per_step: int) -> str | None:
    """Why the measure may overstate the drift, or None: a block that mixes fewer requests (fewer tokens,
    for a trace without sequence ids) than one engine step does varies more from block to block than the
    engine's steps do, and that noise reads as drift (a shorter window and interval than the engine needs)."""
    if trace.sequence is not None:
        mixed, unit = len(np.unique(trace.sequence)) / BLOCKS, "sequences"
    else:
        mixed, unit = block_tokens, "tokens"
    if mixed >= per_step:
        return None
    return (f"each block holds {mixed:.3g} {unit}, fewer than the {per_step} requests one engine step mixes: block-to-block "
            f"noise reads as drift, so the window and interval may be shorter than the engine needs; a trace of at "
            f"least {BLOCKS * per_step} {unit} measures at the engine's scale")
