"""TinyMoE's dense units and experts over a flat batch of tokens, for the Lambda functions.

Why a separate file: a Lambda function holds one dense slice (or one expert) and sees the batch
as flat rows (every token of every sequence, sorted by sequence), with the residual stream `x`
and the last norm's output `h` carried between functions in a tensor file. The math is that of
`examples/tiny_moe/model.py` operation by operation, keyed by its state-dict names.
Only torch, safetensors and the standard library.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save


def to_bytes(tensors: dict) -> bytes:
    return st_save({k: v.contiguous() for k, v in sorted(tensors.items())})


def from_bytes(data: bytes) -> dict:
    return st_load(data)


def _norm(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _attention(w, prefix, h, seq, heads):
    """Causal attention of each sequence's rows (rows are grouped by sequence, in position order)."""
    n, d = h.shape
    hd = d // heads
    qkv = F.linear(h, w[f"{prefix}.qkv.weight"]).view(n, 3, heads, hd)
    out = torch.empty(n, d, dtype=h.dtype)
    for s in torch.unique_consecutive(seq).tolist():
        rows = (seq == s).nonzero().flatten()
        q, k, v = (qkv[rows, i].transpose(0, 1) for i in range(3))  # [heads, S, hd]
        scores = q @ k.transpose(-1, -2) / math.sqrt(hd)
        S = rows.numel()
        causal = torch.ones(S, S, dtype=torch.bool).tril()
        probs = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
        out[rows] = (probs @ v).transpose(0, 1).reshape(S, d)
    return F.linear(out, w[f"{prefix}.out.weight"])


def run_unit(name: str, w: dict, state: dict, config: dict) -> None:
    """Apply one dense unit to `state` in place (keys: ids, positions, seq, x, h, route_ids, route_w, logits)."""
    eps, heads = float(config["norm_eps"]), int(config["num_heads"])
    if name == "embed":
        state["x"] = w["embed.weight"][state["ids"]]
    elif name == "pos_embed":
        state["x"] = state["x"] + w["pos_embed.weight"][state["positions"]]
    elif name.endswith(".moe.router"):
        probs = torch.softmax(F.linear(state["h"], w[name.replace(".router", ".gate.weight")]), dim=-1)
        weights, ids = torch.topk(probs, int(config["top_k"]), dim=-1)
        state["route_ids"], state["route_w"] = ids, weights / weights.sum(dim=-1, keepdim=True)
    elif name.endswith("_norm"):
        state["h"] = _norm(state["x"], w[f"{name}.weight"], eps)
    elif name.endswith(".attn"):
        state["x"] = state["x"] + _attention(w, name, state["h"], state["seq"], heads)
    elif name == "head":
        state["logits"] = F.linear(state["h"], w["head.weight"])
    else:
        raise ValueError(f"no Lambda op for dense unit {name!r}")


def unit_tensors(name: str, names: list) -> list:
    """State-dict entries a dense unit reads."""
    prefix = name.replace(".router", ".gate") + "."
    return sorted(n for n in names if n.startswith(prefix))


def expert_ffn(w: dict, prefix: str, g: torch.Tensor) -> torch.Tensor:
    return F.linear(F.silu(F.linear(g, w[f"{prefix}.w_gate.weight"])) * F.linear(g, w[f"{prefix}.w_up.weight"]),
                    w[f"{prefix}.w_down.weight"])


def assignment(route_ids: torch.Tensor, expert: int, replicas: int) -> list:
    """(token rows, slots) for each replica of `expert`: its rows in token order, split in contiguous shares."""
    tok, slot = torch.where(route_ids == expert)
    n = tok.numel()
    per = math.ceil(n / replicas) if n else 0
    return [(tok[r * per:(r + 1) * per], slot[r * per:(r + 1) * per]) for r in range(replicas)]


def combine(state: dict, outputs: dict, replicas: dict) -> None:
    """x += sum of weighted expert outputs; `outputs[(e, r)]` are the rows of replica r of expert e."""
    x = state["x"]
    acc = torch.zeros_like(x)
    for e in sorted(replicas):
        for r, (tok, slot) in enumerate(assignment(state["route_ids"], e, replicas[e])):
            if tok.numel():
                acc = acc.index_add(0, tok, outputs[(e, r)] * state["route_w"][tok, slot].unsqueeze(-1))
    state["x"] = x + acc
