"""TinyMoE's state-dict naming and byte tokenizer, for tests (moved out of the runtime: no bundle needs it).

(The torchrun and Lambda runtimes run TinyMoE's own module, `model/model.py`, through
`runtime/model/library_model.py` and `runtime/lambda_/model.py`.)
"""
from __future__ import annotations


def is_expert_tensor(name: str) -> tuple | None:
    """(layer, expert) if the state-dict entry belongs to a routed expert, else None (dense)."""
    parts = name.split(".")
    if len(parts) > 4 and parts[0] == "blocks" and parts[2] == "moe" and parts[3] == "experts":
        return int(parts[1]), int(parts[4])
    return None



def encode(text: str) -> list:
    """TinyMoE's tokenizer: UTF-8 bytes."""
    return list(text.encode("utf-8"))


def decode(ids: list) -> str:
    return bytes(int(i) for i in ids).decode("utf-8", errors="replace")
