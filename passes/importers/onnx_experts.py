"""Find an MoE layer's experts from the graph's structure, for ONNX files whose weights lost their names.

When initializers are anonymous (`W12`, `onnx::MatMul_345`) and nodes carry no module paths, the
only evidence of which weights form expert 3 is the data flow around the gate:

* the experts read the tokens the router reads (directly, or gathered by the dispatch, which
  depends on the TopK *indices*);
* each expert's output is multiplied by its gate weight, which depends on the TopK *values*:
  nodes that take anything derived from the values are the combine step, where the search stops
  (a shared expert's output is added, not multiplied by a gate weight);
* weights whose MatMuls feed one another (gate and up projections meeting in the SwiGLU product,
  then the down projection) belong to one expert; weights whose paths only meet at the combine
  belong to different experts.

So: walk forward from the router's input, never entering the router or a node that reads a
value-derived tensor, and never past the next gate; group the weight-bearing MatMul/Gemm nodes by
shared descent; a group whose output reaches the combine is a routed expert, any other group a
shared expert. The result names every weight `<layer>.experts.<j>.w<n>` (`shared_experts` for
shared ones) so the stage rules can size the layer.
"""
from __future__ import annotations

from moeplan.core.errors import UserError
from moeplan.passes.importers.onnx_graph_index import GraphIndex

WEIGHTING_OPS = {"Mul", "MatMul", "Einsum"}  # expert output x gate weight; a plain Add is not one


def _forward_closure(index: GraphIndex, start: str) -> set:
    seen, stack = set(), [start]
    while stack:
        name = stack.pop()
        if name in seen:
            continue
        seen.add(name)
        for node in index.consumers.get(name, ()):
            stack.extend(o for o in node.output if o)
    return seen


def _find(parent: dict, x):
    while parent[x] != x:
        parent[x] = parent[parent[x]]
        x = parent[x]
    return x


def _node_weights(index: GraphIndex, node) -> list:
    """Initializers a node reads as weights (a MatMul/Gemm B and C, any other float tensor)."""
    out = []
    for i, name in enumerate(node.input):
        if not name:
            continue
        if node.op_type in ("MatMul", "Gemm") and i >= 1:
            found = index.weight_initializer(name)
        else:
            found = name if name in index.initializers else None
        if found is not None:
            tensor = index.initializers[found]
            numel = 1
            for d in tensor.dims:
                numel *= int(d)
            if numel > 1 and tensor.data_type in (1, 10, 11, 16):
                out.append(found)
    return out


def expert_weight_names(index: GraphIndex, gate, stage: str, stop_position: int, num_experts: int) -> dict:
    """Initializer name -> `<stage>.experts.<j>.w<n>` / `<stage>.shared_experts.<j>.w<n>`.

    Raises UserError when the graph does not split into `num_experts` routed experts.
    """
    values = gate.weights_output or gate.node.output[0]  # the gate weights the combine multiplies by
    tainted = _forward_closure(index, values)
    start = gate.router_node.input[0]
    region = []  # nodes in topological order
    seen_nodes = set()
    frontier = [start]
    reached = {start}
    while frontier:
        name = frontier.pop()
        for node in index.consumers.get(name, ()):
            if id(node) in seen_nodes or node is gate.router_node:
                continue
            if index.position[id(node)] >= stop_position or any(i in tainted for i in node.input if i):
                continue
            seen_nodes.add(id(node))
            region.append(node)
            for out in node.output:
                if out and out not in reached:
                    reached.add(out)
                    frontier.append(out)
    region.sort(key=lambda n: index.position[id(n)])

    seeds_of = {}  # tensor -> frozenset of seed node ids it descends from
    parent = {}
    seed_nodes = {}
    weights_of = {}
    for node in region:
        inherited = set()
        for name in node.input:
            inherited |= seeds_of.get(name, set())
        weights = _node_weights(index, node)
        if node.op_type in ("MatMul", "Gemm") and weights:
            parent[id(node)] = id(node)
            seed_nodes[id(node)] = node
            inherited.add(id(node))
        if weights and inherited:
            weights_of.setdefault(min(inherited, key=lambda s: index.position[id(seed_nodes[s])]), []).extend(weights)
        members = sorted(inherited)
        for other in members[1:]:
            a, b = _find(parent, members[0]), _find(parent, other)
            if a != b:
                parent[b] = a
        for out in node.output:
            seeds_of[out] = inherited

    groups: dict = {}
    for seed in sorted(seed_nodes, key=lambda s: index.position[id(seed_nodes[s])]):
        groups.setdefault(_find(parent, seed), []).append(seed)
    routed, shared = [], []
    for _root, seeds in groups.items():
        outputs = {o for s in seeds for o in seed_nodes[s].output}
        descendants = set()
        for node in region:
            if seeds_of.get(node.output[0], set()) & set(seeds):
                descendants.update(node.output)
        outputs |= descendants
        feeds_combine = any(
            consumer.op_type in WEIGHTING_OPS and any(i in tainted for i in consumer.input if i)
            for o in outputs for consumer in index.consumers.get(o, ())
        )
        weights = []
        for s in seeds:
            weights.extend(weights_of.get(s, []))
        (routed if feeds_combine else shared).append(list(dict.fromkeys(weights)))
    if len(routed) != num_experts:
        where = gate.node.name or gate.node.op_type
        raise UserError(
            f"cannot tell the experts of gate {where!r} apart: its router has {num_experts} outputs but "
            f"{len(routed)} expert subgraphs feed the weighted combine; export with parameter names "
            "(torch.onnx.export(..., dynamo=True)) so experts are named"
        )
    names = {}
    for part, lists in (("experts", routed), ("shared_experts", shared)):
        for j, weights in enumerate(lists):
            for n, weight in enumerate(weights):
                names.setdefault(weight, f"{stage}.{part}.{j}.w{n}")
    return names
