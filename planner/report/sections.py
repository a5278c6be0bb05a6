"""The report's figure sections, each a `Section` of figures with captions and their numbers.

Inputs are plain data: the plan dict and `facts`, what the report command computed from the
plan and a routing trace (planner/commands/report_facts.py); a figure whose facts are missing is
replaced by a note saying what it needs. Shapes: L MoE layers, D devices, E experts.
"""
from __future__ import annotations

import numpy as np

from moeplan.planner.report import charts
from moeplan.planner.report.page import Figure, Note, Num, Section, Table, fmt
from moeplan.planner.report.summary import MS, at, hardware_name, num

EXCHANGES = ("dispatch", "combine", "merge", "context", "token_sync")
TIERS = ("call", "same_node", "other_node")
TIER_NAMES = {"call": "per-call overhead (collective latency, framework work)", "same_node": "same-node messages",
              "other_node": "cross-node messages"}


def trace_note(facts: dict) -> str:
    return facts.get("trace_role_text", "no routing trace given")


# -------------------------------------------------------------------------------- placement

def placement_map(plan: dict, facts: dict) -> Figure:
    """Layers x GPUs coloured by the GPU's share of the layer's load (/ mean), experts written in."""
    layers = at(plan, "placement.layers") or []
    D = len(layers[0]["devices"]) if layers else 0
    loads = facts.get("device_load")  # [L, D] / mean, or None
    counts = [[0] * D for _ in layers]
    copies = [dict() for _ in layers]
    for l, layer in enumerate(layers):
        for experts in layer["devices"]:
            for e in experts:
                copies[l][e] = copies[l].get(e, 0) + 1
    small = D * max((len(x) for layer in layers for x in layer["devices"]), default=0) <= 64 and len(layers) <= 32
    notes = []
    for l, layer in enumerate(layers):
        row = []
        for d, experts in enumerate(layer["devices"]):
            replicas = sum(1 for e in experts if copies[l][e] > 1)
            if small:
                row.append(" ".join(f"{e}*" if copies[l][e] > 1 else str(e) for e in experts))
            else:
                row.append(f"+{replicas}" if replicas else "")
            counts[l][d] = replicas
        notes.append(row)
    if loads is not None:
        matrix, colour = np.asarray(loads), "GPU load / layer mean"
    else:
        matrix, colour = np.array([[counts[l][d] for d in range(D)] for l in range(len(layers))], dtype=float), "replicated experts hosted"
    svg = charts.heatmap("placement-map", matrix, "GPU (rank)", "MoE layer", colour, annotations=notes,
                         xticks=list(range(D)), yticks=[layer["layer"] for layer in layers])
    if len(layers) > charts.MAX_ANNOTATED_ROWS or D > charts.MAX_ANNOTATED_COLS:
        marks = "too many cells to write in; the table below has each GPU's experts and replicas"
    elif small:
        marks = "experts written in each cell, * marking a replicated expert"
    else:
        marks = "+n: replicated experts the GPU hosts"
    caption = (f"Where every expert runs: {len(layers)} MoE layers x {D} GPUs, {marks}. "
               + (f"Colour: the GPU's share of the layer's token-expert assignments over the layer mean ({trace_note(facts)}), "
                  "a replicated expert's load split evenly over its copies."
                  if loads is not None else "Colour: replicated experts per GPU (pass --trace for the loads)."))
    rows = []
    for l, layer in enumerate(layers):
        for d in range(D):
            rows.append([layer["layer"], d, len(layer["devices"][d]), counts[l][d],
                         Num(float(matrix[l, d])) if loads is not None else "n/a"])
    return Figure("placement-map", "Placement map", caption, svg,
                  Table(["layer", "GPU", "experts", "replicated", "load / mean"], rows))


def layer_balance(plan: dict, facts: dict) -> Figure | Note:
    bal = facts.get("layer_balance")
    if not bal:
        return Note("Per-layer load balance needs the routing trace: pass --trace (the planning trace, sha256 "
                    f"{at(plan, 'inputs.trace_sha256')}).")
    layers = bal["layers"]
    series = {k: v for k, v in bal["series"].items() if v is not None}
    svg = charts.grouped_bars("layer-balance", layers, series, "max / mean GPU load", reference=1.0, reference_label="perfect balance")
    names = list(series)
    caption = (f"Per MoE layer, the busiest GPU's load over the mean ({trace_note(facts)}): the plan beside "
               + ", ".join(n for n in names if n != "this plan") + " on the same topology and slot budget. "
               "An MoE layer waits for its busiest GPU.")
    rows = [[layer] + [Num(series[n][i]) for n in names] for i, layer in enumerate(layers)]
    rows.append(["mean"] + [Num(float(np.mean(series[n]))) for n in names])
    return Figure("layer-balance", "Load balance per layer", caption, svg, Table(["layer"] + names, rows))


