"""The ILP's trade-off in the hardware profile's time units: locality against load balance.

Why: the placement ILP maximises tokens that stay on their GPU under a load cap (max GPU load
<= (1 + balance) x mean). Which cap is right depends on the machine: on fast links and slow
compute a remote visit is cheap and an overloaded GPU is not; on a slow network the reverse.
Here both sides get a price in seconds from the hardware profile and the workload, and the cap
is chosen by minimising the priced objective on the planning trace.

Prices (per served token-expert slot; W ranks, G per node, k top-k, E experts, n_s tokens in
step s of the workload, weights over steps by n_s):
* `remote_visit_s`, one slot served off the token's current rank: its dispatch row plus its way
  back (combine row in standard mode, merge row in coherent mode) over the tier mix of a random
  other rank (share (W - G) / (W - 1) on another node),
      (dispatch + back bytes) x (share_other / bw_other + (1 - share_other) / bw_same)
  plus the two messages' latency when this slot is the only one between its two ranks in that
  call (probability exp(-n_s k / W^2) for rows spread evenly over the W^2 rank pairs).
* `load_excess_s`, one slot more on the slowest rank (the rank that sets each layer's pace):
      expert FLOPs / flops_per_s
  plus one expert call (its framework ops, runtime_ops.py: none where counted, and the expert's weight read on GPUs)
  when the slot opens a call (probability exp(-n_s k / E)).
  Ranks that share cores (W > parallel_ranks, CPU) queue: a step's compute then takes the
  ranks' total over the cores, and the slowest rank starts to matter only above
  (W / parallel_ranks) x the mean load: excess up to that is free (`free_excess`).

Objective of a placement on a trace (seconds per token):
    J = remote_visit_s x remote slots per token + load_excess_s x sum over layers of
        max(0, max_r load_r - (1 + free_excess) x mean_r load_r) per token,
with remote slots counted as the placement metric counts them (slots at layers >= 1 off the
current GPU; coherent mode) or, in standard mode, slots whose rank is not the token's home
(round-robin over requests, so (W - 1) / W of the distinct ranks of its slots; locality does not
change it and only balance matters). `choose_load_cap` solves the ILP at a ladder of caps and
keeps the one with the lowest J: the weight of load against locality is load_excess_s /
remote_visit_s, in the profile's units.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from moeplan.core import progress
from moeplan.passes.cost.cost_model import COHERENT, STANDARD
from moeplan.passes.cost.runtime_ops import runtime_ops, runtime_profile

CAP_LADDER = (0.05, 0.1, 0.2, 0.4, 0.8, 1.6)


@dataclass(frozen=True)
class TimePrices:
    """Seconds one remote slot and one slot of max-load excess cost (see module docstring)."""

    remote_visit_s: float
    load_excess_s: float
    free_excess: float  # share of the mean load the slowest rank may carry above it for free

    @property
    def load_weight(self) -> float:
        """Remote slots one slot of max-load excess is worth (the ILP's balance weight, in time)."""
        return self.load_excess_s / max(self.remote_visit_s, 1e-30)

    def to_dict(self) -> dict:
        return {"remote_visit_s": self.remote_visit_s, "load_excess_s": self.load_excess_s,
                "free_excess": self.free_excess, "load_weight": self.load_weight}


def time_prices(profile, shape, workload, world: int, gpus_per_node: int, num_experts: int, mode: str) -> TimePrices:
    """Prices from a hardware profile, a ModelShape and a Workload for one communication mode."""
    if mode not in (COHERENT, STANDARD):
        raise ValueError(f"mode must be {COHERENT!r} or {STANDARD!r}, got {mode!r}")
    W, k = world, shape.top_k
    steps = [len(s) for s in workload.steps()]
    weights = np.array(steps, dtype=float) / max(sum(steps), 1)
    back = shape.combine_row_bytes if mode == STANDARD else shape.keyed_row_bytes
    share_other = (W - gpus_per_node) / (W - 1) if W > 1 else 0.0
    tiers = ("same_node", "other_node") if share_other else ("same_node",)  # one node: the other tier may be unknown
    shares = {"same_node": 1 - share_other, "other_node": share_other}
    per_byte = sum(shares[t] / profile.bandwidth_bytes_per_s[t] for t in tiers)
    latency = sum(shares[t] * profile.message_latency_s[t] for t in tiers)
    alone = float(sum(w * math.exp(-n * k / max(W * W, 1)) for w, n in zip(weights, steps)))
    remote = (shape.dispatch_row_bytes + back) * per_byte + 2 * latency * alone
    opens_call = float(sum(w * math.exp(-n * k / max(num_experts, 1)) for w, n in zip(weights, steps)))
    ops = runtime_ops(profile, shape.architecture, shape.held_dtype)  # the counts and op cost cost_model.predict prices with
    call = ops.expert_call * runtime_profile(profile).op_overhead_s + shape.expert_bytes / profile.memory_bytes_per_s
    load = shape.expert_flops / profile.flops_per_s + call * opens_call
    return TimePrices(remote_visit_s=remote, load_excess_s=load, free_excess=max(0.0, W / profile.parallel_ranks - 1.0))


def device_loads(trace, hosts: np.ndarray) -> np.ndarray:
    """float [L, D]: slots each device serves, a replicated expert's slots split evenly."""
    loads = trace.expert_loads().astype(float)  # [L, E]
    E = loads.shape[1]
    h = hosts[:, :E, :].astype(float)
    return np.einsum("le,led->ld", loads / np.maximum(h.sum(axis=2), 1), h)


def priced_objective(trace, hosts: np.ndarray, topology, prices: TimePrices, mode: str) -> dict:
    """J (seconds per token) and its parts for a placement on a trace (module docstring)."""
    from moeplan.passes.optimize.placement.metrics import score_placement

    T = max(trace.num_tokens, 1)
    W = topology.devices
    if mode == COHERENT:
        score = score_placement(trace, hosts, topology)
        transitions = int((trace.experts[:, 1:, :] >= 0).sum())
        remote = (1.0 - score.gpu_local_fraction) * transitions / T
    else:
        owner = _primary_ranks(trace, hosts)  # [T, L, k] a rank per slot
        distinct = sum(len(set(row)) for row in owner.reshape(-1, owner.shape[2]).tolist() if row)
        remote = distinct * (W - 1) / W / T
    loads = device_loads(trace, hosts)
    mean = loads.mean(axis=1, keepdims=True)
    excess = float(np.maximum(loads.max(axis=1, keepdims=True) - (1 + prices.free_excess) * mean, 0).sum()) / T
    return {"objective_s": prices.remote_visit_s * remote + prices.load_excess_s * excess,
            "remote_slots_per_token": remote, "excess_slots_per_token": excess}


def _primary_ranks(trace, hosts: np.ndarray) -> np.ndarray:
    """int [T, L, k]: the first device hosting each slot's expert (standard mode's counting)."""
    first = hosts.argmax(axis=2)  # [L, E]
    experts = np.maximum(trace.experts.astype(np.int64), 0)
    L = experts.shape[1]
    return np.stack([first[l][experts[:, l, :]] for l in range(L)], axis=1)


def choose_load_cap(trace, request, prices: dict, ladder=CAP_LADDER) -> tuple:
    """Solve the ILP at each cap of `ladder` (tightest first) and keep, per mode, the cap with the
    lowest priced objective; `prices` {mode: TimePrices} (each cap is solved once for all modes).

    Stops once every mode's objective has risen twice in a row past its best, or the placement
    stops changing (a looser cap cannot help). Returns ({mode: (placement, balance)}, rows
    {balance, mode: {objective_s, remote_slots_per_token, excess_slots_per_token}, chosen_for})."""
    from moeplan.passes.optimize.placement.policies import plan_placement
    from moeplan.core.errors import UserError

    best, rows, previous = {}, [], None
    worse = dict.fromkeys(prices, 0)
    with progress.step(f"ilp load caps, {request.redundant} redundant slot(s)", total=len(ladder)) as advance:
        for balance in ladder:
            advance(0, description=f"ilp load caps, {request.redundant} redundant slot(s): balance {balance:g}")
            try:
                placement = plan_placement(trace, replace(request, policy="ilp", balance=balance))
            except UserError:  # a cap no placement meets (an expert heavier than the cap): try looser
                advance()
                continue
            advance()
            hosts = placement.hosts()
            if previous is not None and np.array_equal(hosts, previous):
                break
            previous = hosts
            row = {"balance": balance}
            for mode, p in prices.items():
                row[mode] = priced_objective(trace, hosts, request.topology, p, mode)
                j = row[mode]["objective_s"]
                if mode not in best or j < best[mode][0]:
                    best[mode], worse[mode] = (j, placement, balance), 0
                else:
                    worse[mode] += 1
            rows.append(row)
            if all(w >= 2 for w in worse.values()):
                break
    if not best:
        raise UserError("no load cap on the ladder gives a feasible ILP placement; add --redundant slots")
    for row in rows:
        row["chosen_for"] = sorted(m for m, b in best.items() if b[2] == row["balance"])
    return {m: (b[1], b[2]) for m, b in best.items()}, rows
