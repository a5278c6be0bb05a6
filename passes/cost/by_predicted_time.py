"""Decisions by predicted time: the communication mode and the placement policy a plan uses.

Why: the placement objective (tokens that stay on their GPU) is a proxy; on the example model at
4 CPU ranks the plan that wins on it (ilp + coherent) runs at 0.68x the tokens/s of contiguous +
standard EP. Here every candidate is priced by the cost model (`passes/cost/cost_model.py`)
under the chosen hardware profile, on the plan's trace and workload, and the fastest wins.

* `--mode auto`: the mode with the lower predicted seconds per generated token; on a tie (within
  `TIE`) standard EP, which moves no context traffic.
* `--policy auto`: contiguous, eplb and ilp, each with and without replicas (one replica slot
  per device). The ILP's load cap is chosen in the profile's time units (`time_prices.py`): a
  remote slot and a slot of max-load excess each get a price in seconds from the profile and the
  workload, and the cap with the lowest priced objective on the trace is kept, per mode (one
  ILP candidate per distinct cap). Then the cost model prices every candidate in full.
  Candidates that cannot be built for this topology (e.g. contiguous when experts do not divide
  over devices) are skipped.
* Early stop: candidates are tried cheapest first (contiguous, EPLB, then the ILP's, whose solves
  take minutes at DeepSeek-V3 scale). Before each, the best price so far is set against the floor
  no placement can be predicted below (`placement_floor.py`); once the floor is within
  `MODEL_ERROR` of the best, no candidate left can win by more than the model can tell apart, and
  the rest are skipped (plan.json `predicted.cost.auto_stop` names them, the floor and the error).
"""
from __future__ import annotations

from dataclasses import replace

from moeplan.passes.cost.cost_model import COHERENT, STANDARD, expected
from moeplan.core.errors import UserError

MODES = (STANDARD, COHERENT)
TIE = 0.01  # relative: a coherent win smaller than this is not worth its context traffic
# The cost model's error, relative: a candidate that cannot beat the best so far by more than this is not
# tried. From docs/cost_model.md, "How close the demo comes": on the machine it was calibrated on, the
# demo's predictions fell within -7.2 % .. +14.7 % of `moeplan run`'s measurement, and a single run's
# noise on 2 cores is about +-10 %; a win below 10 % is one no measurement could confirm.
MODEL_ERROR = 0.10


def predict_modes(hosts, gpus_per_node: int, shape, workload, trace_experts, profile, modes=MODES) -> dict:
    """{mode: summary} for one placement, routing sampled from the trace."""
    return {mode: expected(hosts, gpus_per_node, shape, mode, workload, trace_experts, profile) for mode in modes}


def choose_mode(predictions: dict) -> str:
    """The mode with the lower predicted seconds per token; standard unless coherent wins by > TIE."""
    std, coh = predictions[STANDARD]["seconds_per_token"], predictions[COHERENT]["seconds_per_token"]
    return COHERENT if coh < std * (1 - TIE) else STANDARD


def candidates(request, num_experts: int) -> list:
    """(label, PlacementRequest) for --policy auto, built from the user's request (time limit,
    effort); the ILP's load cap is left to `ilp_candidates`."""
    D = request.topology.devices
    out = []
    if num_experts % D == 0:
        out.append(("contiguous", replace(request, policy="contiguous", redundant=0)))
    for policy in ("eplb", "ilp"):
        for redundant in (0, D):
            if (num_experts + redundant) % D == 0:
                out.append((f"{policy}" + (f"+{redundant}" if redundant else ""),
                            replace(request, policy=policy, redundant=redundant)))
    return out


def ilp_candidates(trace, label: str, req, prices: dict) -> tuple:
    """[(label@balance, request, placement)] of the ILP at the load cap each mode's time prices
    choose (one per distinct cap), and the cap search's table."""
    from moeplan.passes.cost.time_prices import choose_load_cap

    req = replace(req, bound=False)  # the bound of the one placement kept only (`choose_placement`)
    try:
        chosen, table = choose_load_cap(trace, req, prices)
    except UserError:
        try:  # no cap over the mean is feasible: caps relative to EPLB's best instead
            req = replace(req, balance_base="eplb")
            chosen, table = choose_load_cap(trace, req, prices)
        except UserError:
            return [], []
    out, seen = [], set()
    for _, (placement, balance) in sorted(chosen.items()):
        if balance not in seen:
            seen.add(balance)
            out.append((f"{label}@balance{balance:g}", replace(req, balance=balance), placement))
    return out, table