# ------------------------------------------------------------------------------------- cost

def _candidates(plan: dict) -> list:
    """(label, plan path of a prediction) for the chosen placement under both modes, then every other candidate."""
    out = [(f"chosen placement, {m}", f"predicted.cost.modes.{m}") for m in sorted(at(plan, "predicted.cost.modes") or {})]
    for i, a in enumerate(at(plan, "predicted.cost.alternatives") or []):
        if not a.get("chosen"):
            out.append((f"{a['label']}, {a['mode']}", f"predicted.cost.alternatives.{i}.modes.{a['mode']}"))
    return out


def time_breakdown(plan: dict) -> list:
    cands = _candidates(plan)
    if not cands:
        return [Note("This plan records no cost-model prediction.")]
    first = at(plan, cands[0][1])
    if "exchange_seconds_per_token" not in first:
        return [Note("This plan predates the time breakdown by exchange kind and tier (recompile to see it); "
                     "bytes per token by kind and tier are in the summary.")]
    labels = [c[0] for c in cands]
    by_kind = {"compute": [at(plan, f"{p}.compute_seconds_per_token") * MS for _, p in cands]}
    for k in EXCHANGES:
        values = [sum(at(plan, f"{p}.exchange_seconds_per_token.{k}.{t}") or 0.0 for t in TIERS) * MS for _, p in cands]
        if any(values):
            by_kind[k] = values
    by_tier = {"compute": by_kind["compute"]}
    for t in TIERS:
        by_tier[TIER_NAMES[t]] = [sum(at(plan, f"{p}.exchange_seconds_per_token.{k}.{t}") or 0.0 for k in EXCHANGES) * MS
                                  for _, p in cands]
    hw = hardware_name(plan)

    def figure(key: str, title: str, caption: str, parts: dict) -> Figure:
        """One stacked bar per candidate of `parts` (name -> ms per candidate), and its table."""
        return Figure(key, title, caption, charts.stacked_bars(key, labels, parts, "ms per generated token"),
                      Table(["candidate", "total"] + list(parts),
                            [[lab, num(plan, f"{p}.seconds_per_token", MS, "ms")] + [Num(parts[k][i], unit="ms") for k in parts]
                             for i, (lab, p) in enumerate(cands)]))

    return [figure("time-by-kind", "Time per token by exchange kind",
                   f"Predicted milliseconds per generated token on the {hw} profile (workload {at(plan, 'predicted.cost.workload')}): "
                   "compute, then each exchange the runtime makes, for the chosen placement in both modes and every other candidate "
                   "--policy auto priced (in the mode it would run).", by_kind),
            figure("time-by-tier", "Time per token by link tier",
                   "The same time split by where it goes: compute, the fixed cost of each exchange call (collective latency and "
                   "framework work), and the slowest rank's messages to its own node and to other nodes.", by_tier)]


# --------------------------------------------------------------------------------- affinity

def affinity_heatmap(plan: dict, facts: dict) -> Figure | Note:
    from moeplan.passes.analysis.trace_summary import affinity_probabilities

    aff = facts.get("affinity")
    if not aff:
        return Note("The affinity heatmap needs per-token routing: this plan keeps no affinity summary of its planning "
                    "trace (a loads-only trace, one MoE layer, or a plan made before plans kept it); pass --trace.")
    m = affinity_probabilities(aff)
    l0, l1 = aff["layers"]
    sources, targets = aff["experts_from"], aff["experts_to"]
    svg = charts.heatmap("affinity", m, f"expert at layer {l1}", f"expert at layer {l0}", "P(next expert | current)",
                         xticks=targets, yticks=sources)
    shown = "" if min(len(sources), len(targets)) >= aff["num_experts"] else \
        f" Shown: the {len(sources)} busiest source and {len(targets)} busiest destination experts of {aff['num_experts']}."
    caption = (f"Inter-layer affinity of the heaviest layer pair, {l0} -> {l1}: the pair with the most transitions between "
               f"experts that share no GPU under this plan ({aff['crossing']:,} of {aff['transitions']:,}; {trace_note(facts)}). "
               f"Row a: where tokens whose heaviest expert is a at the first layer go next.{shown}")
    top = np.argmax(m, axis=1) if m.size else np.zeros(0, dtype=int)
    rows = [[a, int(targets[top[i]]), Num(float(m[i, top[i]])), Num(int(aff["row_tokens"][i]))] for i, a in enumerate(sources)]
    return Figure("affinity", f"Affinity, layers {l0} -> {l1}", caption, svg,
                  Table(["expert", "most likely next", "probability", "transitions from it"], rows))


