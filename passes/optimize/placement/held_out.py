"""How a placement's GPU loads will move on traffic it was not planned on, estimated from the planning trace alone.

Why (issue 15): the ILP packs every GPU up to the load cap of the planning trace, and it packs
*affine* experts together: experts the same tokens use, whose loads rise and fall together when
the traffic's topic shifts. On held-out traffic such a GPU's load moves more than a GPU of
EPLB's packing, which mixes unrelated experts, so an ILP placement equal to EPLB's balance on
the planning half was 0.005-0.026 worse on the held-out half. An independent-noise model
(Poisson-like variance per expert) does not see this; the covariance of expert loads does.

Model: cut the planning trace into `CHUNKS` contiguous blocks of sequences (later text differs
from earlier text the way deployment traffic differs from the trace), scale each block's expert
loads to the trace's per-layer total, and take its deviation from the whole trace, scaled by
sqrt(2 / (CHUNKS - 1)) so that its covariance is that of (a held-out trace of the same size minus
this one) when blocks are exchangeable. Each deviation and its negative is one scenario:
    scenarios: float [S = 2 CHUNKS, L, E]   (token units of the planning trace)
A placement's expected held-out max GPU load at layer l is the mean over scenarios of the max
over GPUs of (planning load + scenario deviation), every expert's share split evenly over its
copies as the load metric splits it. On the corpus this predicts held-out max/mean within about
0.01 for EPLB, the layer chain and the ILP alike, and it ranks them as the held-out half does.

How the ILP uses it (`held_out_caps`): the held-out rise of EPLB's balanced packing (expected
max minus planning max) is taken as the rise any placement must accept; a solution whose
expected rise is larger has its layer caps lowered by the excess and is solved again, so that
it is not worse balanced than the packing on unseen traffic for the same cap.
"""
from __future__ import annotations

import numpy as np

from moeplan.passes.optimize.placement.metrics import max_gpu_loads

CHUNKS = 8  # contiguous blocks of the planning trace's sequences (16 scenarios with their negatives)
MIN_TOKENS_PER_CHUNK = 32  # fewer tokens per block: no scenarios (the estimate would be noise)


def load_scenarios(trace, chunks: int = CHUNKS) -> np.ndarray:
    """float [S, L, E]: load deviations a held-out trace of the planning trace's size may show (module docstring).

    Blocks follow the trace's sequence ids in order (token order when it has none). Returns an
    empty [0, L, E] array for traces too short to cut (or loads-only traces)."""
    L, E = trace.num_layers, trace.num_experts
    if trace.loads_only or trace.num_tokens < chunks * MIN_TOKENS_PER_CHUNK or chunks < 2:
        return np.zeros((0, L, E))
    full = trace.expert_loads().astype(np.float64)
    if trace.sequence is not None and len(np.unique(trace.sequence)) >= chunks:
        ids = np.unique(trace.sequence)
        blocks = [np.isin(trace.sequence, part) for part in np.array_split(ids, chunks)]
    else:
        edges = np.linspace(0, trace.num_tokens, chunks + 1).astype(int)
        index = np.arange(trace.num_tokens)
        blocks = [(index >= a) & (index < b) for a, b in zip(edges[:-1], edges[1:])]
    deviations = []
    for rows in blocks:
        block = trace.expert_loads(rows).astype(np.float64)
        scale = np.divide(full.sum(axis=1), block.sum(axis=1), out=np.zeros(L), where=block.sum(axis=1) > 0)
        deviations.append((block * scale[:, None] - full) * np.sqrt(2.0 / (chunks - 1)))
    deviations = np.stack(deviations)
    return np.concatenate([deviations, -deviations])


def expected_max_loads(hosts: np.ndarray, loads: np.ndarray, scenarios: np.ndarray) -> np.ndarray:
    """float [L]: expected held-out max GPU load per layer of bool [L, E, D] hosts, from float [L, E]
    planning loads and float [S, L, E] scenarios (the planning max when there are none)."""
    out = np.empty(len(hosts))
    for l in range(len(hosts)):
        x = hosts[l].astype(np.float64)
        copies = x.sum(axis=1)
        planned = (loads[l] / copies) @ x
        if len(scenarios) == 0:
            out[l] = planned.max()
            continue
        moved = planned[None, :] + (scenarios[:, l, :] / copies[None, :]) @ x  # [S, D]
        out[l] = moved.max(axis=1).mean()
    return out


def held_out_caps(hosts: np.ndarray, packed: np.ndarray, loads: np.ndarray, caps: np.ndarray, current: np.ndarray,
                  scenarios: np.ndarray, floor: np.ndarray) -> np.ndarray:
    """float [L]: the caps `current` lowered by how much more a solution's expected held-out max rises than the packing's.

    hosts: bool [L, E, D] a solution meeting `current` (<= caps, the requested caps) on the planning
    trace; packed: bool [L, E, D] EPLB's balanced packing; floor: float [L], no cap goes below it.
    A layer may reach caps + the packing's expected rise on held-out traffic; one whose expected
    max goes beyond gets the excess taken off its planning max, the others keep `current`."""
    planned_max = max_gpu_loads(hosts, loads)
    allowed = held_out_allowance(packed, loads, caps, scenarios)
    excess = np.maximum(expected_max_loads(hosts, loads, scenarios) - allowed, 0.0)
    lowered = np.maximum(np.minimum(current, planned_max) - excess, floor)
    return np.where(excess > 1e-9 * caps, np.minimum(lowered, current), current)


def held_out_allowance(packed: np.ndarray, loads: np.ndarray, caps: np.ndarray, scenarios: np.ndarray) -> np.ndarray:
    """float [L]: the expected held-out max a layer may reach: its cap plus the rise of EPLB's packing (bool [L, E, D])."""
    return caps + np.maximum(expected_max_loads(packed, loads, scenarios) - max_gpu_loads(packed, loads), 0.0)
