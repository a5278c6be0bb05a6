"""Find the MoE gates (and attention probabilities) in an ONNX graph, for import and for tracing.

An MoE layer shows itself in ONNX in one of two ways:

* the **gating pattern** of an exported model: a router MatMul (or Gemm) with a weight
  initializer, then Softmax or Sigmoid, then TopK (or TopK on the logits, then Softmax, as
  Mixtral does); a score-correction bias and a group mask (`Where`) may come before the TopK.
  Cast, Reshape, Squeeze/Unsqueeze, Flatten, Identity and a bias Add may sit in between;
* onnxruntime's fused contrib op `com.microsoft.MoE` / `QMoE`, whose attribute `k` is the top-k
  and whose expert weights are stacked initializers [E, ...].

Attention probabilities are the other Softmax nodes whose output feeds a MatMul (probs @ V).
Both the importer (`onnx_graph.py`) and the tracer (`passes/analysis/trace/record_onnx.py`) read the
graph through this one module so that they agree on which nodes are gates and in what order.
"""
from __future__ import annotations


from moeplan.passes.importers.onnx_argmax_gating import argmax_gates
from moeplan.passes.importers.onnx_graph_index import SCORE_OPS, Gate, GraphIndex, handed_on, router_of
CONTRIB_MOE_OPS = {"MoE", "QMoE"}
CONTRIB_DOMAIN = "com.microsoft"


def _k_of(index: GraphIndex, node) -> int | None:
    for attr in node.attribute:
        if attr.name == "k":
            return int(attr.i)
    if len(node.input) > 1:
        value = index.constant(node.input[1])
        if value is not None and value.size == 1:
            return int(value.reshape(-1)[0])
    return None


def _scored_scatter(index: GraphIndex, topk) -> str | None:
    """Scores [.., E] a TopK on router logits hands on by scattering its values into a filled row
    (`ScatterElements(fill, indices, values)`) and scoring that (Sigmoid/Softmax), else None."""
    values, indices = topk.output[0], topk.output[1]
    for name in index.skip_forward(values):
        for node in index.consumers.get(name, ()):
            if (node.op_type == "ScatterElements" and len(node.input) == 3 and node.input[2] == name
                    and node.input[1] in index.skip_forward(indices) and index.is_fill(node.input[0])):
                scored = [c for c in index.consumers.get(node.output[0], ()) if c.op_type in SCORE_OPS]
                return scored[0].output[0] if len(scored) == 1 else None
    return None


def _weights_source(index: GraphIndex, topk) -> str:
    """What a TopK's gate weights start from: its values, unless nothing reads them and the
    scores are gathered at its indices instead (DeepSeek-V3 selects on corrected scores but
    weighs with the uncorrected ones)."""
    values, indices = topk.output[0], topk.output[1]
    if index.consumers.get(values):
        return values
    gathered = [
        node.output[0] for name in index.skip_forward(indices) for node in index.consumers.get(name, ())
        if node.op_type == "GatherElements" and len(node.input) > 1 and node.input[1] == name
    ]
    return gathered[0] if len(gathered) == 1 else values


def find_gates(model) -> list:
    """Every MoE gate in the main graph, in graph (topological) order: TopK patterns, fused MoE
    ops and top-k selections by repeated ArgMax (`onnx_argmax_gating.py`)."""
    index = GraphIndex(model.graph)
    gates = []
    for node in model.graph.node:
        if node.op_type in CONTRIB_MOE_OPS and node.domain == CONTRIB_DOMAIN:
            k = next((int(a.i) for a in node.attribute if a.name == "k"), 1)
            logits = node.input[1]
            probs = index.skip_back(logits)
            if probs is not None and probs.op_type == "Softmax":  # router_probs given as probabilities
                logits = probs.input[0]
            router_node, weight, transposed = router_of(index, logits)
            gates.append(Gate(node, "contrib", k, router_node, weight, transposed))
            continue
        if node.op_type != "TopK":
            continue
        k = _k_of(index, node)
        source = index.scores_source(node.input[0])
        if source is None or k is None:
            continue
        values, indices = node.output[0], node.output[1]
        if source.op_type in SCORE_OPS:
            router_node, weight, transposed = router_of(index, source.input[0])
            if weight is not None:
                gates.append(Gate(node, "pattern", k, router_node, weight, transposed,
                                  indices, handed_on(index, _weights_source(index, node)),
                                  gate_softmax=source.output[0] if source.op_type == "Softmax" else ""))
        elif source.op_type in ("MatMul", "Gemm"):
            softmax = next(
                (c for name in index.skip_forward(values) for c in index.consumers.get(name, ())
                 if c.op_type == "Softmax"),
                None,
            )
            router_node, weight, transposed = router_of(index, node.input[0])
            if softmax is not None and weight is not None:
                gates.append(Gate(node, "pattern", k, router_node, weight, transposed,
                                  indices, handed_on(index, values), softmax_after_topk=True,
                                  gate_softmax=softmax.output[0]))
            elif weight is not None:
                dense = _scored_scatter(index, node)
                if dense is not None and not index.reaches_output(router_node.output[0]):
                    gates.append(Gate(node, "pattern", k, router_node, weight, transposed,
                                      indices, dense, weights_dense=True))
    gates += argmax_gates(model, index)
    gates.sort(key=lambda g: index.position[id(g.node)])
    return _last_per_router(gates)


def _last_per_router(gates: list) -> list:
    """One gate per router: the last TopK on its scores. Node-limited routing (DeepSeek-V3) first
    takes a TopK within each expert group to rank the groups; the final TopK picks the experts."""
    last = {}
    for gate in gates:
        last[id(gate.router_node) if gate.router_node is not None else id(gate.node)] = gate
    keep = {id(g) for g in last.values()}
    return [g for g in gates if id(g) in keep]


def find_attention_softmaxes(model, gates) -> list:
    """Softmax nodes that are not part of a gate and whose output feeds a MatMul (probs @ V)."""
    index = GraphIndex(model.graph)
    gate_softmaxes = {gate.gate_softmax for gate in gates if gate.gate_softmax}
    out = []
    for node in model.graph.node:
        if node.op_type != "Softmax" or node.output[0] in gate_softmaxes:
            continue
        feeds_matmul = any(
            c.op_type == "MatMul" and c.input[0] == name
            for name in index.skip_forward(node.output[0])
            for c in index.consumers.get(name, ())
        )
        if feeds_matmul:
            out.append(node)
    return out


def node_position(model) -> dict:
    """id(node) -> index in the graph's node list (a topological order)."""
    return {id(n): i for i, n in enumerate(model.graph.node)}
