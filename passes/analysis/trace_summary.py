"""What a plan keeps of its planning trace, so that `moeplan report BUNDLE` draws load balance and
affinity without the trace (plan.json `inputs.trace_summary`; docs/report.md).

* `expert_loads`: per MoE layer, the token-expert assignments of every expert (`Trace.expert_loads`),
  one line of space-separated integers per layer: L lines of E numbers, small beside the placement
  the plan already holds (DeepSeek-V3: 58 lines of 256), and the same numbers the planner balanced.
* `affinity`: the layer pair with the most transitions between experts that share no GPU under the
  plan's placement (the pair the report's heatmap draws), as transition counts between its
  `MAX_AFFINITY_EXPERTS` busiest source and destination experts, one line per source expert, with
  each source's transitions to every expert (`row_tokens`), so P(b | a) = counts[a][b] / row_tokens[a].

Both are functions of the trace and the placement alone: the same inputs give the same bytes.
Shapes: L MoE layers, E experts, D devices.
"""
from __future__ import annotations

import numpy as np

MAX_AFFINITY_EXPERTS = 32


def number_lines(matrix) -> list:
    """int [R, C] -> R lines of C space-separated integers."""
    return [" ".join(str(int(v)) for v in row) for row in np.asarray(matrix)]


def lines_to_numbers(lines) -> np.ndarray:
    """The inverse of `number_lines`: int64 [R, C] (one-line ValueError on a ragged or non-integer table)."""
    rows = [[int(v) for v in str(line).split()] for line in lines]
    if rows and len({len(r) for r in rows}) != 1:
        raise ValueError("trace_summary rows differ in length")
    return np.array(rows, dtype=np.int64).reshape(len(rows), len(rows[0]) if rows else 0)


def _busiest(totals: np.ndarray, limit: int) -> list:
    """The `limit` indices with the largest totals (ties to the lower index), in index order."""
    order = np.lexsort((np.arange(len(totals)), -totals))
    return sorted(int(i) for i in order[:limit])


def heaviest_crossing_pair(trace, hosts: np.ndarray, limit: int = MAX_AFFINITY_EXPERTS) -> dict | None:
    """The affinity summary of module docstring for `hosts` (bool [L, E, D]); None for a trace without
    per-token routing or with one MoE layer. Transitions: a token's heaviest expert at layer l to each
    of its choices at l + 1 (`passes/analysis/affinity.py: transition_counts`, mode "current")."""
    from moeplan.passes.analysis.affinity import transition_counts

    if trace.loads_only or trace.num_layers < 2:
        return None
    counts = transition_counts(trace, "current")  # [L-1, E_t, E_t]
    Et = counts.shape[1]
    crossing = []
    for l in range(len(counts)):
        colocated = (hosts[l, :Et].astype(np.int64) @ hosts[l + 1, :Et].T.astype(np.int64)) > 0
        crossing.append(float(counts[l][~colocated].sum()))
    l = int(np.argmax(crossing))
    pair = np.rint(counts[l]).astype(np.int64)
    sources = _busiest(pair.sum(axis=1), limit)
    targets = _busiest(pair.sum(axis=0), limit)
    return {"layers": [l, l + 1], "transitions": int(pair.sum()), "crossing": int(round(crossing[l])),
            "num_experts": int(Et), "experts_from": sources, "experts_to": targets,
            "row_tokens": [int(pair[a].sum()) for a in sources],
            "counts": number_lines(pair[np.ix_(sources, targets)])}


def trace_summary(trace, hosts: np.ndarray) -> dict:
    """plan.json `inputs.trace_summary` of the planning `trace` under the placement `hosts` [L, E, D]."""
    out = {"expert_loads": number_lines(trace.expert_loads())}
    pair = heaviest_crossing_pair(trace, hosts)
    if pair is not None:
        out["affinity"] = pair
    return out


def summary_loads(summary: dict, num_experts: int) -> np.ndarray:
    """float [L, E] expert loads of a plan's `inputs.trace_summary`, zeros for experts past the trace's
    (a trace may route to fewer experts than the plan places; never more)."""
    loads = lines_to_numbers(summary["expert_loads"])
    if loads.shape[1] > num_experts:
        raise ValueError(f"trace_summary has {loads.shape[1]} experts per layer, the plan places {num_experts}")
    out = np.zeros((loads.shape[0], num_experts))
    out[:, :loads.shape[1]] = loads
    return out


def affinity_probabilities(pair: dict) -> np.ndarray:
    """float [S, T]: P(next expert b | heaviest expert a) over the summary's source and destination experts."""
    counts = lines_to_numbers(pair["counts"]).astype(float)
    rows = np.asarray(pair["row_tokens"], dtype=float)[:, None]
    return np.divide(counts, rows, out=np.zeros_like(counts), where=rows > 0)
