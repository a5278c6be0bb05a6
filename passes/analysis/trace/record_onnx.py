"""Record per-token routing from an ONNX model by running it in onnxruntime.

The routing is read from the model's own gates, not recomputed: a copy of the graph (in memory;
the file is untouched) gets extra outputs, and one run returns them beside the logits.

* Gating pattern (MatMul -> Softmax -> TopK, or picks by repeated ArgMax): the chosen indices,
  and the gate weights as the graph hands them to the experts (`onnx_gating.handed_on`: after
  renormalisation, scaling and a Softmax that follows the TopK; gathered from the uncorrected
  scores when the TopK ran on score-corrected ones; read at the chosen ids from the dense scores
  of a router that scatters its top-k logits, as Llama-4's does).
* `com.microsoft` MoE op: its routing happens inside the fused kernel, so its router-logit input
  is exposed and the op's routing is applied to it (softmax, top-k, optional renormalisation, as
  the op's `normalize_routing_weights` says; ties go to the lower expert id).
* Attention: the probabilities of the last attention Softmax before each gate, summed over heads;
  `attention_ids` is the id of the token most attended to (see `attention_ids.py`).

Sessions are deterministic (one thread, sequential execution, basic graph optimizations only) and
kept per file, so tracing many batches builds the session once.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moeplan.runtime.ep.expert_table import heaviest_first
from moeplan.passes.analysis.trace.attention_ids import attention_argmax_ids
from moeplan.core.errors import UserError
from moeplan.passes.importers.onnx_gating import find_attention_softmaxes, find_gates, node_position
from moeplan.passes.importers.onnx_graph import load_onnx_model, moe_layer_gates

_CACHE_SIZE = 2
_sessions: dict = {}


@dataclass(frozen=True)
class _GateOutputs:
    """Where one MoE layer's routing appears among the session outputs."""

    kind: str  # "pattern" or "contrib"
    top_k: int
    indices: str = ""
    weights: str = ""
    logits: str = ""
    normalize: bool = False
    dense: bool = False  # `weights` is [.., E] scores; the weights are their values at `indices`


@dataclass(frozen=True)
class _Plan:
    input_name: str
    input_dtype: object
    gates: tuple  # _GateOutputs per MoE layer, in layer order
    attention: tuple | None  # Softmax output name per MoE layer, or None


def _attention_before(gates, softmaxes, position) -> tuple | None:
    """The last attention Softmax before each gate; None when some gate has none."""
    names = []
    for gate in gates:
        at = position[id(gate.node)]
        before = [s for s in softmaxes if position[id(s)] < at]
        if not before:
            return None
        names.append(before[-1].output[0])
    return tuple(names)


def _build(path: Path):
    import onnx
    import onnxruntime as ort

    load_onnx_model(path)  # one-line errors for unreadable files, before the full load
    model = onnx.load(str(path))
    gates = moe_layer_gates(model, path)  # one-line errors when the graph has no MoE layer
    layout = []
    for gate in gates:
        if gate.kind == "contrib":
            attrs = {a.name: a for a in gate.node.attribute}
            if "use_sparse_mixer" in attrs and attrs["use_sparse_mixer"].i:
                raise UserError(f"{path}: MoE node {gate.node.name!r} uses the sparse mixer, which tracing does not model")
            normalize = "normalize_routing_weights" in attrs and bool(attrs["normalize_routing_weights"].i)
            layout.append(_GateOutputs("contrib", gate.top_k, logits=gate.node.input[1], normalize=normalize))
        else:
            if not gate.indices_output or not gate.weights_output:
                where = gate.node.name or gate.node.op_type
                raise UserError(f"{path}: gate {where!r} selects its top-{gate.top_k} experts, but the graph "
                                "joins no per-token list of their ids and weights that tracing could read")
            layout.append(_GateOutputs("pattern", gate.top_k, indices=gate.indices_output,
                                       weights=gate.weights_output, dense=gate.weights_dense))
    every_gate = find_gates(model)  # attention experts' gates too: their Softmaxes are no attention
    attention = _attention_before(gates, find_attention_softmaxes(model, every_gate), node_position(model))

    existing = {o.name for o in model.graph.output}
    wanted = [n for g in layout for n in (g.indices, g.weights, g.logits) if n]
    wanted += list(attention or ())
    for name in dict.fromkeys(wanted):
        if name not in existing:
            model.graph.output.append(onnx.ValueInfoProto(name=name))

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    options.log_severity_level = 3
    try:
        session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    except Exception as exc:
        reason = " ".join(str(exc).split())[:200]
        raise UserError(f"onnxruntime cannot run {path} ({reason}); check that the model is valid") from None
    required = list(session.get_inputs())
    if len(required) != 1:
        names = ", ".join(i.name for i in required)
        raise UserError(
            f"{path} takes inputs {names}; moeplan traces ONNX models whose only input is token ids [batch, sequence]"
        )
    dtype = np.int32 if "int32" in required[0].type else np.int64
    return session, _Plan(required[0].name, dtype, tuple(layout), attention)


