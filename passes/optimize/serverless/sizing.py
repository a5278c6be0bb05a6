"""Cost-optimal sizing of serverless expert functions: enumerated MILP + ODS (serverless-MoE Sec. IV).

Why enumeration: the paper's MIQCP multiplies memory, replicas and tokens. For fixed per-layer
communication mode (method, minibatch size beta), every (memory option, replica count) pair of
an expert has a known cost and time, so choosing one pair per expert is linear: binaries z per
pair, the layer latency max linearised with one continuous L_e per layer, one SLO row. Pairs
that another pair beats on both cost and latency are dropped first (exact, and it keeps the
model small).

* `solve_uniform(method)`: the paper's per-method MIQCP (all layers use one method).
* `ods(...)`: Alg. 1 with the note's corrections: one indicator per method (not the printed
  selector polynomials), on an SLO violation the layer with the *highest* latency under its
  method loses that method (the pseudo-code says argmin), up to 2|E| rounds, fallback to the
  best uniform solution; then (our addition, `polish=True`) one MILP re-sizes memory and
  replicas with the chosen methods fixed, warm-started from the ODS point, so it never costs more.
* `solve_monolithic(...)`: every layer may use every method in one MILP (the paper's baseline).
Two equivalent formulations: per-pair binaries (the textbook model, slow at tight SLOs) and
per-layer frontiers (each layer's exact cost for every latency cap, then a multiple-choice
knapsack over layers; small and exact), the default for ODS's solves.
Infeasible inputs raise `UserError` naming the constraint and the closest feasible value.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import numpy as np
import scipy.sparse as sp

from moeplan.passes.optimize.serverless import billing as sc
from moeplan.passes.optimize.milp import MilpResult, Rows, solve_milp
from moeplan.core.errors import UserError

DEFAULT_BETAS = (64, 256, 1024)
# Costs differ by fractions of a percent between sizings: solve (near) to optimality.
SIZING_MIP_GAP = 1e-6
DEFAULT_METHODS = (sc.PIPELINED_S3, sc.S3, sc.DIRECT)


@dataclass(frozen=True)
class ExpertChoice:
    """Memory (MB) and replica count for one expert, with the predicted load behind it."""

    memory_mb: int
    replicas: int
    tokens: int


@dataclass(frozen=True)
class LayerDecision:
    method: int
    beta: int
    experts: tuple  # ExpertChoice per expert


@dataclass
class SizingResult:
    """A full sizing plus how it was found."""

    layers: tuple
    cost: float                 # predicted dollars per batch (MoE layers)
    latency: float              # predicted end-to-end seconds per batch
    algorithm: str
    solves: list = field(default_factory=list)   # per solve: name, status, objective, bound, gap, seconds


@dataclass(frozen=True)
class _Options:
    """Pareto-optimal candidate (memory, replicas) pairs of one expert under one mode."""

    mem: np.ndarray
    reps: np.ndarray
    cost: np.ndarray
    contrib: np.ndarray


def candidate_pairs(facts: sc.ServerlessFacts, layer: int, tokens: int, method: int, beta: int) -> _Options:
    """All feasible (memory, replicas) pairs for `tokens` tokens, Pareto-pruned on (cost, latency)."""
    return _candidate_pairs(facts, int(layer), int(tokens), int(method), int(beta))


@functools.lru_cache(maxsize=1 << 16)
def _candidate_pairs(facts, layer, tokens, method, beta) -> _Options:
    p = facts.platform
    lf = facts.layers[layer]
    mems = np.asarray(p.memory_options_mb, dtype=float)
    J, G = len(mems), max(1, min(p.max_replicas, tokens))
    jj, gg = np.meshgrid(np.arange(J), np.arange(1, G + 1), indexing="ij")
    jj, gg = jj.ravel(), gg.ravel()
    r = np.ceil(tokens / gg)
    ok = sc.memory_need_mb(p, lf, r) <= mems[jj] + 1e-9
    if method == sc.DIRECT:
        ok &= sc.payload_ok(p, lf, r)
    jj, gg, r = jj[ok], gg[ok], r[ok]
    if jj.size == 0:
        return _Options(*(np.empty(0),) * 4)
    t_rep = sc.replica_time(p, lf, method, mems[jj], r, beta)
    contrib = sc.latency_contribution(p, lf, method, t_rep, r)
    cost = sc.expert_cost(p, mems[jj], gg, t_rep)
    order = np.lexsort((gg, jj, contrib, cost))  # cheapest first, ties by latency then index
    keep, best = [], math.inf
    for k in order:
        if contrib[k] < best - 1e-12:
            keep.append(k)
            best = contrib[k]
    keep = np.asarray(keep)
    return _Options(mems[jj[keep]].astype(np.int64), gg[keep], cost[keep], contrib[keep])


def _modes_for(method: int, betas) -> list:
    return [(method, int(b)) for b in betas] if method == sc.PIPELINED_S3 else [(method, 0)]


def _fixed_latency(facts, batch_tokens: float) -> float:
    d = sc.dense_times(facts, batch_tokens)
    return d["head"] + d["tail"] + sum(d["non_moe"])


def size_layers(facts: sc.ServerlessFacts, loads: np.ndarray, slo_s: float, modes_per_layer: list, *,
                batch_tokens: float, time_limit_s: float = 10.0, solver: str = "highs", name: str = "milp",
                warm: dict | None = None, formulation: str = "frontier") -> SizingResult | None:
    """One enumerated MILP over all layers; each layer picks one of its allowed (method, beta) modes.

    Returns None when infeasible (checked exactly: the fastest choice per layer misses the SLO).
    `formulation="pairs"` builds the direct model (a binary per expert and pair, L_e >= each
    chosen pair's latency); `"frontier"` (default) first reduces every layer to its exact
    cost-per-latency-cap list, leaving a small multiple-choice knapsack with the same optimum.
    """
    p = facts.platform
    loads = np.asarray(loads, dtype=np.int64)
    L = len(facts.layers)
    budget = slo_s - _fixed_latency(facts, batch_tokens)
    # -- enumerate
    layer_modes = []
    for e in range(L):
        usable = []
        for (method, beta) in modes_per_layer[e]:
            opts = {}
            ok = True
            for i in np.flatnonzero(loads[e] > 0):
                o = candidate_pairs(facts, e, int(loads[e, i]), method, beta)
                if o.mem.size == 0:
                    ok = False
                    break
                opts[int(i)] = o
            if ok:
                usable.append(((method, beta), opts))
        if not usable:
            return None
        layer_modes.append(usable)
    # -- fastest point: exact feasibility check and warm start
    total_tok = loads.sum(axis=1)
    fastest, fastest_lat = [], 0.0
    for e in range(L):
        best = None
        for m, ((method, _beta), opts) in enumerate(layer_modes[e]):
            contribs = [float(o.contrib[-1]) for o in opts.values()]
            lat = sc.layer_latency(p, facts.layers[e], method, contribs, float(total_tok[e]))
            if best is None or lat < best[0] - 1e-12:
                best = (lat, m)
        fastest.append(best[1])
        fastest_lat += best[0]
    if fastest_lat > budget + 1e-9:
        return None
    if formulation == "frontier":
        return _solve_frontier(facts, loads, layer_modes, budget, total_tok, time_limit_s, solver, name, batch_tokens)
    # -- variables: z (per option), w (per layer-mode), L (per layer)
    cost = []
    z_index = []  # (e, m, i, option position) per z column
    for e in range(L):
        for m, (_, opts) in enumerate(layer_modes[e]):
            for i, o in sorted(opts.items()):
                for k in range(o.mem.size):
                    z_index.append((e, m, i, k))
                    cost.append(float(o.cost[k]))
    nz = len(z_index)
    w_cols = {}
    for e in range(L):
        for m in range(len(layer_modes[e])):
            w_cols[(e, m)] = nz + len(w_cols)
    nw = len(w_cols)
    l_cols = [nz + nw + e for e in range(L)]
    n = nz + nw + L
    c = np.zeros(n)
    c[:nz] = cost
    c[nz + nw:] = 1e-12  # keep L_e tight without changing the optimum
    rows = Rows()

    def add_row(entries, lower, upper):  # entries: (column, coefficient) pairs
        rows.add([col for col, _ in entries], [v for _, v in entries], lower, upper)

    groups = {}
    for col, (e, m, i, _k) in enumerate(z_index):
        groups.setdefault((e, m, i), []).append(col)
    for (e, m, _i), zc in sorted(groups.items()):
        add_row([(col, 1.0) for col in zc] + [(w_cols[(e, m)], -1.0)], 0.0, 0.0)
    for e in range(L):
        add_row([(w_cols[(e, m)], 1.0) for m in range(len(layer_modes[e]))], 1.0, 1.0)
    by_expert = {}
    for col, (e, m, i, k) in enumerate(z_index):
        by_expert.setdefault((e, i), []).append((col, float(layer_modes[e][m][1][i].contrib[k])))
    for (e, _i), entries in sorted(by_expert.items()):
        add_row(entries + [(l_cols[e], -1.0)], -np.inf, 0.0)
    slo_entries = [(l_cols[e], 1.0) for e in range(L)]
    for e in range(L):
        t_load = sc.dense_load_time(p, facts.layers[e])
        s3 = [(w_cols[(e, m)], t_load) for m, ((method, _), _) in enumerate(layer_modes[e]) if method != sc.DIRECT]
        if s3:
            add_row(s3 + [(l_cols[e], -1.0)], -np.inf, 0.0)
        for m, ((method, _), _) in enumerate(layer_modes[e]):
            slo_entries.append((w_cols[(e, m)], sc.layer_constant(p, facts.layers[e], method, float(total_tok[e]))))
    add_row(slo_entries, -np.inf, budget)
    A, lo, hi = rows.matrix(n)
    col_lo = np.zeros(n)
    col_hi = np.ones(n)
    col_hi[nz + nw:] = np.inf
    integer = np.zeros(n, dtype=bool)
    integer[:nz + nw] = True
    x0 = _point(layer_modes, z_index, w_cols, l_cols, n, warm or {e: (fastest[e], "fastest") for e in range(L)}, facts, total_tok)
    res = solve_milp(c, A, lo, hi, col_lo, col_hi, integer,
                     time_limit=time_limit_s, warm_start=x0, solver=solver, mip_gap=SIZING_MIP_GAP)
    if not res.feasible:
        return None
    return _decode(facts, loads, layer_modes, z_index, w_cols, res, name, batch_tokens)


def _layer_frontier(p, lf, method, opts: dict, total_tokens: float):
    """Cheapest layer cost for every latency cap: (latency, cost, per-expert option index) lists.

    For a cap T on the slowest expert, each expert independently takes its cheapest pair with
    latency contribution <= T (its Pareto list is cheapest-first, so that is a search), so the
    layer's whole cost/latency trade-off is one list; dominated caps are dropped.
    """
    experts = sorted(opts)
    if not experts:
        lat = sc.layer_latency(p, lf, method, [], total_tokens)
        return [(lat, 0.0, {})]
    caps = np.unique(np.concatenate([opts[i].contrib for i in experts]))
    floor = max(float(opts[i].contrib[-1]) for i in experts)
    caps = caps[caps >= floor - 1e-15]
    cost = np.zeros(caps.size)
    picks = {}
    for i in experts:
        o = opts[i]
        # contrib is decreasing along the list: first index with contrib <= cap
        k = np.searchsorted(-o.contrib, -caps - 1e-15, side="left")
        cost += o.cost[k]
        picks[i] = k
    out, best = [], math.inf
    for c_idx in np.argsort(caps, kind="stable"):
        if cost[c_idx] < best - 1e-18:
            best = cost[c_idx]
            slowest = max(float(opts[i].contrib[picks[i][c_idx]]) for i in experts)
            lat = sc.layer_latency(p, lf, method, [slowest], total_tokens)
            out.append((lat, float(cost[c_idx]), {i: int(picks[i][c_idx]) for i in experts}))
    return out


def _solve_frontier(facts, loads, layer_modes, budget, total_tok, time_limit_s, solver, name, batch_tokens):
    """Multiple-choice knapsack over per-layer (mode, latency cap) points: exact and small."""
    p = facts.platform
    points = []  # (layer, mode, latency, cost, picks)
    for e, modes in enumerate(layer_modes):
        for m, ((method, _beta), opts) in enumerate(modes):
            for lat, cost, picks in _layer_frontier(p, facts.layers[e], method, opts, float(total_tok[e])):
                points.append((e, m, lat, cost, picks))
    n = len(points)
    L = len(layer_modes)
    c = np.array([pt[3] for pt in points])
    rows = [pt[0] for pt in points] + [L] * n
    cols = list(range(n)) * 2
    vals = [1.0] * n + [pt[2] for pt in points]
    A = sp.coo_matrix((vals, (rows, cols)), shape=(L + 1, n)).tocsc()
    lo = np.r_[np.ones(L), -np.inf]
    hi = np.r_[np.ones(L), budget]
    x0 = np.zeros(n)
    for e in range(L):  # warm start: the fastest point of every layer
        ks = [k for k, pt in enumerate(points) if pt[0] == e]
        x0[min(ks, key=lambda k: (points[k][2], points[k][3], k))] = 1.0
    res = solve_milp(c, A, lo, hi, np.zeros(n), np.ones(n), np.ones(n, dtype=bool),
                     time_limit=time_limit_s, warm_start=x0, solver=solver, mip_gap=SIZING_MIP_GAP)
    if not res.feasible:
        return None
    layers = []
    for k in np.flatnonzero(res.x > 0.5):
        e, m, _, _, picks = points[k]
        (method, beta), opts = layer_modes[e][m]
        experts = []
        for i in range(loads.shape[1]):
            d = int(loads[e, i])
            if d > 0:
                o = opts[i]
                experts.append(ExpertChoice(int(o.mem[picks[i]]), int(o.reps[picks[i]]), d))
            else:
                experts.append(ExpertChoice(smallest_fitting_memory(facts, e), 1, 0))
        layers.append((e, LayerDecision(int(method), int(beta), tuple(experts))))
    layers = tuple(dec for _, dec in sorted(layers, key=lambda t: t[0]))
    cost, latency = predicted_cost_latency(facts, layers, batch_tokens)
    solve = {"name": name, "status": res.status, "objective": res.objective, "bound": res.bound,
             "gap": res.gap, "seconds": res.seconds, "solver": res.solver, "variables": n}
    return SizingResult(layers, cost, latency, name, [solve])


def _point(layer_modes, z_index, w_cols, l_cols, n, choice, facts, total_tok):
    """A feasible MILP point: per layer a mode and per expert its fastest (or given) pair."""
    x = np.zeros(n)
    picks = {}
    for e, (m, how) in choice.items():
        x[w_cols[(e, m)]] = 1.0
        _, opts = layer_modes[e][m]
        for i, o in opts.items():
            k = o.mem.size - 1 if how == "fastest" else how[i]
            picks[(e, m, i)] = k
    contrib = {}
    for col, (e, m, i, k) in enumerate(z_index):
        if picks.get((e, m, i)) == k:
            x[col] = 1.0
            contrib[e] = max(contrib.get(e, 0.0), float(layer_modes[e][m][1][i].contrib[k]))
    for e, col in enumerate(l_cols):
        method = layer_modes[e][choice[e][0]][0][0]
        t_load = sc.dense_load_time(facts.platform, facts.layers[e]) if method != sc.DIRECT else 0.0
        x[col] = max(contrib.get(e, 0.0), t_load)
    return x


def _decode(facts, loads, layer_modes, z_index, w_cols, res: MilpResult, name, batch_tokens) -> SizingResult:
    x = res.x
    L = len(facts.layers)
    chosen_mode = {}
    for (e, m), col in w_cols.items():
        if x[col] > 0.5:
            chosen_mode[e] = m
    picks = {}
    for col, (e, m, i, k) in enumerate(z_index):
        if m == chosen_mode[e] and x[col] > 0.5:
            picks[(e, i)] = k
    layers = []
    for e in range(L):
        (method, beta), opts = layer_modes[e][chosen_mode[e]]
        experts = []
        for i in range(loads.shape[1]):
            d = int(loads[e, i])
            if d > 0:
                o = opts[i]
                k = picks[(e, i)]
                experts.append(ExpertChoice(int(o.mem[k]), int(o.reps[k]), d))
            else:
                experts.append(ExpertChoice(smallest_fitting_memory(facts, e), 1, 0))
        layers.append(LayerDecision(int(method), int(beta), tuple(experts)))
    cost, latency = predicted_cost_latency(facts, layers, batch_tokens)
    solve = {"name": name, "status": res.status, "objective": res.objective, "bound": res.bound,
             "gap": res.gap, "seconds": res.seconds, "solver": res.solver}
    return SizingResult(tuple(layers), cost, latency, name, [solve])


def smallest_fitting_memory(facts: sc.ServerlessFacts, layer: int) -> int:
    """The smallest memory option (MB) that holds an expert with no token (idle experts)."""
    need = float(sc.memory_need_mb(facts.platform, facts.layers[layer], 0))
    for m in facts.platform.memory_options_mb:
        if m >= need:
            return int(m)
    return int(facts.platform.memory_options_mb[-1])


def layer_cost_latency(facts, e: int, decision: LayerDecision, loads_row) -> tuple:
    """Predicted cost and latency of one layer for the decision's own tokens."""
    p = facts.platform
    lf = facts.layers[e]
    cost, contribs = 0.0, []
    for ch, d in zip(decision.experts, loads_row):
        if d <= 0:
            continue
        r = math.ceil(d / ch.replicas)
        t = float(sc.replica_time(p, lf, decision.method, ch.memory_mb, r, decision.beta))
        cost += float(sc.expert_cost(p, ch.memory_mb, ch.replicas, t))
        contribs.append(float(sc.latency_contribution(p, lf, decision.method, t, r)))
    lat = sc.layer_latency(p, lf, decision.method, contribs, float(np.sum(loads_row)))
    return cost, lat


def predicted_cost_latency(facts, layers, batch_tokens) -> tuple:
    cost, lat = 0.0, _fixed_latency(facts, batch_tokens)
    for e, dec in enumerate(layers):
        c, l = layer_cost_latency(facts, e, dec, [ch.tokens for ch in dec.experts])
        cost += c
        lat += l
    return cost, lat


# ---------------------------------------------------------------- entry points and diagnostics


def check_feasible(facts, loads, slo_s, methods, betas, batch_tokens) -> None:
    """Raise `UserError` naming the first unmeetable constraint and its closest feasible value."""
    p = facts.platform
    loads = np.asarray(loads, dtype=np.int64)
    mems = p.memory_options_mb
    for e in range(len(facts.layers)):
        lf = facts.layers[e]
        for i in np.flatnonzero(loads[e] > 0):
            d = int(loads[e, i])
            r = math.ceil(d / p.max_replicas)
            need = float(sc.memory_need_mb(p, lf, r))
            if need > mems[-1]:
                idle = float(sc.memory_need_mb(p, lf, 0))
                if idle > mems[-1]:
                    raise UserError(
                        f"memory constraint cannot be met: one expert of MoE layer {e} needs {idle:.0f} MB "
                        f"(runtime + weights) but the largest memory option is {mems[-1]:.0f} MB; "
                        f"closest feasible: a memory option of at least {math.ceil(idle)} MB")
                per_tok = (lf.expert_token_bytes + lf.d_in + lf.d_out) / sc.MB
                max_tok = int((mems[-1] - idle) / per_tok) * p.max_replicas
                raise UserError(
                    f"memory constraint cannot be met: expert {i} of MoE layer {e} gets {d} tokens and needs "
                    f"{need:.0f} MB per replica with {p.max_replicas} replicas (largest option {mems[-1]:.0f} MB); "
                    f"closest feasible: at most {max_tok} tokens per expert (a smaller batch) or more replicas")
        if set(methods) == {sc.DIRECT}:
            dmax = int(loads[e].max()) if loads.shape[1] else 0
            r = math.ceil(dmax / p.max_replicas)
            if not bool(sc.payload_ok(p, lf, r)):
                per = max(lf.d_in, lf.d_out)
                fit = p.payload_limit_bytes // per * p.max_replicas
                raise UserError(
                    f"payload constraint cannot be met: direct invocation sends {r} tokens x {per} B = "
                    f"{r * per / sc.MB:.2f} MB per replica of the busiest expert of MoE layer {e}, over the "
                    f"{p.payload_limit_bytes / sc.MB:.0f} MB limit even with {p.max_replicas} replicas; closest feasible: "
                    f"at most {fit} tokens per expert, or allow the S3 methods")
    fastest = fastest_latency(facts, loads, methods, betas, batch_tokens)
    if fastest > slo_s + 1e-9:
        raise UserError(
            f"SLO constraint cannot be met: the fastest plan takes {fastest:.3f} s per {int(batch_tokens)}-token "
            f"batch, above --slo {slo_s:g}; closest feasible: --slo {math.ceil(fastest * 1000) / 1000:.3f}")


def fastest_latency(facts, loads, methods, betas, batch_tokens) -> float:
    """Smallest achievable end-to-end latency: every layer at its fastest mode and pairs."""
    p = facts.platform
    loads = np.asarray(loads, dtype=np.int64)
    total = _fixed_latency(facts, batch_tokens)
    for e in range(len(facts.layers)):
        best = math.inf
        for method in methods:
            for (_, beta) in _modes_for(method, betas):
                contribs = []
                for i in np.flatnonzero(loads[e] > 0):
                    o = candidate_pairs(facts, e, int(loads[e, i]), method, beta)
                    if o.mem.size == 0:
                        contribs = None
                        break
                    contribs.append(float(o.contrib[-1]))
                if contribs is not None:
                    best = min(best, sc.layer_latency(p, facts.layers[e], method, contribs, float(loads[e].sum())))
        total += best
    return total


def solve_uniform(facts, loads, slo_s, method, *, betas=DEFAULT_BETAS, batch_tokens, time_limit_s=10.0, solver="highs"):
    """The paper's per-method problem: every layer uses `method`."""
    modes = [_modes_for(method, betas) for _ in facts.layers]
    return size_layers(facts, loads, slo_s, modes, batch_tokens=batch_tokens, time_limit_s=time_limit_s,
                       solver=solver, name=f"uniform_{sc.METHOD_NAMES[method]}")


def solve_monolithic(facts, loads, slo_s, *, methods=DEFAULT_METHODS, betas=DEFAULT_BETAS, batch_tokens,
                     time_limit_s=30.0, solver="highs", formulation="pairs"):
    """One MILP in which every layer may use every method (the paper's 'MIQCP' baseline).

    By default in the direct per-pair form, as the paper's single MIQCP; with
    `formulation="frontier"` it is exact and fast, and ODS can be checked against it.
    """
    check_feasible(facts, loads, slo_s, methods, betas, batch_tokens)
    modes = [[m for a in methods for m in _modes_for(a, betas)] for _ in facts.layers]
    res = size_layers(facts, loads, slo_s, modes, batch_tokens=batch_tokens, time_limit_s=time_limit_s,
                      solver=solver, name="monolithic", formulation=formulation)
    if res is None:
        raise UserError(f"SLO constraint cannot be met with --slo {slo_s:g}")
    return res


def ods(facts, loads, slo_s, *, methods=DEFAULT_METHODS, betas=DEFAULT_BETAS, batch_tokens,
        time_limit_s=10.0, solver="highs", polish=True) -> SizingResult:
    """Alg. 1 (corrected) over the uniform solutions, then an optional re-sizing with methods fixed."""
    check_feasible(facts, loads, slo_s, methods, betas, batch_tokens)
    loads = np.asarray(loads, dtype=np.int64)
    L = len(facts.layers)
    uniform, solves = {}, []
    for a in methods:
        res = solve_uniform(facts, loads, slo_s, a, betas=betas, batch_tokens=batch_tokens,
                            time_limit_s=time_limit_s, solver=solver)
        if res is not None:
            uniform[a] = res
            solves += res.solves
        else:
            solves.append({"name": f"uniform_{sc.METHOD_NAMES[a]}", "status": "infeasible"})
    table = {}  # (a, e) -> (cost, latency, decision)
    for a, res in uniform.items():
        for e, dec in enumerate(res.layers):
            c, l = layer_cost_latency(facts, e, dec, loads[e])
            table[(a, e)] = [c, l, dec]
    fixed = _fixed_latency(facts, batch_tokens)
    chosen = None
    for _ in range(2 * L):
        pick = []
        for e in range(L):
            cands = [(table[(a, e)][0], a) for a in sorted(uniform) if math.isfinite(table[(a, e)][0])]
            if not cands:
                pick = None
                break
            pick.append(min(cands)[1])
        if pick is None:
            break
        lat = fixed + sum(table[(a, e)][1] for e, a in enumerate(pick))
        if lat <= slo_s + 1e-9:
            chosen = pick
            break
        worst = max(range(L), key=lambda e: (table[(pick[e], e)][1], -e))
        table[(pick[worst], worst)][0] = math.inf
    if chosen is not None:
        layers = tuple(table[(a, e)][2] for e, a in enumerate(chosen))
        cost, latency = predicted_cost_latency(facts, layers, batch_tokens)
        result = SizingResult(layers, cost, latency, "ods", solves)
    elif uniform:
        best = min(uniform.values(), key=lambda r: r.cost)
        result = SizingResult(best.layers, best.cost, best.latency, "ods_uniform_fallback", solves)
    else:
        mono = solve_monolithic(facts, loads, slo_s, methods=methods, betas=betas, batch_tokens=batch_tokens,
                                time_limit_s=time_limit_s, solver=solver)
        mono.solves = solves + mono.solves
        mono.algorithm = "ods_monolithic_fallback"
        return mono
    if polish:
        modes = [_modes_for(dec.method, betas) for dec in result.layers]
        refined = size_layers(facts, loads, slo_s, modes, batch_tokens=batch_tokens, time_limit_s=time_limit_s,
                              solver=solver, name="ods_polish")
        if refined is not None and refined.cost < result.cost - 1e-15:
            refined.solves = result.solves + refined.solves
            refined.algorithm = result.algorithm + "+polish"
            return refined
    return result
