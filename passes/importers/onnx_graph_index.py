"""An ONNX graph indexed for the MoE importers: producers, consumers, constants, and the pieces of a gate
(`Gate`, the router a gate reads, the gate weights it hands on), shared by `onnx_gating.py` (TopK
patterns and fused MoE ops), `onnx_argmax_gating.py` (top-k by repeated ArgMax), `onnx_graph.py`
and `onnx_experts.py`.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

PASS_THROUGH = {"Cast", "Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity"}
WEIGHT_PASS_THROUGH = {"Transpose", "Cast", "Identity", "Reshape"}
SCORE_OPS = {"Softmax", "Sigmoid"}
CONSTANT_PRESERVING = {"Cast", "CastLike", "Reshape", "Squeeze", "Unsqueeze", "Identity"}  # of input 0  # router scoring: softmax (most), sigmoid (DeepSeek-V3, GLM-4.5)
SCOPES_KEY = "pkg.torch.onnx.name_scopes"


class GraphIndex:
    """Producers, consumers, initializers and constant values of one graph, built once."""

    def __init__(self, graph):
        self.graph = graph
        self.initializers = {t.name: t for t in graph.initializer}
        self.producer = {}
        self.consumers: dict = {}
        self.position = {}
        for i, node in enumerate(graph.node):
            self.position[id(node)] = i
            for out in node.output:
                if out:
                    self.producer[out] = node
            for inp in node.input:
                if inp:
                    self.consumers.setdefault(inp, []).append(node)

    def constant(self, name: str) -> np.ndarray | None:
        """The value of a tensor that is an initializer or a Constant node's output, else None."""
        from onnx import numpy_helper

        if name in self.initializers:
            tensor = self.initializers[name]
            if tensor.data_location == tensor.EXTERNAL:
                return None
            return numpy_helper.to_array(tensor)
        node = self.producer.get(name)
        if node is not None and node.op_type == "Constant":
            for attr in node.attribute:
                if attr.name == "value":
                    return numpy_helper.to_array(attr.t)
                if attr.name == "value_int":
                    return np.array(attr.i)
                if attr.name == "value_ints":
                    return np.array(list(attr.ints))
        if node is not None and node.op_type in ("Cast", "Reshape", "Squeeze", "Unsqueeze", "Identity"):
            return self.constant(node.input[0])
        return None

    def is_constant(self, name: str) -> bool:
        if name in self.initializers:
            return True
        node = self.producer.get(name)
        if node is not None and node.op_type in CONSTANT_PRESERVING:  # a squeezed bias, a cast fill value
            return self.is_constant(node.input[0])
        return node is not None and node.op_type == "Constant"

    def is_fill(self, name: str) -> bool:
        """A fill value: a constant, or one broadcast to a shape (ConstantOfShape, Expand of a constant)."""
        if self.is_constant(name):
            return True
        node = self.producer.get(name)
        while node is not None and node.op_type in ("CastLike", "Cast", "Expand", "Identity"):
            if self.is_constant(node.input[0]):
                return True
            node = self.producer.get(node.input[0])
        return node is not None and node.op_type == "ConstantOfShape"

    def scores_source(self, name: str):
        """The node TopK's scores come from, looking through pass-through ops, a constant bias Add
        (DeepSeek's score correction) and masking (`Where(mask, fill, scores)`, node-limited
        routing's masked_fill of the groups not chosen)."""
        node = self.skip_back(name)
        while node is not None and node.op_type == "Where":
            data = [i for i in node.input[1:] if not self.is_constant(i)]
            if len(data) != 1:
                return node
            node = self.skip_back(data[0])
        return node

    def skip_back(self, name: str, ops=PASS_THROUGH):
        """The producer of `name`, looking through pass-through ops (and a constant bias Add)."""
        node = self.producer.get(name)
        while node is not None:
            if node.op_type in ops:
                name = node.input[0]
            elif node.op_type == "Add" and len(node.input) == 2 and any(self.is_constant(i) for i in node.input):
                name = next(i for i in node.input if not self.is_constant(i))
            else:
                return node
            node = self.producer.get(name)
        return None

    def weight_initializer(self, name: str) -> str | None:
        """The initializer a MatMul/Gemm weight input comes from (through Transpose/Cast), if any."""
        while name not in self.initializers:
            node = self.producer.get(name)
            if node is None or node.op_type not in WEIGHT_PASS_THROUGH:
                return None
            name = node.input[0]
        return name

    def reaches_output(self, name: str) -> bool:
        """Whether `name` is, through pass-through ops, a graph output (a head's logits, not a router's)."""
        outputs = {o.name for o in self.graph.output}
        return any(n in outputs for n in self.skip_forward(name))

    def skip_forward(self, name: str) -> list:
        """Tensors reachable from `name` through pass-through ops only (itself included)."""
        out, stack = [], [name]
        while stack:
            current = stack.pop()
            out.append(current)
            for node in self.consumers.get(current, ()):
                if node.op_type in PASS_THROUGH:
                    stack.append(node.output[0])
        return out


