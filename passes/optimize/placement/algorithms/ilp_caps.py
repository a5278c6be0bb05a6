"""The staged ILP's replica counts and per-layer load caps, checked achievable before any solve.

Replica counts follow EPLB's rule (`eplb.replica_counts`: redundant slots go to the highest load
per replica); the cap of layer l is (1 + balance) x a reference load: the mean GPU load
("mean"), or the max GPU load of EPLB's balanced packing with the same replicas ("eplb", always
achievable). `check_caps` names the layer and expert when the hottest replica alone breaks a cap.
"""
from __future__ import annotations

import numpy as np

from moeplan.passes.optimize.placement.algorithms.eplb import balanced_packing, replica_counts
from moeplan.core.errors import UserError


def initial_hosts(loads: np.ndarray, replicas: np.ndarray, devices: int, slots: int) -> np.ndarray:
    """bool [L, E, D]: EPLB-style balanced packing of each layer's replicas (the warm start)."""
    L, E = loads.shape
    hosts = np.zeros((L, E, devices), dtype=bool)
    for l in range(L):
        replica_expert = np.repeat(np.arange(E), replicas[l])
        pack = balanced_packing((loads[l] / replicas[l])[replica_expert], replica_expert, devices, slots)
        hosts[l, replica_expert, pack] = True
    return hosts


BALANCE_BASES = ("mean", "eplb")


def least_max_load(loads: np.ndarray, replicas: np.ndarray, devices: int, slots: int) -> np.ndarray:
    """float [L]: a lower bound on any placement's max GPU load with these replica counts.

    The mean; and the GPU holding the hottest replica, which also holds `slots - 1` replicas of
    other experts, each at least as heavy as the lightest ones."""
    per_replica = loads / replicas
    mean = loads.sum(axis=1) / devices
    order = np.sort(per_replica, axis=1)
    hottest = order[:, -1]
    lightest_others = order[:, : max(slots - 1, 0)].sum(axis=1) if slots > 1 else 0.0
    return np.maximum(mean, hottest + lightest_others)


def layer_caps(loads: np.ndarray, replicas: np.ndarray, devices: int, slots: int, balance: float, base: str) -> np.ndarray:
    """float [L]: per-GPU load cap, (1 + balance) x a per-layer reference load.

    base "mean": the mean device load (ARCHITECTURE's definition). "eplb": the max device load of
    the EPLB-style packing with the same replicas, an achievable value: the cap is then always
    feasible and keeps every layer within `balance` of EPLB's balance."""
    if base == "mean":
        reference = loads.sum(axis=1) / devices
    elif base == "eplb":
        packed = initial_hosts(loads, replicas, devices, slots)
        reference = np.array([(packed[l].T.astype(float) @ (loads[l] / replicas[l])).max() for l in range(len(loads))])
    else:
        raise UserError(f"--balance-base must be one of {BALANCE_BASES}, got {base!r}")
    return (1.0 + balance) * reference


def check_caps(loads: np.ndarray, replicas: np.ndarray, caps: np.ndarray, devices: int, slots: int, balance: float) -> None:
    """Fail early, naming layer and expert, when the hottest replica (with the lightest replicas
    that must share its GPU) already exceeds its layer's cap."""
    least = least_max_load(loads, replicas, devices, slots)
    over = least > caps * (1 + 1e-9)
    if over.any():
        layer = int(np.flatnonzero(over)[0])
        per_replica = loads[layer] / replicas[layer]
        expert = int(np.argmax(per_replica))
        mean = loads[layer].sum() / devices
        need = least[layer] / mean - 1
        raise UserError(
            f"load balance is infeasible at MoE layer {layer}: expert {expert} carries {per_replica[expert]:.0f} "
            f"tokens per replica, so its GPU (with {slots - 1} more experts) holds at least {least[layer]:.0f}, over the cap "
            f"{caps[layer]:.0f} = (1 + {balance:g}) x {'mean ' + format(mean, '.0f') if abs(caps[layer] / (1 + balance) - mean) < 1e-6 * mean else 'reference'}; "
            f"add --redundant slots, or use --balance {need:.3f} or more, or --balance-base eplb"
        )


def eplb_replicas_and_caps(loads: np.ndarray, devices: int, redundant: int, balance: float, balance_base: str) -> tuple:
    """(int [L, E] EPLB replica counts for E + redundant slots, float [L] per-layer load caps), the caps
    checked achievable (a one-line error names the layer otherwise). loads: float [L, E]."""
    L, E = loads.shape
    slots = (E + redundant) // devices
    replicas = np.stack([replica_counts(loads[l], E + redundant, devices) for l in range(L)])
    caps = layer_caps(loads, replicas, devices, slots, balance, balance_base)
    check_caps(loads, replicas, caps, devices, slots, balance)
    return replicas, caps
