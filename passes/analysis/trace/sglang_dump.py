"""SGLang expert-distribution dumps -> moeplan routing traces (tests write dumps with tests/sglang_dump_writer.py).

Layout followed: sglang 0.5.23, `python/sglang/srt/eplb/expert_distribution.py`
(`_DetailSinglePassGatherer`, `_DetailAccumulator.dump`, `_StatAccumulator.dump`), written when
the server runs with `--expert-distribution-recorder-mode per_token|stat` and
`/dump_expert_distribution_record` is called (files go to `SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR`).

* `per_token`: one `torch.save` file per rank, `{"records": [...], "last_physical_to_logical_map":
  int [num_hidden_layers, physical slots]}`. Each record is one forward pass on one rank:
  `forward_pass_id`, `rank`, `gatherer_key`, `input_ids` and `positions` (lists, one per token),
  `extend_seq_lens` (tokens per request in the pass, or None), `forward_mode` (`ForwardMode` value:
  1 EXTEND, 2 DECODE, 3 MIXED, 4 IDLE, ...), `topk_ids_of_layer` (int32 [num_hidden_layers, tokens,
  8], physical slot ids, -1 = none; dense layers stay -1), `misc_objects`, `global_physical_count`.
* `stat`: rank 0 writes `{"rank", "logical_count": int [steps, num_hidden_layers, experts],
  "average_utilization_rate_over_window"}`: counts only, so it becomes a loads-only trace.
* `per_pass`: the per_token file layout, but each record holds only `global_physical_count`
  (int [num_hidden_layers, physical slots], that rank's counts for the pass): summed over records
  and ranks and folded onto experts through the map, a loads-only trace too.

Mapping onto the trace format:
* slots -> logical experts through `last_physical_to_logical_map` (SGLang says "last": record
  without `--enable-eplb`, or the map may have changed during the recording);
* MoE layers = the layers some record routes (dense layers never do); trace layer l is the l-th;
  a token routed at no layer is padding (CUDA-graph batches pad with -1 rows) and is dropped;
* K = the widest routed row (SGLang pads to 8 columns with -1); choices keep the logged order and
  get weights 1/K (the dump holds no gate weights);
* `sequence`: in EXTEND/MIXED passes `extend_seq_lens` splits the pass into its requests, one
  sequence each; a DECODE token has no request id in the dump, so it is a sequence of its own;
* ranks: with tensor-parallel attention every rank logs the same batch, so a record equal to one
  already read (same pass id, tokens and choices) is skipped; data-parallel ranks' batches differ
  and are all kept.
Files are read with `torch.load(weights_only=True)`: a dump can never run code.
"""
from __future__ import annotations

import os
import pickle
import zipfile
from pathlib import Path

import numpy as np

from moeplan.passes.analysis.trace.format import Trace, loads_trace, make_trace
from moeplan.core.errors import UserError

EXTEND, MIXED = 1, 3  # ForwardMode values whose extend_seq_lens split a pass into requests
TOPK_COLUMNS = 8  # SGLang's per_token buffer width (`_DetailSinglePassGatherer._TOP_K_NUM`)
PER_TOKEN_KEYS = ("records", "last_physical_to_logical_map")
RECORD_KEYS = ("forward_pass_id", "input_ids", "positions", "forward_mode", "topk_ids_of_layer")


def load_dump(path: Path) -> dict:
    """One dump file as plain Python objects and numpy arrays (weights_only: no code runs)."""
    import torch

    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, zipfile.BadZipFile, OSError, ValueError) as exc:
        raise UserError(f"'{path}' is not a readable SGLang dump ({exc.__class__.__name__}: {str(exc)[:120]}); "
                        f"give the .pt files /dump_expert_distribution_record wrote") from None
    if not isinstance(data, dict):
        raise UserError(f"'{path}' holds a {type(data).__name__}, not an SGLang expert-distribution dump (a dict)")
    return data