# ------------------------------------------------------------------------------------ capacity

CAPACITY_ROWS = (("fits", "fits in device memory", None, ""), ("max_sequences", "concurrent sequences", 1.0, ""),
                 ("max_context", "context length (tokens)", 1.0, ""), ("kv_tokens_per_rank", "KV tokens per rank", 1.0, ""),
                 ("kv_bytes_per_token", "KV bytes per token", 1.0, "B"), ("device_memory_bytes", "device memory per rank", 2.0 ** -30, "GiB"),
                 ("activation_bytes", "activations", 2.0 ** -30, "GiB"), ("reserve_bytes", "reserve", 2.0 ** -30, "GiB"),
                 ("model_positions", "the model's positions", 1.0, ""))


def capacity_section(plan: dict) -> Section:
    """The serving capacity decision (plan.json `communication.capacity`, passes/cost/capacity.py):
    concurrent sequences and context, or "does not fit" (in red) where a rank's weights leave no KV cache."""
    path = "communication.capacity"
    cap = at(plan, path)
    if not isinstance(cap, dict) or not cap:
        return Section("capacity", "Serving capacity", [Note(
            "This plan records no serving capacity (plan.json communication.capacity): recompile it with this moeplan.")])
    rows = []
    for key, label, scale, unit in CAPACITY_ROWS:
        if key in cap:
            rows.append([label, ("yes" if cap[key] else "no") if scale is None else Num(cap[key], f"{path}.{key}", scale, unit=unit)])
    rows.append(["device memory from", str(cap.get("device_memory_source", ""))])
    weights = cap.get("weight_bytes_per_rank") or []
    if weights:  # the heaviest and lightest rank (a 64-rank plan's every rank would be 64 rows)
        for label, i in (("weights on the heaviest rank", int(np.argmax(weights))), ("weights on the lightest rank", int(np.argmin(weights)))):
            rows.append([f"{label} ({i})", Num(weights[i], f"{path}.weight_bytes_per_rank.{i}", 2.0 ** -30, unit="GiB")])
    blocks = [Table(["capacity", "value"], rows, f"plan.json {path}")]
    if cap.get("fits") is False:
        heaviest = max(cap.get("weight_bytes_per_rank") or [0])
        blocks.insert(0, Note(f"Does not fit: {fmt(cap.get('device_memory_bytes'), 2.0 ** -30)} GiB of device memory per rank "
                              f"({cap.get('device_memory_source', '')}) cannot hold a rank's weights ({fmt(heaviest, 2.0 ** -30)} GiB), "
                              "the activations and reserve, and a KV cache: the service refuses to start. Give more device "
                              "memory (--gpu-memory, --hardware) or more ranks.", tone="bad"))
    return Section("capacity", "Serving capacity", blocks,
                   "What the plan holds at once: concurrent sequences and context length (KV cache against device memory "
                   "less weights, activations, reserve and expert cache).")


# ------------------------------------------------------------------------------------- offload

