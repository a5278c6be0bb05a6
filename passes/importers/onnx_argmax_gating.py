"""Top-k routers built from repeated ArgMax, found by their graph pattern (no TopK node).

A router may pick its k experts one at a time: ArgMax over the router scores picks the first,
the chosen expert is masked out of the scores (`ScatterElements(scores, chosen, -inf)`, or
`Where(mask, fill, scores)` with a mask derived from the choice), ArgMax picks the next, and so
on. Each pick's gate weight is read at the chosen index (`GatherElements(probs, chosen)`), and
the picks are joined (`Concat`). PhiMoE's sparsemixer is this pattern with k = 2 (transformers
5.23 `models/phimoe/modeling_phimoe.py`, `sparsemixer`: `scores.max(dim=-1)`, a masked softmax
gathered at `max_ind`, `torch.scatter(scores, -1, selected_experts, -inf)`, a second max, then
`torch.concat` of multipliers and of selected experts), exported as ReduceMax + ArgMax,
ScatterElements, Softmax, GatherElements and Concat.

The rule, read from the graph alone: an ArgMax over the last axis whose input comes, through
layout ops, a constant bias Add, Softmax/Sigmoid and masks with constant fill values, from a
router MatMul/Gemm with a weight initializer is a selection on that router. A selection whose
masks are derived from (depend on) another selection on the same router comes after it; the
longest such chain is the router's top-k, k its length. A lone ArgMax (k = 1) counts only when
its router's output is not a model output (an in-graph greedy decode takes the ArgMax of the
head's logits, which is no router).
"""
from __future__ import annotations


from moeplan.passes.importers.onnx_graph_index import SCORE_OPS, Gate, GraphIndex, handed_on, router_of


def _argmax_ancestors(index: GraphIndex, name: str, stop) -> set:
    """ArgMax nodes that tensor `name` depends on, not looking past node `stop` (the router)."""
    found, seen, stack = set(), set(), [name]
    while stack:
        current = stack.pop()
        if current in seen:
            continue
        seen.add(current)
        node = index.producer.get(current)
        if node is None or node is stop:
            continue
        if node.op_type == "ArgMax":
            found.add(id(node))
        stack.extend(i for i in node.input if i)
    return found


def _selection_source(index: GraphIndex, name: str):
    """(router node, ids of the ArgMax nodes whose choices mask `name`) for the scores an ArgMax reads.

    Walks back through layout ops, a constant bias Add, Softmax/Sigmoid and masks (Where with a
    constant fill, ScatterElements writing a constant) to the router; (None, ...) if none.
    """
    masks = []  # tensors holding choices or masks
    while True:
        node = index.skip_back(name)
        if node is None:
            return None, set()
        if node.op_type in SCORE_OPS:
            name = node.input[0]
        elif node.op_type == "Where" and len(node.input) == 3:
            data = [i for i in node.input[1:] if not index.is_fill(i)]
            if len(data) != 1:
                return None, set()
            masks.append(node.input[0])
            name = data[0]
        elif node.op_type == "ScatterElements" and len(node.input) == 3 and index.is_fill(node.input[2]):
            masks.append(node.input[1])
            name = node.input[0]
        else:
            break
    router_node, weight, transposed = router_of(index, name)
    if router_node is None:
        return None, set()
    before = set()
    for mask in masks:
        before |= _argmax_ancestors(index, mask, router_node)
    return (router_node, weight, transposed), before


def _last_axis(node) -> bool:
    return next((a.i for a in node.attribute if a.name == "axis"), 0) != 0  # default 0: the tokens


def _from(index: GraphIndex, name: str, node) -> bool:
    """Whether tensor `name` is `node`'s first output, through layout ops."""
    return index.skip_back(name) is node


def _joined(index: GraphIndex, parts: list) -> str | None:
    """The output of a Concat whose inputs are exactly `parts` (nodes, in order), through layout ops."""
    if len(parts) == 1:
        return parts[0].output[0]
    for name in index.skip_forward(parts[0].output[0]):
        for node in index.consumers.get(name, ()):
            if node.op_type == "Concat" and len(node.input) == len(parts) and all(
                _from(index, i, p) for i, p in zip(node.input, parts)
            ):
                return node.output[0]
    return None


def _gathered_at(index: GraphIndex, choice) -> object | None:
    """The one GatherElements reading a value at the ArgMax `choice`'s index (the pick's gate weight)."""
    found = [
        node for name in index.skip_forward(choice.output[0]) for node in index.consumers.get(name, ())
        if node.op_type == "GatherElements" and len(node.input) > 1 and name == node.input[1]
    ]
    return found[0] if len(found) == 1 else None


def argmax_gates(model, index: GraphIndex) -> list:
    """One `Gate` per router that selects its experts by a chain of ArgMax nodes (see module doc)."""
    by_router: dict = {}
    for node in model.graph.node:
        if node.op_type != "ArgMax" or not _last_axis(node):
            continue
        router, before = _selection_source(index, node.input[0])
        if router is not None:
            by_router.setdefault(id(router[0]), (router, []))[1].append((node, before))
    gates = []
    for router, picks in by_router.values():
        chain_of = {}
        for node, before in picks:  # graph order is topological: earlier picks come first
            longest = max((chain_of[b] for b in before if b in chain_of), key=len, default=[])
            chain_of[id(node)] = longest + [node]
        chain = max(chain_of.values(), key=len)
        router_node, weight, transposed = router
        if len(chain) == 1 and index.reaches_output(router_node.output[0]):
            continue
        gathers = [_gathered_at(index, pick) for pick in chain]
        weights = _joined(index, gathers) if all(g is not None for g in gathers) else None
        gates.append(Gate(
            chain[-1], "pattern", len(chain), router_node, weight, transposed,
            indices_output=_joined(index, chain) or "",
            weights_output=handed_on(index, weights) if weights else "",
        ))
    return gates
