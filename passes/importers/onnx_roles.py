"""What an ONNX initializer is, read from the data flow: a parameter or a buffer, an embedding or a head.

ONNX keeps no difference between a module's parameters and its buffers, and an exporter that
drops names leaves `W12` where torch had `embed_tokens.weight`. Two rules recover what the torch
importer reads from the module:

* **Buffers** (rotary `inv_freq`, cached masks) are not counted, as `named_parameters()` does
  not count them. A parameter meets the token *values* at its first real use: a weight multiplies
  activations, a norm scale multiplies the normalised hidden state, an embedding is gathered by
  the token ids, an expert weight is gathered by the router's choices. A rotary buffer meets only
  positions, which come from the input's *shape*. So an initializer is a parameter when, walking
  forward through layout-only ops, indexing into it (a learned position table gathered by
  positions) and ops whose other inputs are constants, it reaches a node
  with an input that depends on the graph inputs' values (shape-only ops - Shape, Size - cut
  that dependence).
* **Roles of anonymous weights**: a 2-D weight gathered by indices that are a graph input is the
  token embedding; the weight of the MatMul/Gemm whose result is a graph output is the head.
  They are named `embed_tokens.weight` / `lm_head.weight` so that the stage rules size the
  vocabulary from them.
"""
from __future__ import annotations

LAYOUT_OPS = {"Transpose", "Cast", "Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity"}
SHAPE_OPS = {"Shape", "Size"}
INDEXING_OPS = {"Gather", "GatherElements", "Slice", "Expand"}  # rows of a table, by any index


def value_tensors(model, index) -> set:
    """Tensors whose values depend on the graph inputs' values (not only on their shapes)."""
    initializers = set(index.initializers)
    start = [i.name for i in model.graph.input if i.name not in initializers]
    seen = set(start)
    stack = list(start)
    while stack:
        name = stack.pop()
        for node in index.consumers.get(name, ()):
            if node.op_type in SHAPE_OPS:
                continue
            for out in node.output:
                if out and out not in seen:
                    seen.add(out)
                    stack.append(out)
    return seen


def meets_values(index, name: str, values: set) -> bool:
    """Whether initializer `name`, forward through layout/constant-only ops, meets token values."""
    frontier, seen = [name], {name}
    while frontier:
        current = frontier.pop()
        for node in index.consumers.get(current, ()):
            others = [i for i in node.input if i and i != current]
            if any(i in values for i in others):
                return True
            indexing = node.op_type in INDEXING_OPS and node.input[0] == current
            if node.op_type in LAYOUT_OPS or indexing or all(index.is_constant(i) for i in others):
                for out in node.output:
                    if out and out not in seen:
                        seen.add(out)
                        frontier.append(out)
    return False


def _graph_output_sources(model, index) -> set:
    """Tensors that reach a graph output through layout ops only."""
    out = set()
    stack = [o.name for o in model.graph.output]
    while stack:
        name = stack.pop()
        if name in out:
            continue
        out.add(name)
        node = index.producer.get(name)
        if node is not None and node.op_type in LAYOUT_OPS:
            stack.append(node.input[0])
        elif node is not None and node.op_type == "Add":  # a head bias
            stack.extend(i for i in node.input if i and not index.is_constant(i))
    return out


def anonymous_roles(model, index) -> dict:
    """Initializer name -> `embed_tokens.weight` / `lm_head.weight`, found by data flow."""
    inputs = {i.name for i in model.graph.input}
    roles = {}
    for node in model.graph.node:
        if node.op_type == "Gather" and len(node.input) > 1 and node.input[1] in inputs:
            weight = index.weight_initializer(node.input[0])
            if weight is not None and len(index.initializers[weight].dims) == 2:
                roles.setdefault(weight, "embed_tokens.weight")
    outputs = _graph_output_sources(model, index)
    for name in outputs:
        node = index.producer.get(name)
        if node is not None and node.op_type in ("MatMul", "Gemm") and len(node.input) > 1:
            weight = index.weight_initializer(node.input[1])
            if weight is not None and weight not in roles:
                roles[weight] = "lm_head.weight"
    return roles
