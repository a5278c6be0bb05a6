"""Matching a running sequence's EAM against the EAMC (MoE-Infinity's Eq. 1), numpy only.

Why its own file in the runtime: MoE-Infinity's prefetcher (prefetch.py) runs inside bundles,
where moeplan is absent; passes/analysis/activation.py
builds the EAMC with the same functions.
"""
from __future__ import annotations

import numpy as np


def row_normalised(eams: np.ndarray) -> np.ndarray:
    """L2-normalised rows of EAMs [..., L, E] (all-zero rows stay zero), float64."""
    m = np.asarray(eams, dtype=float)
    norms = np.linalg.norm(m, axis=-1, keepdims=True)
    return np.divide(m, norms, out=np.zeros_like(m), where=norms > 0)


def eam_distance(partial: np.ndarray, full: np.ndarray) -> np.ndarray:
    """The paper's distance from one (partial) EAM [L, E] to EAMs [..., L, E] -> [...].

    Averaged over the layers where `partial` has a non-zero row; 1.0 when it has none."""
    p = row_normalised(partial)
    ran = np.linalg.norm(p, axis=-1) > 0
    if not ran.any():
        return np.ones(np.asarray(full).shape[:-2])
    cos = (row_normalised(full)[..., ran, :] * p[ran]).sum(axis=-1)
    return 1.0 - cos.mean(axis=-1)


def nearest_entry(partial: np.ndarray, eamc_unit: np.ndarray) -> int:
    """Index of the EAMC entry nearest a partial EAM; `eamc_unit` = row_normalised(EAMC) [P, L, E].
    Ties: the lowest index."""
    p = row_normalised(partial)
    ran = np.linalg.norm(p, axis=-1) > 0
    if not ran.any():
        return 0
    sims = np.einsum("ple,le->p", eamc_unit[:, ran, :], p[ran])
    return int(np.argmax(sims))