def no_candidate_reason(request, num_experts: int, failures: list) -> str:
    """Why --policy auto built no candidate, as --policy eplb would say it, and the flags that fit."""
    topo = request.topology
    D = topo.devices
    fit = (-num_experts) % D or D
    if failures:
        why = "; ".join(failures)
    else:
        why = (f"{num_experts} experts per layer do not divide evenly over {D} devices ({topo.nodes} nodes x "
               f"{topo.gpus_per_node} GPUs), with none or {D} redundant slots (the slot counts auto tries)")
    return (f"--policy auto found no placement that fits this topology: {why}; give --policy eplb (or ilp) with "
            f"--redundant {fit} ({num_experts} + {fit} slots per layer over {D} devices), or a device count that divides "
            f"{num_experts}")


def choose_placement(trace, request, shape, profile, workload, mode: str, error: float | None = MODEL_ERROR) -> tuple:
    """Build the candidates cheapest first, predict each under `mode` (or both for auto), keep the
    fastest; stop once no candidate left can beat it by more than `error` (None: try them all).

    Returns (placement, table, stop): table rows {label, policy, redundant, balance, mode,
    seconds_per_token, total_bytes_per_token, max_over_mean_load (on the trace), modes: {mode: full prediction}}
    for plan.json (the
    ILP rows carry `prices` and `cap_search`, time_prices.py); stop {error, floor_seconds_per_token,
    best_seconds_per_token, skipped: [labels]} (module docstring)."""
    from moeplan.core import progress
    from moeplan.passes.cost.placement_floor import expected_floor
    from moeplan.passes.cost.time_prices import time_prices
    from moeplan.passes.optimize.placement.policies import finish_placement, plan_placement

    modes = MODES if mode == "auto" else (mode,)
    topo = request.topology
    floor = min(expected_floor(topo.devices, shape, m, workload, trace.experts, profile, gpus_per_node=topo.gpus_per_node)
                for m in modes)
    prices = None
    rows, best, skipped, failures = [], None, [], []
    todo = candidates(request, trace.num_experts)
    with progress.step("placement candidates (--policy auto)", total=len(todo)) as advance:
        for label, req in todo:
            if best is not None and error is not None and floor >= best[0] * (1 - max(error, TIE)):
                skipped.append(label)
                advance(description=f"placement candidates: {label} cannot win by more than {error:.0%}, skipped")
                continue
            advance(0, description=f"placement candidates: building {label}")
            if req.policy == "ilp":
                if prices is None:
                    prices = {m: time_prices(profile, shape, workload, topo.devices, topo.gpus_per_node, trace.num_experts, m)
                              for m in modes}
                found, table = ilp_candidates(trace, label, req, prices)
                built = [(lab, r, p, {"prices": {m: v.to_dict() for m, v in prices.items()}, "cap_search": table})
                         for lab, r, p in found]
            else:
                try:
                    built = [(label, req, plan_placement(trace, req), {})]
                except UserError as exc:
                    failures.append(f"{label}: {exc}")
                    built = []
            advance(0, description=f"placement candidates: pricing {label}")
            for lab, r, placement, extra in built:
                row = _priced_row(lab, r, placement, extra, shape, workload, trace, profile, mode)
                rows.append(row)
                if best is None or row["seconds_per_token"] < best[0] * (1 - TIE):
                    best = (row["seconds_per_token"], placement, lab)
            advance()
    if best is None:
        raise UserError(no_candidate_reason(request, trace.num_experts, failures))
    for row in rows:
        row["chosen"] = row["label"] == best[2]
    finish_placement(best[1])
    stop = {"error": error, "floor_seconds_per_token": floor, "best_seconds_per_token": best[0], "skipped": skipped}
    return best[1], rows, stop


def _priced_row(label, req, placement, extra, shape, workload, trace, profile, mode: str) -> dict:
    """One candidate's row of the table: its prediction under `mode` (both for auto) and the mode chosen."""
    preds = predict_modes(placement.hosts(), req.topology.gpus_per_node, shape, workload, trace.experts, profile,
                          MODES if mode == "auto" else (mode,))
    chosen = choose_mode(preds) if mode == "auto" else mode
    p = preds[chosen]
    return {"label": label, "policy": req.policy, "redundant": req.redundant, "mode": chosen,
            "balance": req.balance if req.policy == "ilp" else None,
            "seconds_per_token": p["seconds_per_token"], "total_bytes_per_token": p["total_bytes_per_token"],
            "max_over_mean_load": placement.metrics.get("max_over_mean_load"), "modes": preds, **extra}