def offload_sections(plan: dict, facts: dict) -> list:
    blocks = []
    curve = facts.get("cache_curve")
    if curve:
        sizes = curve["sizes"]
        svg = charts.lines("cache-curve", sizes, curve["hit_ratio"], "expert cache entries (layer, expert)", "hit ratio",
                           marker_x=at(plan, "communication.expert_cache"), marker_label="this plan")
        names = list(curve["hit_ratio"])
        blocks.append(Figure("cache-curve", "Hit ratio against cache size", (
            f"Demand-loading hit ratio of every eviction policy at each cache size ({trace_note(facts)}; "
            f"{curve['tokens']:,} tokens, {curve['requests']:,} expert requests), each starting from that many of the most popular "
            "experts; Belady is the offline optimum. The dashed line is the plan's cache."), svg,
            Table(["entries"] + names, [[s] + [Num(curve["hit_ratio"][n][i]) for n in names] for i, s in enumerate(sizes)])))
    else:
        blocks.append(Note("Hit ratio against cache size needs the routing trace: pass --trace."))
    t = at(plan, "communication.tiers") or {}
    if t:
        parts = {"GPU cache": [t.get("gpu_experts", 0)], "host DRAM": [t.get("host_experts", 0)], "disk": [t.get("disk_experts", 0)]}
        svg = charts.stacked_bars("tiers", ["experts"], parts, "(layer, expert) entries")
        blocks.append(Figure("tiers", "Host / disk split", (
            "Where the experts live: the GPU cache's entries (a copy), the host-DRAM tier and the disk tier that every miss "
            "is read from (docs/offload.md)."), svg, Table(["tier", "experts", "bytes"], [
                ["GPU cache", num(plan, "communication.tiers.gpu_experts"), ""],
                ["host DRAM", num(plan, "communication.tiers.host_experts"), num(plan, "communication.tiers.host_bytes", unit="B")],
                ["disk", num(plan, "communication.tiers.disk_experts"), num(plan, "communication.tiers.disk_bytes", unit="B")]])))
    return [Section("offload", "Expert cache", blocks)]


# -------------------------------------------------------------------------------------- lambda

def lambda_sections(plan: dict, facts: dict) -> list:
    lam = facts.get("lambda")
    if not lam:
        return [Section("lambda", "Functions", [Note("The per-function figures could not be computed from this plan.")])]
    slo = at(plan, "inputs.slo_s")
    groups = {}
    for f in lam["functions"]:
        groups.setdefault(f"layer {f['layer']}", ([], []))
        groups[f"layer {f['layer']}"][0].append(f["latency_s"])
        groups[f"layer {f['layer']}"][1].append(f["cost_usd"] * 1e6)
    fig1 = Figure("functions", "Cost and latency per expert function", (
        "Each expert function at its planned memory and replicas for its predicted tokens of one batch: the time one replica "
        "runs (its layer's latency also waits for the slowest and for S3) against the function's billed cost (all replicas)."),
        charts.scatter("functions", groups, "seconds per replica", "cost per batch (1e-6 $)"),
        Table(["layer", "expert", "memory MB", "replicas", "predicted tokens", "seconds", "cost $"],
              [[f["layer"], f["expert"], f["memory_mb"], f["replicas"], f["tokens"], Num(f["latency_s"]), Num(f["cost_usd"])]
               for f in lam["functions"]]))
    stages = lam["stages"]
    labels = [s["stage"] for s in stages]
    cumulative = np.cumsum([s["latency_s"] for s in stages])
    fig2 = Figure("stages", "Latency and cost per stage against the SLO", (
        f"Each stage of one batch in order (dense functions in yellow, MoE layers in blue): left, its latency and the running "
        f"total against the SLO ({fmt(slo)} s, dashed); right, its billed cost (dense stages billed per invocation here, so "
        "their sum can differ from the plan's dense cost, which bills them together, by the rounding of billed time)."),
        charts.stages("stages", labels, [s["latency_s"] for s in stages], [s["cost_usd"] for s in stages], slo),
        Table(["stage", "latency s", "cumulative s", "cost $"],
              [[s["stage"], Num(s["latency_s"]), Num(float(c)), Num(s["cost_usd"])] for s, c in zip(stages, cumulative)]
              + [["total", Num(float(cumulative[-1])) if len(cumulative) else "", "", Num(sum(s["cost_usd"] for s in stages))]]))
    return [Section("lambda", "Functions and stages", [fig1, fig2])]


# ----------------------------------------------------------------------------------- re-scored

def rescored_section(facts: dict) -> Section | None:
    r = facts.get("rescored")
    if not r:
        return None
    rows = [[name, pred, got, Num(got.value / pred.value) if isinstance(got, Num) and isinstance(pred, Num)
             and pred.value not in (None, 0) and got.value is not None else ""] for name, pred, got in r["rows"]]
    return Section("rescored", "Predicted beside re-scored on held-out traffic",
                   [Table(["figure", "predicted (plan)", "re-scored", "re-scored / predicted"], rows, r["caption"])]
                   + [Note(n) for n in r.get("notes", [])])