def dump_kind(data: dict) -> str | None:
    """'per_token', 'per_pass', 'stat' or None for a loaded dump."""
    if all(key in data for key in PER_TOKEN_KEYS):
        records = data["records"]
        if (isinstance(records, list) and records and all(isinstance(r, dict) for r in records)
                and all("topk_ids_of_layer" not in r and "global_physical_count" in r for r in records)):
            return "per_pass"
        return "per_token"
    if "logical_count" in data:
        return "stat"
    return None


def _slot_map(data: dict, path: Path) -> np.ndarray:
    """The dump's `last_physical_to_logical_map`, validated: int64 [layers, slots]."""
    slot_map = _numpy(data["last_physical_to_logical_map"], "'last_physical_to_logical_map'", f"'{path}'")
    if slot_map.ndim != 2 or not np.issubdtype(slot_map.dtype, np.integer) or slot_map.size == 0 or slot_map.min() < 0:
        raise UserError(f"'{path}': 'last_physical_to_logical_map' must be a non-negative integer array [layers, slots]")
    return slot_map.astype(np.int64)


def _numpy(value, what: str, where: str) -> np.ndarray:
    try:
        return value.numpy() if hasattr(value, "numpy") else np.asarray(value)
    except (ValueError, TypeError, RuntimeError):
        raise UserError(f"{where}: {what} is not an array") from None


def _int_list(record: dict, key: str, where: str) -> np.ndarray:
    arr = _numpy(record[key], f"'{key}'", where)
    if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
        raise UserError(f"{where}: '{key}' must be a list of integers")
    return arr.astype(np.int64)


