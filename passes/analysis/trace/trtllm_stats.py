"""TensorRT-LLM expert statistics -> a loads-only moeplan trace.

Layout followed: TensorRT-LLM `tensorrt_llm/_torch/expert_statistic.py` (NVIDIA/TensorRT-LLM at
commit c85e8726), enabled with `EXPERT_STATISTIC_ITER_RANGE=START-STOP` and written to
`EXPERT_STATISTIC_PATH` (default `expert_statistic/`):
* `meta_info.json` (rank 0): `{"num_experts": N, "num_experts_per_token": K}` (+ `ep_size`,
  `experts_per_rank` when dispatch dumping is on). N counts *slots* when the MoE load balancer
  is on (the MoE module records `token_selected_slots`), experts otherwise;
* `rank{r}.safetensors`: one int tensor [N] per (iteration, MoE layer), named
  `"{iteration}_{layer}"`, layer = the decoder-layer index of the MoE module: tokens per expert.

Mapping: counts summed over iterations and ranks (as TensorRT-LLM's own reader in
`tensorrt_llm/tools/layer_wise_benchmarks` does; with tensor-parallel attention every rank counts
the same tokens, a factor that does not change balance) into `loads` [MoE layers, N], layers in
ascending decoder-layer order. Slot counts are mapped to experts through the load balancer's
`initial_global_assignments` when given (static balancer only: `layer_updates_per_iter: 0`).
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np

from moeplan.passes.analysis.trace.format import Trace, loads_trace
from moeplan.core.errors import UserError

STAT_KEY = re.compile(r"^(\d+)_(\d+)$")
RANK_FILE = re.compile(r"^rank(\d+)\.safetensors$")


def _meta(path: Path) -> dict:
    meta_path = path / "meta_info.json"
    if not meta_path.is_file():
        raise UserError(f"'{path}' has no meta_info.json; give the EXPERT_STATISTIC_PATH directory TensorRT-LLM wrote")
    try:
        meta = json.loads(meta_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"'{meta_path}' is not valid JSON ({exc.__class__.__name__}); re-run the statistics dump") from None
    for key in ("num_experts", "num_experts_per_token"):
        value = meta.get(key) if isinstance(meta, dict) else None
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise UserError(f"'{meta_path}': '{key}' must be a positive integer, got {json.dumps(value)}")
    return meta


def rank_counts(path: Path, num_slots: int) -> dict:
    """{decoder layer: int64 [num_slots]} summed over iterations and ranks."""
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    files = sorted((p for p in path.iterdir() if RANK_FILE.match(p.name)), key=lambda p: int(RANK_FILE.match(p.name).group(1)))
    if not files:
        raise UserError(f"'{path}' has no rank<r>.safetensors files; give the EXPERT_STATISTIC_PATH directory")
    per_layer: dict = {}
    for file in files:
        try:
            tensors = load_file(str(file))
        except (SafetensorError, OSError, ValueError) as exc:
            raise UserError(f"'{file}' is not a readable safetensors file ({str(exc)[:100]})") from None
        for name, counts in sorted(tensors.items()):
            match = STAT_KEY.match(name)
            if not match:
                raise UserError(f"'{file}': tensor '{name}' is not named '<iteration>_<layer>'")
            if counts.shape != (num_slots,) or not np.issubdtype(counts.dtype, np.integer) or counts.min() < 0:
                raise UserError(f"'{file}': tensor '{name}' must hold {num_slots} non-negative integer counts "
                                f"(meta_info num_experts), got shape {counts.shape} {counts.dtype}")
            layer = int(match.group(2))
            per_layer[layer] = per_layer.get(layer, 0) + counts.astype(np.int64)
    if not per_layer:
        raise UserError(f"'{path}': the statistics hold no iteration; widen EXPERT_STATISTIC_ITER_RANGE")
    return per_layer


def slots_to_experts(per_layer: dict, assignments: dict, num_slots: int) -> dict:
    """Fold slot counts onto experts: `assignments[layer][slot]` = expert in that slot."""
    out = {}
    for layer, counts in per_layer.items():
        slots = assignments.get(layer)
        if slots is None:
            raise UserError(f"the load-balancer assignments have no entry for MoE layer {layer}; "
                            f"give the moe_load_balancer YAML the statistics run used")
        if len(slots) != num_slots:
            raise UserError(f"the load-balancer assignments for layer {layer} list {len(slots)} slots, "
                            f"the statistics count {num_slots}")
        slots = np.asarray(slots, dtype=np.int64)
        out[layer] = np.bincount(slots, weights=counts, minlength=int(slots.max()) + 1).astype(np.int64)
    return out


def read_assignments(path: str | os.PathLike) -> dict:
    """`initial_global_assignments` from a load-balancer YAML (ours or any `moe_config.load_balancer`)."""
    import yaml

    path = Path(path)
    try:
        doc = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise UserError(f"cannot read load-balancer YAML '{path}' ({exc.__class__.__name__})") from None
    if isinstance(doc, dict) and isinstance(doc.get("moe_config"), dict):
        doc = doc["moe_config"].get("load_balancer")
    assignments = doc.get("initial_global_assignments") if isinstance(doc, dict) else None
    if not isinstance(assignments, dict):
        raise UserError(f"'{path}' has no initial_global_assignments; give the load-balancer YAML of the statistics run")
    out = {}
    for layer, slots in assignments.items():
        if (not isinstance(layer, int) or not isinstance(slots, list)
                or not all(isinstance(e, int) and not isinstance(e, bool) and e >= 0 for e in slots) or not slots):
            raise UserError(f"'{path}': initial_global_assignments must map layer numbers to lists of expert ids "
                            f"(entry {str(layer)[:20]!r} does not)")
        out[layer] = slots
    return out


def import_trtllm_stats(path: str | os.PathLike, num_experts: int | None = None,
                        assignments: dict | None = None) -> Trace:
    """Loads-only trace from an EXPERT_STATISTIC_PATH directory (see module doc)."""
    path = Path(path)
    if not path.is_dir():
        raise UserError(f"TensorRT-LLM statistics '{path}' is not a directory; give the EXPERT_STATISTIC_PATH directory")
    meta = _meta(path)
    num_slots = meta["num_experts"]
    per_layer = rank_counts(path, num_slots)
    if assignments is not None:
        per_layer = slots_to_experts(per_layer, assignments, num_slots)
    width = max(len(c) for c in per_layer.values())
    if num_experts is not None:
        if width > num_experts:
            raise UserError(f"'{path}' counts {width} experts per layer but --num-experts is {num_experts}; with the load "
                            f"balancer on, the counts are per slot: give --trtllm-assignments")
        width = num_experts
    loads = np.zeros((len(per_layer), width), dtype=np.int64)
    for row, layer in enumerate(sorted(per_layer)):
        loads[row, :len(per_layer[layer])] = per_layer[layer]
    return loads_trace(loads, top_k=meta["num_experts_per_token"])
