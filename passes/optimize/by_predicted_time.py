"""Decisions by predicted time: the communication mode and the placement policy a plan uses.

Why: the placement objective (tokens that stay on their GPU) is a proxy; on the example model at
4 CPU ranks the plan that wins on it (ilp + coherent) runs at 0.68x the tokens/s of contiguous +
standard EP. Here every candidate is priced by the cost model (`passes/analysis/cost_model.py`)
under the chosen hardware profile, on the plan's trace and workload, and the fastest wins.

* `--mode auto`: the mode with the lower predicted seconds per generated token; on a tie (within
  `TIE`) standard EP, which moves no context traffic.
* `--policy auto`: contiguous, eplb and ilp, each with and without replicas (one replica slot
  per device), and ilp at a loose load cap as well: locality is weighed against load balance in
  the profile's seconds (the load cap is the ILP's balance constraint; the cost model prices
  both the traffic saved and the slowest rank's extra compute). Candidates that cannot be built
  for this topology (e.g. contiguous when experts do not divide over devices) are skipped.
"""
from __future__ import annotations

from dataclasses import replace

from moeplan.passes.analysis.cost_model import COHERENT, STANDARD, expected
from moeplan.planner.errors import UserError

MODES = (STANDARD, COHERENT)
TIE = 0.01  # relative: a coherent win smaller than this is not worth its context traffic
LOOSE_BALANCE = 0.5


def predict_modes(hosts, gpus_per_node: int, shape, workload, trace_experts, profile, modes=MODES) -> dict:
    """{mode: summary} for one placement, routing sampled from the trace."""
    return {mode: expected(hosts, gpus_per_node, shape, mode, workload, trace_experts, profile) for mode in modes}


def choose_mode(predictions: dict) -> str:
    """The mode with the lower predicted seconds per token; standard unless coherent wins by > TIE."""
    std, coh = predictions[STANDARD]["seconds_per_token"], predictions[COHERENT]["seconds_per_token"]
    return COHERENT if coh < std * (1 - TIE) else STANDARD


def candidates(request, num_experts: int) -> list:
    """(label, PlacementRequest) for --policy auto, built from the user's request (time limit, effort)."""
    D = request.topology.devices
    out = []
    if num_experts % D == 0:
        out.append(("contiguous", replace(request, policy="contiguous", redundant=0)))
    for policy in ("eplb", "ilp"):
        for redundant in (0, D):
            if (num_experts + redundant) % D == 0:
                out.append((f"{policy}" + (f"+{redundant}" if redundant else ""),
                            replace(request, policy=policy, redundant=redundant)))
    if num_experts % D == 0:
        out.append((f"ilp@balance{LOOSE_BALANCE:g}", replace(request, policy="ilp", redundant=0, balance=LOOSE_BALANCE)))
    return out


def choose_placement(trace, request, shape, profile, workload, mode: str) -> tuple:
    """Build every candidate, predict each under `mode` (or both for auto), keep the fastest.

    Returns (placement, table): table rows {label, policy, redundant, mode, seconds_per_token,
    total_bytes_per_token, modes: {mode: full prediction}} for plan.json."""
    from moeplan.passes.optimize.placement.policies import plan_placement

    rows, best = [], None
    for label, req in candidates(request, trace.num_experts):
        try:
            placement = plan_placement(trace, req)
        except UserError:
            if req.policy != "ilp" or req.balance_base == "eplb":
                continue
            try:  # a load cap no placement meets over the mean: cap relative to EPLB's best instead
                req = replace(req, balance_base="eplb")
                placement = plan_placement(trace, req)
            except UserError:
                continue
        preds = predict_modes(placement.hosts(), req.topology.gpus_per_node, shape, workload, trace.experts, profile,
                              MODES if mode == "auto" else (mode,))
        chosen = choose_mode(preds) if mode == "auto" else mode
        p = preds[chosen]
        rows.append({"label": label, "policy": req.policy, "redundant": req.redundant, "mode": chosen,
                     "seconds_per_token": p["seconds_per_token"], "total_bytes_per_token": p["total_bytes_per_token"],
                     "modes": preds})
        if best is None or p["seconds_per_token"] < best[0] * (1 - TIE):
            best = (p["seconds_per_token"], placement, label)
    if best is None:
        raise UserError("--policy auto found no placement policy that fits this topology; pick --policy and --redundant explicitly")
    for row in rows:
        row["chosen"] = row["label"] == best[2]
    return best[1], rows