@dataclass(frozen=True)
class Gate:
    """One MoE layer's gate as found in the graph.

    `node` is the TopK node or the last ArgMax of a chain of picks (kind "pattern"), or the contrib
    MoE node; `router_weight` the initializer of the router MatMul/Gemm (None if the router logits
    come from elsewhere); `router_transposed` is True when the weight is stored [E, D] (Gemm
    transB=1), False when stored [D, E]. `weights_output` is the tensor holding the per-token gate
    weights [.., K] as the router hands them to the experts (`handed_on`; "" when the graph joins
    none); `indices_output` the chosen experts [.., K].
    A router that scatters its chosen logits into a full row before scoring them (Llama-4:
    sigmoid of -inf everywhere but the top-k) hands on dense scores: `weights_dense`.
    """

    node: object
    kind: str  # "pattern" or "contrib"
    top_k: int
    router_node: object | None
    router_weight: str | None
    router_transposed: bool
    indices_output: str = ""
    weights_output: str = ""
    softmax_after_topk: bool = False
    weights_dense: bool = False  # weights_output is [.., E]; the gate weights are its values at indices_output
    gate_softmax: str = ""  # the router's Softmax output (before or after TopK), not an attention


def node_module_path(node) -> str:
    """The torch module path a node came from: dynamo metadata, else a legacy `/a/b/Op` name."""
    for prop in node.metadata_props:
        if prop.key == SCOPES_KEY:
            scopes = [s.strip("'\" ") for s in prop.value.strip("[]").split(",")]
            scopes = [s for s in scopes if s]
            return scopes[-2] if len(scopes) >= 2 else ""
    name = node.name or ""
    if name.startswith("/") and name.count("/") >= 2:
        return ".".join(p for p in name.strip("/").split("/")[:-1] if p)
    return ""


def router_of(index: GraphIndex, logits: str):
    """(router node, weight initializer, transposed) for router logits `logits`, else Nones."""
    node = index.skip_back(logits)
    if node is None or node.op_type not in ("MatMul", "Gemm"):
        return None, None, False
    weight = index.weight_initializer(node.input[1]) if len(node.input) > 1 else None
    if weight is None:
        return None, None, False
    transposed = False
    if node.op_type == "Gemm":
        transposed = any(a.name == "transB" and a.i == 1 for a in node.attribute)
    feeding = index.producer.get(node.input[1])
    if feeding is not None and feeding.op_type == "Transpose":
        transposed = not transposed
    return node, weight, transposed


def _scaled_copy(index: GraphIndex, node, current: str) -> bool:
    """Whether `node` maps gate weights `current` to gate weights: a Softmax over them, a constant
    scale (`routed_scaling_factor`), or a division by a constant or by their own sum or L1 norm
    (renormalisation; the sum may get a constant epsilon added or a lower clamp). Casts and
    reshapes in between are looked through by the caller."""
    if node.op_type == "Softmax":
        return True
    if node.op_type == "Mul" and len(node.input) == 2 and current in node.input:
        return index.is_constant(node.input[1] if node.input[0] == current else node.input[0])
    if node.op_type != "Div" or node.input[0] != current:
        return False
    divisor = node.input[1]
    while not index.is_constant(divisor):
        producer = index.producer.get(divisor)
        if producer is None:
            return False
        if producer.op_type in ("ReduceSum", "ReduceL1"):  # L1: DBRX's p-norm with p = 1 (weights >= 0)
            return producer.input[0] == current
        varying = [i for i in producer.input if i and not index.is_constant(i)]
        if producer.op_type not in ("Add", "Max", "Clip", "Cast") or len(varying) != 1:
            return False
        divisor = varying[0]
    return True


def handed_on(index: GraphIndex, values: str) -> str:
    """The gate weights as the router hands them to the experts: `values` (TopK values, or scores
    gathered at the chosen indices) followed forward while they are only renormalised, scaled,
    softmaxed or cast (DeepSeek-V3 and GLM-4.5 normalise the uncorrected sigmoid scores and scale
    them by `routed_scaling_factor`; gpt-oss takes the softmax of the selected logits)."""
    while True:
        steps = [n for name in index.skip_forward(values) for n in index.consumers.get(name, ())
                 if _scaled_copy(index, n, name)]
        if len(steps) != 1:
            return values
        values = steps[0].output[0]
