"""Check a bundle run against the single-process source model shipped in the bundle.

The reference is the model's own source file (`model/model.py`) with the weights reassembled
from the shards; their hash must equal the plan's `weights_sha256` of the source state dict, so
the reference is the source model and not merely the shards. The reference generates greedily
with full recomputation, then one forward over prompt + generated tokens (all but the last)
gives the logits of every position the runtime processed.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from moeplan.backends.common.manifest import bundle_path
from moeplan.backends.common.shards import state_dict_sha256
from moeplan.passes.importers.resolve import import_file


class VerifyError(Exception):
    """The bundle cannot be verified (e.g. weights differ from the source model)."""


def _transformers_reference(root: Path, plan: dict, state: dict):
    """The transformers model named by the bundle's config, built by transformers, with `state`."""
    from moeplan.runtime.model.library_model import build_transformers

    model = build_transformers(bundle_path(root, plan["model"]["config"]).parent)
    result = model.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    if result.missing_keys or result.unexpected_keys:
        missing = [k for k in result.missing_keys if k != "lm_head.weight"]
        if missing or result.unexpected_keys:
            raise VerifyError(f"the shards do not fill the model: missing {missing[:3]}, unexpected {result.unexpected_keys[:3]}")
    model.tie_weights()
    return _LogitsOnly(model.float().eval())


class _LogitsOnly(torch.nn.Module):
    """A transformers causal LM called like TinyMoE: ids [B, S] -> logits [B, S, V]."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(input_ids=ids, use_cache=False).logits


def load_reference(root: Path, plan: dict):
    """The source model rebuilt from the bundle: its source file, config and all shards."""
    from moeplan.runtime.bundle_io import read_rank_tensors

    state = {}
    for rank in range(len(plan["shards"])):  # shards, or indexes into the original checkpoint
        state.update(read_rank_tensors(root, plan, rank))
    from moeplan.backends.common.model_source import expert_containers
    from moeplan.runtime.model.moe_adapter import join_expert_state

    arch = plan["model"]["architecture"]
    files = {rel: (root / rel).read_bytes() for rel in _model_files(root, plan)}
    state = join_expert_state(state, expert_containers(arch, files))
    expected = plan["model"].get("weights_sha256")
    if expected and state_dict_sha256(state) != expected:
        raise VerifyError("the shards' weights do not reassemble the source model (weights_sha256 differs); recompile the bundle")
    return reference_model(root, plan, state)


def reference_model(root: Path, plan: dict, state: dict):
    """The source model of a bundle (torchrun or Lambda) with the library's state dict `state`."""
    if plan["model"]["architecture"] == "transformers":
        return _transformers_reference(root, plan, state)
    return tiny_moe_reference(root, plan, state)


def _model_files(root: Path, plan: dict) -> list:
    model_dir = (root / plan["model"]["config"]).parent
    return sorted(str(p.relative_to(root)) for p in model_dir.iterdir() if p.is_file())


def tiny_moe_reference(root: Path, plan: dict, state: dict):
    """TinyMoE built from the model source file and config shipped in a bundle, with `state`."""
    source = bundle_path(root, plan["model"]["source"])  # never code from outside the bundle
    previous, sys.dont_write_bytecode = sys.dont_write_bytecode, True  # no __pycache__ in the bundle
    try:
        module = import_file(source)
    finally:
        sys.dont_write_bytecode = previous
    config = json.loads(bundle_path(root, plan["model"]["config"]).read_text())
    model = module.TinyMoE(module.TinyMoEConfig.from_dict(config))
    model.load_state_dict({k: v.float() for k, v in state.items()})
    return model.eval()


@torch.no_grad()
def reference_generate(model, prompt: list, new_tokens: int) -> tuple:
    """(generated ids, logits [len(prompt) + new_tokens - 1, V]) by full recomputation."""
    ids = list(prompt)
    generated = []
    for _ in range(new_tokens):
        logits = model(torch.tensor([ids]))[0]
        nxt = int(torch.argmax(logits[-1]))
        generated.append(nxt)
        ids.append(nxt)
    final = model(torch.tensor([ids[:-1]]))[0]
    return generated, final


def compare(root: Path, plan: dict, out_dir: Path, new_tokens: int, cache: dict | None = None) -> dict:
    """max |logit diff| over every processed position, and whether greedy tokens match."""
    torch.set_num_threads(1)
    cache = {} if cache is None else cache
    if "model" not in cache:
        cache["model"] = load_reference(root, plan)
    model = cache["model"]
    run = torch.load(out_dir / "logits.pt", weights_only=True)
    result = json.loads((out_dir / "result.json").read_text())
    prompts = result["prompt_ids"]
    keys, logits, max_len = run["keys"], run["logits"], run["max_len"]
    by_key = {int(k): i for i, k in enumerate(keys.tolist())}
    max_diff, tokens_match = 0.0, True
    for s, prompt in enumerate(prompts):
        key = (tuple(prompt), new_tokens)
        if key not in cache:
            cache[key] = reference_generate(model, prompt, new_tokens)
        gen, ref_logits = cache[key]
        tokens_match &= gen == result["generated"][s]
        for p in range(ref_logits.shape[0]):
            i = by_key.get(s * max_len + p)
            if i is None:
                return {"max_abs_logit_diff": float("inf"), "tokens_match": False}
            max_diff = max(max_diff, float((logits[i] - ref_logits[p]).abs().max()))
    if len(by_key) != sum(len(p) + new_tokens - 1 for p in prompts):
        tokens_match = False
    return {"max_abs_logit_diff": max_diff, "tokens_match": bool(tokens_match)}
