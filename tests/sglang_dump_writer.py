"""A test fixture: SGLang per_token expert-distribution dumps written from a routed trace, laid out as
sglang 0.5.23's `python/sglang/srt/eplb/expert_distribution.py` (`_DetailAccumulator.dump`) writes
them, so the importer (`passes/analysis/trace/sglang_dump.py`) is tested on files of that layout."""
from __future__ import annotations

import os
from collections.abc import Iterable

import numpy as np

from moeplan.passes.analysis.trace.format import Trace
from moeplan.passes.analysis.trace.sglang_dump import EXTEND, TOPK_COLUMNS


def per_token_records(trace: Trace, moe_layers: Iterable[int], slot_map: np.ndarray, rank: int = 0) -> list:
    """SGLang per_token records for a routed trace: one EXTEND pass per sequence (see module doc).

    `moe_layers`: the decoder-layer index of each trace MoE layer; `slot_map` int [layers, slots]
    (the dump's `last_physical_to_logical_map`). Each logical expert is written as its replicas in
    turn (token t uses replica t mod copies), as SGLang's dynamic dispatch spreads them."""
    import torch

    moe_layers = list(moe_layers)
    num_layers, slots = slot_map.shape
    if len(moe_layers) != trace.num_layers:
        raise ValueError("one decoder-layer index per trace MoE layer")
    replicas = [[np.flatnonzero(slot_map[layer] == e) for e in range(trace.num_experts)] for layer in moe_layers]
    sequence = trace.sequence if trace.sequence is not None else np.zeros(trace.num_tokens, dtype=np.int64)
    positions = trace.positions if trace.positions is not None else None
    token_ids = trace.token_ids if trace.token_ids is not None else np.zeros(trace.num_tokens, dtype=np.int64)
    records = []
    _, first = np.unique(sequence, return_index=True)
    for pass_id, seq in enumerate(sequence[np.sort(first)]):
        rows = np.flatnonzero(sequence == seq)
        topk = np.full((num_layers, len(rows), max(trace.top_k, TOPK_COLUMNS)), -1, dtype=np.int32)
        for l, layer in enumerate(moe_layers):
            for i, t in enumerate(rows):
                for k, e in enumerate(trace.experts[t, l]):
                    if e >= 0:
                        copies = replicas[l][e]
                        topk[layer, i, k] = copies[t % len(copies)]
        count = np.zeros((num_layers, slots), dtype=np.int32)
        for layer in range(num_layers):
            ids = topk[layer][topk[layer] >= 0]
            count[layer] = np.bincount(ids, minlength=slots)
        records.append({
            "forward_pass_id": pass_id, "rank": rank, "gatherer_key": "primary",
            "input_ids": token_ids[rows].tolist(),
            "positions": (positions[rows] if positions is not None else np.arange(len(rows))).tolist(),
            "extend_seq_lens": [len(rows)], "forward_mode": EXTEND,
            "topk_ids_of_layer": torch.from_numpy(topk), "misc_objects": [],
            "global_physical_count": torch.from_numpy(count),
        })
    return records


def write_per_token_dump(path: str | os.PathLike, records: list, slot_map: np.ndarray) -> None:
    """Write one rank's per_token dump file the way SGLang's `_DetailAccumulator.dump` lays it out."""
    import torch

    torch.save({"records": records, "last_physical_to_logical_map": torch.from_numpy(np.asarray(slot_map))}, str(path))
