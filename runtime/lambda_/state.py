"""The state of one Step Functions execution of a Lambda bundle: one request's generation.

Why its own file: the front function writes it (as the execution's input) and reads it back
(the output) without torch; the dense functions advance it (`decode.py`). JSON, under Step
Functions' 256 KB:
  {"request", "step", "lens": [prompt length per sequence], "prompt": [[ids]] (step 0 only),
   "tokens": [[generated ids]], "finished": [null | "stop" | "length"], "done": bool,
   "gen": {"max_tokens", "temperature", "top_p", "top_k", "seed", "stop_token_ids", "keep_logits"},
   "active": {replica tag: 1} (the expert replicas the next MoE layer runs)}.
"""
from __future__ import annotations


def initial_state(request: str, prompts: list, gen: dict) -> dict:
    """The execution's input for prompts (lists of ids) and generation settings."""
    return {"request": request, "step": 0, "lens": [len(p) for p in prompts], "prompt": [list(p) for p in prompts],
            "tokens": [[] for _ in prompts], "finished": [None for _ in prompts], "done": False,
            "gen": dict(gen), "active": {}}
