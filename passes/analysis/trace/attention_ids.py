"""The attention id of a token: the vocabulary id of the key it attends to most, recorded beside its routing
(torch models: `record.py`; ONNX models: `record_onnx.py`)."""
from __future__ import annotations

import numpy as np


def attention_argmax_ids(probs: np.ndarray, input_ids: np.ndarray) -> np.ndarray:
    """[B, S] vocabulary ids of the key each query attends to most (probs summed over heads).

    Masked (non-attended) keys have probability 0, so the argmax is always among attended ones;
    ties go to the earliest position.
    """
    summed = probs.sum(axis=1)  # [B, S_q, S_k]
    best = summed.argmax(axis=-1)  # [B, S_q]
    return np.take_along_axis(input_ids, best, axis=1)