class _PerTokenReader:
    """Accumulates per_token records from every rank's file (see module doc)."""

    def __init__(self):
        self.choices = []  # int [n, num_hidden_layers, 8] physical ids per record
        self.token_ids, self.positions, self.sequence = [], [], []
        self.slot_map: np.ndarray | None = None
        self.seen = set()
        self.next_sequence = 0

    def add_file(self, path: Path, data: dict) -> None:
        slot_map = _slot_map(data, path)
        if self.slot_map is None:
            self.slot_map = slot_map
        elif not np.array_equal(self.slot_map, slot_map):
            raise UserError(f"'{path}': its 'last_physical_to_logical_map' differs from the other ranks' files; "
                            f"give the files of one dump only")
        records = data["records"]
        if not isinstance(records, list):
            raise UserError(f"'{path}': 'records' must be a list of per-pass records")
        for index, record in enumerate(records):
            self._add_record(f"'{path}' record {index}", record)

    def _add_record(self, where: str, record) -> None:
        if not isinstance(record, dict) or any(key not in record for key in RECORD_KEYS):
            raise UserError(f"{where}: a per_token record needs {', '.join(RECORD_KEYS)}")
        mode = record["forward_mode"]
        if not isinstance(mode, int) or isinstance(mode, bool):
            raise UserError(f"{where}: 'forward_mode' must be the integer value of SGLang's ForwardMode, got {type(mode).__name__}")
        input_ids = _int_list(record, "input_ids", where)
        positions = _int_list(record, "positions", where)
        n = len(input_ids)
        if len(positions) != n:
            raise UserError(f"{where}: {len(positions)} positions for {n} input_ids")
        if n == 0:
            return  # IDLE passes (data-parallel ranks without requests)
        topk = _numpy(record["topk_ids_of_layer"], "'topk_ids_of_layer'", where)
        num_layers, slots = self.slot_map.shape
        if topk.ndim != 3 or topk.shape[:2] != (num_layers, n) or not np.issubdtype(topk.dtype, np.integer):
            raise UserError(f"{where}: 'topk_ids_of_layer' must be an integer array [{num_layers} layers, {n} tokens, "
                            f"choices], got shape {tuple(topk.shape)}")
        if topk.size and (topk.min() < -1 or topk.max() >= slots):
            raise UserError(f"{where}: 'topk_ids_of_layer' holds slot ids outside -1..{slots - 1} "
                            f"(the physical_to_logical_map has {slots} slots)")
        key = (repr(record["forward_pass_id"]), input_ids.tobytes(), positions.tobytes(), topk.tobytes())
        if key in self.seen:
            return  # the same batch logged by another tensor-parallel rank
        self.seen.add(key)
        width = max(topk.shape[2], TOPK_COLUMNS)
        padded = np.full((num_layers, n, width), -1, dtype=np.int64)
        padded[:, :, :topk.shape[2]] = topk
        self.choices.append(np.transpose(padded, (1, 0, 2)))
        self.token_ids.append(input_ids)
        self.positions.append(positions)
        self.sequence.append(self._sequences(record, n, where))

    def _sequences(self, record: dict, n: int, where: str) -> np.ndarray:
        lens = record.get("extend_seq_lens")
        if record["forward_mode"] in (EXTEND, MIXED) and lens is not None:
            lens = _int_list(record, "extend_seq_lens", where)
            if lens.sum() != n or (lens.size and lens.min() < 1):
                raise UserError(f"{where}: 'extend_seq_lens' {lens.tolist()[:8]} does not split its {n} tokens")
        else:
            lens = np.ones(n, dtype=np.int64)
        ids = np.repeat(np.arange(self.next_sequence, self.next_sequence + len(lens)), lens)
        self.next_sequence += len(lens)
        return ids

    def trace(self, source: str, num_experts: int | None) -> Trace:
        if not self.choices:
            raise UserError(f"{source} holds no per_token records with tokens; record some traffic between "
                            f"/start_expert_distribution_record and /dump_expert_distribution_record")
        physical = np.concatenate(self.choices)  # [T, num_hidden_layers, width]
        valid = physical >= 0
        moe_layers = np.flatnonzero(valid.any(axis=(0, 2)))
        routed = valid.any(axis=(1, 2))  # padding rows (CUDA-graph batches) route nowhere
        physical, valid = physical[routed][:, moe_layers], valid[routed][:, moe_layers]
        K = int(valid.sum(axis=2).max())
        layer_map = self.slot_map[moe_layers]  # [L, slots]
        logical = _to_logical(physical, valid, layer_map)
        experts = _compact(logical, K)
        experts_total = int(self.slot_map.max()) + 1 if num_experts is None else num_experts
        token_ids, positions, sequence = (np.concatenate(a)[routed] for a in (self.token_ids, self.positions, self.sequence))
        try:
            return make_trace(experts, num_experts=experts_total, token_ids=token_ids, positions=positions,
                              sequence=sequence)
        except UserError as exc:
            raise UserError(f"{source}: {exc}") from None


def _to_logical(physical: np.ndarray, valid: np.ndarray, layer_map: np.ndarray) -> np.ndarray:
    """int [T, L, W]: logical expert of each physical slot id (-1 where not valid)."""
    L = layer_map.shape[0]
    rows = np.broadcast_to(np.arange(L)[None, :, None], physical.shape)
    return np.where(valid, layer_map[rows, np.where(valid, physical, 0)], -1)


def _compact(ids: np.ndarray, K: int) -> np.ndarray:
    """int [T, L, K]: each row's valid ids first in logged order, then -1 padding."""
    order = np.argsort(ids < 0, axis=2, kind="stable")
    return np.take_along_axis(ids, order, axis=2)[:, :, :K]


def _stat_loads(files: list) -> np.ndarray:
    """int64 [num_hidden_layers, E]: stat dumps' logical counts summed over steps and files."""
    total = None
    for path, data in files:
        counts = _numpy(data["logical_count"], "'logical_count'", f"'{path}'")
        if counts.ndim == 2:
            counts = counts[None]
        if counts.ndim != 3 or not np.issubdtype(counts.dtype, np.integer) or (counts.size and counts.min() < 0):
            raise UserError(f"'{path}': 'logical_count' must be non-negative integer counts [steps, layers, experts], "
                            f"got shape {tuple(counts.shape)}")
        summed = counts.sum(axis=0, dtype=np.int64)
        if total is not None and total.shape != summed.shape:
            raise UserError(f"'{path}': 'logical_count' has {summed.shape[0]} layers x {summed.shape[1]} experts, "
                            f"other files {total.shape[0]} x {total.shape[1]}; give dumps of one model")
        total = summed if total is None else total + summed
    return total