def _session(path: Path):
    stat = path.stat()
    key = (str(path.resolve()), stat.st_mtime_ns, stat.st_size)
    if key not in _sessions:
        while len(_sessions) >= _CACHE_SIZE:
            _sessions.pop(next(iter(_sessions)))
        _sessions[key] = _build(path)
    return _sessions[key]


def _contrib_routing(logits: np.ndarray, k: int, normalize: bool):
    """The MoE op's routing from its router logits: softmax, top-k (ties: lower id), renormalise."""
    logits = logits.astype(np.float32)
    shifted = np.exp(logits - logits.max(axis=-1, keepdims=True))
    probs = shifted / shifted.sum(axis=-1, keepdims=True)
    ids = np.argsort(-probs, axis=-1, kind="stable")[:, :k]
    weights = np.take_along_axis(probs, ids, axis=-1)
    if normalize:
        weights = weights / weights.sum(axis=-1, keepdims=True)
    return ids, weights


def record_onnx_routing(onnx_path, input_ids) -> dict:
    """Routing of token ids [B, S] through the ONNX model at `onnx_path`.

    Returns `experts` int64 [B*S, L, K] (heaviest first), `weights` float32 [B*S, L, K] and
    `attention_ids` int64 [B*S, L] (None when the graph shows no attention before every gate).
    """
    path = Path(os.fspath(onnx_path))
    if not path.is_file():
        raise UserError(f"ONNX model {path} not found; check the path")
    input_ids = np.asarray(input_ids)
    if input_ids.ndim != 2:
        raise UserError(f"token ids must be [batch, sequence], got shape {input_ids.shape}")
    session, plan = _session(path)
    names = [n for g in plan.gates for n in (g.indices, g.weights, g.logits) if n] + list(plan.attention or ())
    names = list(dict.fromkeys(names))
    try:
        values = session.run(names, {plan.input_name: input_ids.astype(plan.input_dtype)})
    except Exception as exc:
        reason = " ".join(str(exc).split())[:200]
        raise UserError(f"onnxruntime failed to run {path} on ids of shape {input_ids.shape} ({reason})") from None
    out = dict(zip(names, values))
    tokens = input_ids.shape[0] * input_ids.shape[1]
    experts, weights = [], []
    for layer, gate in enumerate(plan.gates):
        if gate.kind == "contrib":
            logits = out[gate.logits].reshape(-1, out[gate.logits].shape[-1])
            ids, w = _contrib_routing(logits, gate.top_k, gate.normalize)
        else:
            ids = out[gate.indices].reshape(-1, gate.top_k)
            if gate.dense:
                scores = out[gate.weights]
                w = np.take_along_axis(scores.reshape(-1, scores.shape[-1]), ids.astype(np.int64), -1)
            else:
                w = out[gate.weights].reshape(-1, gate.top_k)
        if ids.shape[0] != tokens:
            raise UserError(f"{path}: MoE layer {layer} routed {ids.shape[0]} tokens, expected {tokens} (batch x sequence)")
        ids, w = heaviest_first(ids.astype(np.int64), w.astype(np.float32))
        experts.append(ids)
        weights.append(w)
    attention_ids = None
    if plan.attention is not None:
        attention_ids = np.stack(
            [attention_argmax_ids(out[name], input_ids).reshape(tokens) for name in plan.attention], axis=1
        ).astype(np.int64)
    return {
        "experts": np.stack(experts, axis=1),
        "weights": np.stack(weights, axis=1),
        "attention_ids": attention_ids,
    }
