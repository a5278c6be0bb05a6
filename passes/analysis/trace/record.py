"""Record a routing trace by running a model on text: which experts every token visits, per layer.

Planning decisions (placement, replicas, caches) are only as good as the routing they are fitted
to, so the trace comes from the real model on real tokens rather than from a re-implementation of
its router: forward hooks observe the decisions the model itself makes.

Hook points (found by `find_hook_points`), in forward order:
* moeplan convention (the example TinyMoE, and any user model that adopts it): a submodule
  registered as `routing` whose output is `(expert ids [N, K], weights [N, K])`, and one
  registered as `probs` whose output is attention probabilities `[B, H, S, S]`;
* Hugging Face transformers 5 MoE models (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V3):
  the router module `layers[i].mlp.gate` (class `*TopKRouter`) returns
  `(logits, weights [N, K], ids [N, K])`, the weights the block hands its experts (DeepSeek-V3,
  GLM-4.5: uncorrected scores, renormalised and scaled, not the bias-corrected selection scores;
  `tests/test_trace_router_weights.py`); attention weights are the second output of
  `layers[i].self_attn`, which HF computes only with eager attention (switched on for the run).
ONNX models run through `record_onnx.record_onnx_routing` (onnxruntime) instead of hooks.

Attention ids: for token t and MoE layer l, the vocabulary id of the token that received the
highest attention probability, summed over heads, in the last attention that ran before layer l's
router (the same block's attention), among the positions t attends to (ties: the earliest).

Token order in the trace: sequences in text order, positions in order; `sequence` numbers the
chunks of `seq_len` tokens. Same model and text -> identical trace.
"""
from __future__ import annotations

import contextlib

from dataclasses import dataclass
from collections.abc import Callable, Sequence

import numpy as np

from moeplan.runtime.ep.expert_table import heaviest_first
from moeplan.passes.analysis.trace.attention_ids import attention_argmax_ids
from moeplan.passes.analysis.trace.format import Trace, make_trace
from moeplan.passes.analysis.trace.record_onnx import record_onnx_routing
from moeplan.passes.analysis.trace.speculate import DEFAULT_SOURCE, Speculator, find_spec_layers
from moeplan.core.errors import UserError

DEFAULT_SEQ_LEN = 128
DEFAULT_BATCH = 8

Progress = Callable[[int, int], None]  # (tokens done, tokens total)


# --------------------------------------------------------------------------------------------
# Text -> token sequences


def encode_text(text: str, vocab_size: int, tokenizer: Callable[[str], Sequence[int]] | None = None) -> np.ndarray:
    """Token ids [N] for `text`: the tokenizer's if given (`moeplan trace` gives the bundle runtime's
    TextCodec), else UTF-8 bytes (TinyMoE's vocabulary) as that same codec encodes them."""
    if tokenizer is not None:
        ids = np.asarray(list(tokenizer(text)), dtype=np.int64)
    else:
        from moeplan.runtime.text_codec import TextCodec

        if vocab_size < 256:
            raise UserError(
                f"the model's vocabulary has {vocab_size} ids, too few for byte-level text; "
                "give a model with a tokenizer or pass token ids instead of text")
        ids = np.asarray(TextCodec(None, vocab_size, native_bytes=True).encode_text(text), dtype=np.int64)
    if ids.size == 0:
        raise UserError("the text to trace is empty; give a --data file with some text in it")
    return ids


def chunk_tokens(ids: np.ndarray, seq_len: int, max_tokens: int | None = None) -> list[np.ndarray]:
    """Consecutive sequences of `seq_len` tokens (the last may be shorter), at most `max_tokens` in all."""
    if seq_len <= 0:
        raise UserError(f"--seq-len must be positive, got {seq_len}")
    if max_tokens is not None:
        if max_tokens <= 0:
            raise UserError(f"--max-tokens must be positive, got {max_tokens}")
        ids = ids[:max_tokens]
    return [ids[i: i + seq_len] for i in range(0, len(ids), seq_len)]


def batch_sequences(sequences: Sequence[np.ndarray], batch: int) -> list[np.ndarray]:
    """Stack consecutive equal-length sequences into [B, S] arrays of at most `batch` rows.

    No padding: the short last sequence gets a batch of its own, so no token ever attends to
    padding and routing is exactly what an unpadded run would see.
    """
    if batch <= 0:
        raise UserError(f"--batch must be positive, got {batch}")
    batches, current = [], []
    for seq in sequences:
        if current and (len(current) == batch or len(seq) != len(current[0])):
            batches.append(np.stack(current))
            current = []
        current.append(seq)
    if current:
        batches.append(np.stack(current))
    return batches