def _per_pass_loads(files: list) -> np.ndarray:
    """int64 [num_hidden_layers, E]: per_pass records' physical counts, summed, folded onto experts."""
    total = None
    for path, data in files:
        slot_map = _slot_map(data, path)
        for index, record in enumerate(data["records"]):
            counts = _numpy(record["global_physical_count"], "'global_physical_count'", f"'{path}' record {index}")
            if counts.shape != slot_map.shape or not np.issubdtype(counts.dtype, np.integer) or counts.min() < 0:
                raise UserError(f"'{path}' record {index}: 'global_physical_count' must be non-negative integer counts "
                                f"shaped like the physical_to_logical_map {slot_map.shape}, got {tuple(counts.shape)}")
            experts = int(slot_map.max()) + 1
            logical = np.stack([np.bincount(row, weights=c, minlength=experts) for row, c in zip(slot_map, counts)])
            if total is not None and total.shape != logical.shape:
                raise UserError(f"'{path}': its records count {logical.shape} layers x experts, others {total.shape}")
            total = logical if total is None else total + logical
    return np.rint(total).astype(np.int64)


def _loads_only(loads: np.ndarray, path: Path, num_experts: int | None, top_k: int) -> Trace:
    """The loads-only trace of [num_hidden_layers, E] counts: rows that count no token are dense layers."""
    routed = np.flatnonzero(loads.sum(axis=1) > 0)
    if not len(routed):
        raise UserError(f"'{path}': the dump counts no tokens; record traffic before dumping")
    if num_experts is not None and num_experts != loads.shape[1]:
        raise UserError(f"'{path}': the dump counts {loads.shape[1]} experts per layer, not --num-experts {num_experts}")
    return loads_trace(loads[routed], top_k=top_k)


def dump_files(path: Path) -> list:
    """The dump files at `path`: the file itself, or every `*.pt` in a directory (sorted)."""
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix == ".pt" and p.is_file())
        if not files:
            raise UserError(f"directory '{path}' holds no .pt files; give the SGLang dump directory "
                            f"(SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR) or one dump file")
        return files
    if not path.is_file():
        raise UserError(f"SGLang dump '{path}' does not exist; give a .pt dump or the directory holding them")
    return [path]


def import_sglang_dump(path: str | os.PathLike, num_experts: int | None = None, top_k: int = 1) -> Trace:
    """Trace from SGLang per_token dumps (per-token) or per_pass / stat dumps (loads-only); see module doc.

    `top_k` is recorded in loads-only traces (those dumps do not say it)."""
    path = Path(path)
    loaded = [(p, load_dump(p)) for p in dump_files(path)]
    kinds = {p: dump_kind(d) for p, d in loaded}
    unknown = [str(p) for p, k in kinds.items() if k is None]
    if unknown:
        raise UserError(f"'{unknown[0]}' is not an SGLang expert-distribution dump (no 'records' + "
                        f"'last_physical_to_logical_map', no 'logical_count')")
    if len(set(kinds.values())) > 1:
        raise UserError(f"'{path}' mixes {' and '.join(sorted(set(kinds.values())))} dumps; import them separately")
    kind = next(iter(kinds.values()))
    if kind == "stat":
        return _loads_only(_stat_loads(loaded), path, num_experts, top_k)
    if kind == "per_pass":
        return _loads_only(_per_pass_loads(loaded), path, num_experts, top_k)
    reader = _PerTokenReader()
    for p, data in loaded:
        reader.add_file(p, data)
    return reader.trace(f"'{path}'", num_experts)
