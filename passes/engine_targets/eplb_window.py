"""vLLM's `--eplb-config` sized from the trace: how fast its expert loads drift, measured across windows.

vLLM 0.32 places experts at startup by a fixed rule (`expert_placement_strategy` linear or
round_robin; `vllm/config/parallel.py`) and, with `--enable-eplb`, re-places them every
`step_interval` engine steps with DeepSeek's EPLB on the expert loads of the last `window_size`
steps (`vllm/config/parallel.py: EPLBConfig`, `vllm/distributed/eplb/policy/default.py`). A short
window follows noise, a long one remembers traffic that has moved on; a placement is worth
keeping until the loads have drifted away from it. Both are measured on the trace:

* the trace is cut into `BLOCKS` consecutive blocks (in sequence order, token order without
  sequence ids, as `passes/optimize/placement/held_out.py` cuts it), each block's expert loads
  float [L, E];
* window: for W in 1, 2, 4, ... blocks (up to half the trace), EPLB is run on the loads of blocks
  t-W .. t-1 and scored on block t (mean over MoE layers of max/mean EP-rank load, each expert's
  load split evenly over its copies, as vLLM dispatches over replicas), averaged over every t the
  trace allows; the window is the W of lowest held-out max/mean (ties: the longer);
* interval: the same placements are scored a blocks later (a = 0, 1, ...); `drift[a]` is the mean
  rise of max/mean over a = 0. The placement is kept while the rise stays within
  `DRIFT_TOLERANCE` (one point of max/mean: about 1 % of the MoE layers' time), so the interval is
  the first a whose rise exceeds it (the whole measured span when none does);
* blocks become engine steps at `tokens_per_step` tokens a step: every running request decodes one
  token per step, so a full batch of `max_running_requests` (vLLM's `max_num_seqs` per
  data-parallel engine times the engines where it is not set). Under a lighter load a step carries
  fewer tokens and the same number of steps spans fewer tokens than measured.

Loads-only traces and traces too short to cut (fewer than `MIN_BLOCK_TOKENS` per block) have no
order to measure: vLLM's own defaults are kept and the plan says why. For speed the measure runs
on at most `MAX_LAYERS` MoE layers, evenly spaced (drift is a property of the traffic, which
every layer sees).
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


def block_loads(trace, blocks: int = BLOCKS) -> np.ndarray | None:
    """float [blocks, L, E]: expert loads of consecutive blocks (sequence order), or None when the trace
    is loads-only or too short."""
    if trace.loads_only or trace.num_tokens < blocks * MIN_BLOCK_TOKENS:
        return None
    order = np.arange(trace.num_tokens)
    if trace.sequence is not None:
        order = np.argsort(trace.sequence, kind="stable")
    return np.stack([trace.expert_loads(rows).astype(np.float64) for rows in np.array_split(order, blocks)])


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

    blocks: float [B, L, E]. Returns {"windows": {W: max/mean}, "window_blocks", "drift": [rise at age a],
    "interval_blocks"}."""
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
        ends = _starts(W, B - 1)
        windows[W] = float(np.mean([max_over_mean(hosts(W, t), blocks[t]) for t in ends]))
        W *= 2
    best = min(windows, key=lambda w: (round(windows[w], 6), -w))
    ends = _starts(best, (B + best) // 2)  # every end leaves at least half the remaining blocks of ages
    span = B - max(ends)
    drift = []
    for age in range(span):
        fresh = [max_over_mean(hosts(best, t), blocks[t]) for t in ends]
        aged = [max_over_mean(hosts(best, t), blocks[t + age]) for t in ends]
        drift.append(float(np.mean(aged) - np.mean(fresh)))
    beyond = [a for a, rise in enumerate(drift) if rise > DRIFT_TOLERANCE]
    interval = beyond[0] if beyond else span
    return {"windows": {str(w): v for w, v in windows.items()}, "window_blocks": best, "drift": drift,
            "interval_blocks": max(1, interval)}


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
    blocks = block_loads(trace)
    if blocks is None:
        why = ("the trace holds loads only: no order to measure drift in" if trace.loads_only else
               f"the trace's {trace.num_tokens} tokens are fewer than {BLOCKS} blocks of {MIN_BLOCK_TOKENS}")
        config = {"window_size": VLLM_WINDOW_SIZE, "step_interval": VLLM_STEP_INTERVAL,
                  "num_redundant_experts": int(redundant)}
        return config, {"measured": False, "reason": why + "; vLLM's default window and interval are kept"}
    measure = measure_drift(blocks, topology, redundant, expert_groups)
    block_tokens = trace.num_tokens / BLOCKS
    config = {"window_size": _steps(measure["window_blocks"] * block_tokens, per_step),
              "step_interval": _steps(measure["interval_blocks"] * block_tokens, per_step),
              "num_redundant_experts": int(redundant)}
    return config, {"measured": True, "blocks": BLOCKS, "block_tokens": round(block_tokens, 3),
                    "tokens_per_step": per_step, "tolerance": DRIFT_TOLERANCE, **measure}