# --------------------------------------------------------------------------------------------
# Hook points


@dataclass
class HookPoints:
    """Modules to hook, each with a function turning its output into what the trace needs."""

    routers: list  # [(module, output -> (ids [N, K], weights [N, K]))]
    attentions: list  # [(module, output -> probs [B, H, S, S] or None)]
    hf_model: bool = False


def _routing_identity_output(output):
    ids, weights = output
    return ids, weights


def _hf_router_output(output):
    _, weights, ids = output
    return ids, weights


def _hf_attention_output(output):
    return output[1] if isinstance(output, tuple) and len(output) > 1 else None


def _from_inputs(convert):
    """Mark a converter that reads the hooked module's positional inputs instead of its output."""
    convert.from_inputs = True
    return convert


def _hf_routing_inputs(module) -> list:
    """Routing of transformers models without a *TopKRouter gate (Hunyuan, Llama-4, JetMoE, DBRX):
    the final (ids, weights) the MoE block hands its experts module, or its router's output."""
    import torch

    routers = []
    for name, sub in module.named_modules():
        cls = type(sub).__name__
        if cls == "Llama4Router":
            def llama4(output, k=int(sub.top_k)):
                # The router returns (scores [N, E], logits [N, E]) and chooses by torch.topk(logits, k, dim=1):
                # the same call on the same logits gives its ids; the weights are its own scores there
                # (sigmoid of the chosen logits), not re-derived.
                scores, logits = output
                ids = torch.topk(logits, k, dim=1)[1]
                return ids, scores.gather(1, ids)
            routers.append((sub, llama4))
        elif cls == "JetMoeTopKGating" and ".mlp." in f".{name}.":  # not the attention experts' gate
            def jetmoe(output, k=int(sub.top_k)):
                index_sorted, _, gates, sizes, _ = output
                n = index_sorted.numel() // k
                expert_of = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
                ids = torch.empty(n * k, dtype=torch.int64)
                weights = torch.empty(n * k, dtype=gates.dtype)
                ids[index_sorted.cpu()], weights[index_sorted.cpu()] = expert_of, gates.cpu()
                return ids.view(n, k), weights.view(n, k)
            routers.append((sub, jetmoe))
        elif cls.endswith("Experts") and cls not in ("Llama4TextExperts", "JetMoeParallelExperts") and hasattr(sub, "num_experts"):
            routers.append((sub, _from_inputs(lambda inputs: (inputs[1], inputs[2]))))
    return routers


def _is_hf_module(module) -> bool:
    return type(module).__module__.startswith("transformers.")


def find_hook_points(module) -> HookPoints:
    """Where routing and attention probabilities can be observed in `module` (see module doc)."""
    routers, attentions = [], []
    if _is_hf_module(module):
        for name, sub in module.named_modules():
            cls = type(sub).__name__.lower()
            if cls.endswith("topkrouter"):
                routers.append((sub, _hf_router_output))
            elif name.endswith("self_attn"):
                attentions.append((sub, _hf_attention_output))
        if not routers:
            routers = _hf_routing_inputs(module)
        hf = True
    else:
        for name, sub in module.named_modules():
            leaf = name.rsplit(".", 1)[-1]
            if leaf == "routing":
                routers.append((sub, _routing_identity_output))
            elif leaf == "probs":
                attentions.append((sub, lambda out: out))
        hf = False
    if not routers:
        raise UserError(
            f"found no MoE router to trace in {type(module).__name__}; tracing supports moeplan's "
            "'routing' hook convention and Hugging Face MoE blocks (*TopKRouter gates or an *Experts module "
            "called with top-k ids and weights, Llama-4 and JetMoE routers)")
    return HookPoints(routers=routers, attentions=attentions, hf_model=hf)


# --------------------------------------------------------------------------------------------
# Running one batch


class _Recorder:
    """Forward hooks that log routing and attention events in the order they fire."""

    def __init__(self, points: HookPoints):
        self.points = points
        self.events: list = []
        self.handles = []

    def __enter__(self):
        for module, convert in self.points.routers:
            self.handles.append(module.register_forward_hook(self._hook("route", convert)))
        for module, convert in self.points.attentions:
            self.handles.append(module.register_forward_hook(self._hook("attn", convert)))
        return self

    def __exit__(self, *exc):
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def _hook(self, kind, convert):
        def hook(_module, _inputs, output):
            value = convert(_inputs) if getattr(convert, "from_inputs", False) else convert(output)
            if kind == "route":
                ids, weights = value
                value = (ids.detach().cpu().numpy().astype(np.int64),
                         weights.detach().float().cpu().numpy().astype(np.float32))
            elif value is not None:
                value = value.detach().float().cpu().numpy()
            self.events.append((kind, value))
        return hook


def _run_torch_batch(module, points: HookPoints, input_ids: np.ndarray, speculator=None):
    """experts [B*S, L, K], weights [B*S, L, K], attention_ids [B*S, L] or None, speculation
    [B*S, L, D, K] or None (with a `speculate.Speculator`) for one batch."""
    import torch

    param = next(module.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    ids_tensor = torch.as_tensor(input_ids, dtype=torch.long, device=device)
    with _Recorder(points) as rec, speculator or contextlib.nullcontext(), torch.no_grad():
        if points.hf_model:
            module(input_ids=ids_tensor, use_cache=False)
        else:
            module(ids_tensor)
    B, S = input_ids.shape
    experts, weights, attention = [], [], []
    last_attention = None
    for kind, value in rec.events:
        if kind == "attn":
            last_attention = value
            continue
        ids, w = value
        ids, w = heaviest_first(ids.reshape(B * S, -1), w.reshape(B * S, -1))
        experts.append(ids)
        weights.append(w)
        if last_attention is None:
            attention.append(None)
        else:
            attention.append(attention_argmax_ids(last_attention, input_ids).reshape(B * S))
    if not experts:
        raise UserError(f"{type(module).__name__} ran without calling any of its {len(points.routers)} MoE routers; "
                        "tracing needs the routers to run in forward()")
    experts_arr = np.stack(experts, axis=1)
    weights_arr = np.stack(weights, axis=1)
    attention_arr = None if any(a is None for a in attention) else np.stack(attention, axis=1)
    if speculator is None:
        return experts_arr, weights_arr, attention_arr, None
    if len(speculator.layers) != experts_arr.shape[1]:
        raise UserError(f"speculation found {len(speculator.layers)} routers it can run but the model routed through "
                        f"{experts_arr.shape[1]} MoE layers; record the trace without --speculate")
    with torch.no_grad():  # after the hooks are gone: the routers' own hooks must not record these calls
        spec = speculator.speculation(B * S, experts_arr.shape[2])
    return experts_arr, weights_arr, attention_arr, spec


class _EagerAttention:
    """Switch an HF model to eager attention (the only kind that returns probabilities), then back."""

    def __init__(self, module):
        self.module = module
        self.previous = None

    def __enter__(self):
        config = getattr(self.module, "config", None)
        self.previous = getattr(config, "_attn_implementation", None)
        if self.previous not in (None, "eager") and hasattr(self.module, "set_attn_implementation"):
            self.module.set_attn_implementation("eager")
        return self

    def __exit__(self, *exc):
        if self.previous not in (None, "eager") and hasattr(self.module, "set_attn_implementation"):
            self.module.set_attn_implementation(self.previous)


# --------------------------------------------------------------------------------------------
# The pass


def model_limits(loaded) -> tuple[int, int | None, int]:
    """(vocabulary size, maximum positions or None, experts per MoE layer) of a loaded model."""
    ir = loaded.ir
    moe = ir.moe_stages
    if not moe:
        raise UserError(f"model '{ir.name}' has no MoE layer; there is no routing to trace")
    num_experts = max(s.num_experts for s in moe)
    config = getattr(loaded.module, "config", None)
    max_positions = None
    for attr in ("max_positions", "max_position_embeddings"):
        value = getattr(config, attr, None)
        if isinstance(value, int) and value > 0:
            max_positions = value
            break
    return ir.vocab_size, max_positions, num_experts


def record_trace(
    loaded,
    data,
    max_tokens: int | None = None,
    batch: int = DEFAULT_BATCH,
    seq_len: int | None = None,
    tokenizer: Callable[[str], Sequence[int]] | None = None,
    progress: Progress | None = None,
    speculate: int = 0,
    speculate_from: str = DEFAULT_SOURCE,
) -> Trace:
    """Run `loaded` (a `LoadedModel`) on `data` and return its routing `Trace`.

    With `speculate` D > 0 the trace also holds, per token and MoE layer l, the top-k the routers
    of layers l+1 .. l+D pick from the stand-in hidden state `speculate_from` of layer l
    (`speculate.py`; torch models only).

    `data` is text (encoded by `tokenizer`, else as UTF-8 bytes) or a sequence of token-id
    sequences or [B, S] token batches (each row is chunked on its own; sequence ids number the
    chunks).
    `seq_len` defaults to the model's maximum positions capped at 128.
    """
    vocab_size, max_positions, num_experts = model_limits(loaded)
    if max_tokens is not None and max_tokens <= 0:
        raise UserError(f"--max-tokens must be positive, got {max_tokens}")
    if seq_len is None:
        seq_len = min(DEFAULT_SEQ_LEN, max_positions or DEFAULT_SEQ_LEN)
    if max_positions is not None and seq_len > max_positions:
        raise UserError(f"--seq-len {seq_len} exceeds the model's {max_positions} positions; use --seq-len {max_positions} or less")

    if isinstance(data, str):
        streams = [encode_text(data, vocab_size, tokenizer)]
    else:
        streams = []
        for item in data:
            arr = np.asarray(item, dtype=np.int64)
            streams.extend(arr if arr.ndim == 2 else [arr.reshape(-1)])
        if not streams or all(s.size == 0 for s in streams):
            raise UserError("no tokens to trace; give non-empty token sequences")
    sequences: list[np.ndarray] = []
    budget = max_tokens
    for stream in streams:
        if budget is not None and budget <= 0:
            break
        chunks = chunk_tokens(stream, seq_len, budget)
        sequences.extend(chunks)
        if budget is not None:
            budget -= sum(len(c) for c in chunks)
    for seq in sequences:
        if seq.size and (seq.min() < 0 or seq.max() >= vocab_size):
            raise UserError(f"token id {int(seq.max())} is outside the model's vocabulary of {vocab_size}")
    batches = batch_sequences(sequences, batch)
    total = sum(b.size for b in batches)

    run_batch = _batch_runner(loaded, speculate, speculate_from)
    experts, weights, attention, speculation = [], [], [], []
    done = 0
    for input_ids in batches:
        e, w, a, spec = run_batch(input_ids)
        if experts and e.shape[1:] != experts[0].shape[1:]:
            raise UserError(f"the model routed through {e.shape[1]} MoE layers (top-{e.shape[2]}) in one batch and "
                            f"{experts[0].shape[1]} (top-{experts[0].shape[2]}) in another; tracing needs a fixed layer count")
        experts.append(e)
        weights.append(w)
        attention.append(a)
        speculation.append(spec)
        done += input_ids.size
        if progress is not None:
            progress(done, total)

    positions = np.concatenate([np.arange(len(s)) for s in sequences])
    sequence_ids = np.concatenate([np.full(len(s), i) for i, s in enumerate(sequences)])
    token_ids = np.concatenate(sequences)
    attention_ids = None if any(a is None for a in attention) else np.concatenate(attention)
    return make_trace(
        np.concatenate(experts), np.concatenate(weights), num_experts=num_experts,
        token_ids=token_ids, positions=positions, sequence=sequence_ids, attention_ids=attention_ids,
        speculation=np.concatenate(speculation) if speculate else None,
        speculation_source=speculate_from if speculate else None,
    )


def _batch_runner(loaded, speculate: int = 0, speculate_from: str = DEFAULT_SOURCE) -> Callable[[np.ndarray], tuple]:
    """A function running one [B, S] batch of token ids through the model (torch or ONNX):
    (experts, weights, attention ids or None, speculation or None)."""
    if loaded.onnx_path:
        if speculate:
            raise UserError("--speculate runs the model's own router modules, which an ONNX graph does not expose; "
                            "record the trace from the torch model or Hugging Face directory, or drop --speculate")

        def run_onnx(input_ids):
            out = record_onnx_routing(loaded.onnx_path, input_ids)  # heaviest first already
            ids, w = np.asarray(out["experts"], dtype=np.int64), np.asarray(out["weights"], dtype=np.float32)
            attention_ids = out.get("attention_ids")
            return ids, w, None if attention_ids is None else np.asarray(attention_ids), None
        return run_onnx

    module = loaded.module
    if module is None:
        raise UserError("the model has nothing that can run (no module, no ONNX file); give a checkpoint or an ONNX file")
    if not getattr(loaded, "has_weights", True) or _on_meta(module):
        raise UserError("the model was built from a config alone and has no weights, so it cannot be run to record "
                        "routing; give a directory with weights, or import a routing log with 'moeplan trace import'")
    points = find_hook_points(module)
    speculator = Speculator(find_spec_layers(module), speculate, speculate_from) if speculate else None

    def run_torch(input_ids):
        was_training = module.training
        module.eval()
        try:
            with _EagerAttention(module) if points.hf_model else contextlib.nullcontext():
                return _run_torch_batch(module, points, input_ids, speculator)
        finally:
            module.train(was_training)
    return run_torch


def _on_meta(module) -> bool:
    param = next(module.parameters(), None)
    return param is not None and param.device.type == "meta"

