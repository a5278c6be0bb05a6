"""ONNX file -> ModelIR: find the MoE gates in the graph, name every weight, apply the stage rules.

The graph says *where* the MoE layers are (`onnx_gating.py`: MatMul -> Softmax -> TopK, or the
`com.microsoft` MoE/QMoE op) and how many experts each token takes (TopK's k, the op's `k`).
The weights say *what* each stage holds. They are turned into the same `Param`s the torch
importer reads and grouped by the shared rule in `stages.py`, which is why an exported TinyMoE
imports to an IR equal to its torch import.

Weight names: an initializer named by a module path (`blocks.0.moe.experts.3.w_up.weight`, as
torch.onnx's dynamo exporter writes them) keeps its name. One renamed by a graph optimizer
(`val_13`, `onnx::MatMul_42`) is named after the module path of the node that uses it (dynamo
`pkg.torch.onnx.name_scopes` metadata, or a legacy `/blocks.0/attn/qkv/MatMul` node name). Where
neither names nor metadata survive (anonymous initializers, stripped nodes), a gate's experts are
found from the data flow around it (`onnx_experts.py`). Weights are
taken in order of first use in the graph, which is forward order (initializers follow
registration order, and optimizers append the tensors they create).

A fused MoE op's stacked expert weights and its router weight are named `<layer>.experts.<input>`
and `<layer>.gate.weight`, which the stage rule recognises as an MoE block with fused experts;
QMoE's packed 4/8-bit weights count as their unpacked elements at int4/int8 size. 2-D weights get
torch's [out, in] shape (a weight used as `x @ W` is stored [in, out]), so vocabulary and router
sizes read the same as from torch. Model name and class come from `moeplan.*` model metadata
when the file was written by `moeplan export-onnx`, else the file name and the dynamo class
hierarchy (or the graph name).

Buffers (rotary `inv_freq`) are left out: those `moeplan export-onnx` lists in `moeplan.buffers`,
else those the data flow shows to be buffers and anonymous embedding/head weights named by their
role, both read from the data flow (`onnx_roles.py`).

Known limits: an optimizer that merges identical initializers (two untrained norms) makes one
weight look like two modules' and loses the other's count; `moeplan export-onnx` does not run it.
"""
from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

from moeplan.core.errors import UserError
from moeplan.passes.importers.onnx_experts import expert_weight_names
from moeplan.passes.importers.onnx_gating import find_gates
from moeplan.passes.importers.onnx_graph_index import GraphIndex, node_module_path
from moeplan.passes.importers.onnx_roles import anonymous_roles, meets_values, value_tensors
from moeplan.passes.importers.stages import Param, build_model_ir, classify_parameter_groups
from moeplan.core.ir import ModelIR

FQN = re.compile(r"^[A-Za-z_]\w*(\.\w+)+$")
ONNX_DTYPES = {
    1: "float32", 10: "float16", 16: "bfloat16", 11: "float64", 3: "int8", 2: "uint8",
    17: "float8_e4m3fn", 19: "float8_e5m2", 22: "int4", 21: "int4",
}
FLOAT_TYPES = {1, 10, 16, 11, 17, 19}
MOE_INPUTS = (None, None, "fc1_experts_weights", "fc1_experts_bias", "fc2_experts_weights",
              "fc2_experts_bias", "fc3_experts_weights", "fc3_experts_bias")
QMOE_INPUTS = (None, None, "fc1_experts_weights", "fc1_scales", "fc1_experts_bias",
               "fc2_experts_weights", "fc2_scales", "fc2_experts_bias", "fc3_experts_weights",
               "fc3_scales", "fc3_experts_bias", "fc1_zero_points", "fc2_zero_points",
               "fc3_zero_points")
NAME_KEY = "moeplan.name"
ARCHITECTURE_KEY = "moeplan.architecture"
BUFFERS_KEY = "moeplan.buffers"
HIERARCHY_KEY = "pkg.torch.onnx.class_hierarchy"
FX_NODE_KEY = "pkg.torch.onnx.fx_node"


def load_onnx_model(path):
    """The ModelProto at `path` (weights left on disk); unreadable or invalid files are a UserError."""
    import onnx

    path = Path(path)
    if not path.is_file():
        raise UserError(f"ONNX model {path} not found; check the path")
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as exc:  # protobuf decode errors have no common base class
        reason = " ".join(str(exc).split())[:120] or type(exc).__name__
        raise UserError(f"cannot read {path} as ONNX ({reason}); give a valid .onnx model file") from None
    if model.ir_version <= 0 or not model.opset_import or not model.graph.node:
        raise UserError(f"{path} is not a valid ONNX model (no graph or opset); give a valid .onnx model file")
    return model


def _dtype(tensor) -> str:
    return ONNX_DTYPES.get(tensor.data_type, "float32")


def _sanitize(text: str) -> str:
    return re.sub(r"[^\w.]", "_", text).strip("._")


def _leaf_from_fx(node, module: str) -> str:
    """The parameter leaf (`weight`, `bias`) dynamo's fx_node text names for module `module`."""
    flat = "p_" + module.replace(".", "_") + "_"
    for prop in node.metadata_props:
        if prop.key == FX_NODE_KEY:
            match = re.search(re.escape(flat) + r"(\w+)", prop.value)
            if match:
                return match.group(1)
    return ""


def _user_module(index: GraphIndex, name: str):
    """(module path, leaf) of the first node using initializer `name`, through Transpose/Cast."""
    frontier = [name]
    seen = set()
    while frontier:
        current = frontier.pop(0)
        if current in seen:
            continue
        seen.add(current)
        for node in index.consumers.get(current, ()):
            module = node_module_path(node)
            if module:
                return module, _leaf_from_fx(node, module)
            if node.op_type in ("Transpose", "Cast", "Identity"):
                frontier.append(node.output[0])
    return "", ""


def _contrib_stage_name(gate, number: int) -> str:
    return node_module_path(gate.node) or _sanitize(gate.node.name) or f"moe{number}"


def _contrib_params(index: GraphIndex, gate, stage: str) -> dict:
    """Initializer name -> Param for a fused MoE op: router [E, D] and stacked expert weights."""
    node = gate.node
    labels = QMOE_INPUTS if node.op_type == "QMoE" else MOE_INPUTS
    bits = next((int(a.i) for a in node.attribute if a.name == "expert_weight_bits"), 8)
    out = {}
    num_experts = None
    for i, name in enumerate(node.input):
        if i < 2 or not name or name not in index.initializers:
            continue
        tensor = index.initializers[name]
        label = labels[i] if i < len(labels) and labels[i] else f"input{i}"
        shape = tuple(int(d) for d in tensor.dims)
        dtype = _dtype(tensor)
        if node.op_type == "QMoE" and label.endswith("weights"):
            pack = 8 // bits if bits in (4, 8) else 1
            shape = shape[:-1] + (shape[-1] * pack,)
            dtype = "int4" if bits == 4 else "int8"
        num_experts = num_experts or shape[0]
        out[name] = Param(f"{stage}.experts.{label}", shape, dtype)
    if gate.router_weight is None:
        raise UserError(
            f"MoE node {node.name or node.op_type!r}: its router logits (input 2) do not come from "
            "a MatMul/Gemm with a weight initializer, so the router cannot be sized"
        )
    tensor = index.initializers[gate.router_weight]
    dims = tuple(int(d) for d in tensor.dims)
    if len(dims) != 2:
        raise UserError(f"MoE node {node.name!r}: router weight {gate.router_weight!r} is not 2-D")
    shape = dims if gate.router_transposed else (dims[1], dims[0])
    out[gate.router_weight] = Param(f"{stage}.gate.weight", shape, _dtype(tensor))
    router = gate.router_node
    if router is not None and router.op_type == "Gemm" and len(router.input) > 2 and router.input[2] in index.initializers:
        bias = index.initializers[router.input[2]]
        out[router.input[2]] = Param(f"{stage}.gate.bias", tuple(int(d) for d in bias.dims), _dtype(bias))
    return out


def _torch_layout(index: GraphIndex, name: str, shape: tuple) -> tuple:
    """A 2-D weight's shape as torch stores it, [out, in]: `x @ W` stores it [in, out]."""
    if len(shape) != 2:
        return shape
    for node in index.consumers.get(name, ()):
        if node.op_type == "MatMul" and node.input[1] == name:
            return (shape[1], shape[0])
        if node.op_type == "Gemm" and node.input[1] == name:
            trans_b = any(a.name == "transB" and a.i for a in node.attribute)
            return shape if trans_b else (shape[1], shape[0])
    return shape


def graph_params(model, gates, overrides=None) -> tuple:
    """(Params in initializer order, {initializer name: param name}) for every weight.

    `overrides` maps initializer names to parameter names decided elsewhere (structural experts).
    """
    index = GraphIndex(model.graph)
    overrides = overrides or {}
    values = value_tensors(model, index)
    buffers = _declared_buffers(model)
    roles = anonymous_roles(model, index)
    renamed = {}
    for number, gate in enumerate(g for g in gates if g.kind == "contrib"):
        renamed.update(_contrib_params(index, gate, _contrib_stage_name(gate, number)))
    params = []
    names = {}
    taken = {p.name for p in renamed.values()} | set(overrides.values())
    for tensor in model.graph.initializer:
        if tensor.name in renamed:
            param = renamed[tensor.name]
        else:
            shape = tuple(int(d) for d in tensor.dims)
            numel = 1
            for d in shape:
                numel *= d
            if tensor.data_type not in FLOAT_TYPES:
                continue
            if buffers is not None and tensor.name in buffers:
                continue
            if buffers is None and tensor.name not in overrides and not meets_values(index, tensor.name, values):
                continue  # a buffer (rotary inv_freq): it never meets the tokens' values
            if tensor.name in overrides:
                name = overrides[tensor.name]
            elif FQN.match(tensor.name):
                name = tensor.name
            else:
                if numel <= 1 or tensor.name not in index.consumers:
                    continue  # scalar constants and unused tensors are not parameters
                module, leaf = _user_module(index, tensor.name)
                if module:
                    name = f"{module}.{leaf or ('weight' if len(shape) >= 2 else 'bias')}"
                elif tensor.name in roles:
                    name = roles[tensor.name]
                else:
                    name = _sanitize(tensor.name) or "param"
            if tensor.name not in overrides:
                base, n = name, 1
                while name in taken:
                    name, n = f"{base}_{n}", n + 1
            param = Param(name, _torch_layout(index, tensor.name, shape), _dtype(tensor))
        taken.add(param.name)
        names[tensor.name] = param.name
        params.append(param)
    params = _in_use_order(index, params, names)
    params, names = _untie(index, params, names)
    return params, names


def _untie(index: GraphIndex, params: list, names: dict) -> tuple:
    """Split a weight the exporter stored once for two modules (a head tied to the embedding).

    torch.onnx keeps one initializer per tensor and names it after one of its modules (often
    the head). Where the nodes using it belong to two module paths, the first user (in graph
    order: the embedding lookup) owns it and the other gets an alias, as `named_parameters`
    with its duplicates would list them; the alias goes last, where a head runs.
    """
    by_name = {p.name: p for p in params}
    aliases = []
    renames = {}
    for tensor_name, param_name in list(names.items()):
        users = []
        for node in sorted(index.consumers.get(tensor_name, ()), key=lambda n: index.position[id(n)]):
            module = node_module_path(node)
            if module and module not in users:
                users.append(module)
        leaf = param_name.rpartition(".")[2]
        if len(users) != 2 or not param_name.startswith(users[1] + "."):
            continue
        a, b = users
        if a.startswith(b + ".") or b.startswith(a + "."):  # one module and its own submodule
            continue
        owner = f"{users[0]}.{leaf}"
        if owner in by_name:
            continue
        renames[param_name] = owner
        param = by_name[param_name]
        aliases.append(Param(param_name, param.shape, param.dtype, tied_to=owner))
        names[tensor_name] = owner
    if not renames:
        return params, names
    params = [replace(p, name=renames[p.name]) if p.name in renames else p for p in params]
    return params + aliases, names


def _declared_buffers(model):
    """Initializers the exporter declared to be buffers (`moeplan.buffers`), or None when the file
    declares none (another exporter): then the data-flow rule of `onnx_roles.py` finds them."""
    for prop in model.metadata_props:
        if prop.key == BUFFERS_KEY:
            try:
                return frozenset(json.loads(prop.value))
            except ValueError:
                break
    return None


def _in_use_order(index: GraphIndex, params: list, names: dict) -> list:
    """Params ordered by their first use in the graph (initializer order breaks ties).

    The graph runs in forward order, while initializers follow registration order (Hugging Face
    decoder layers register their norms last but run them first) or, after an optimizer, put the
    tensors it creates at the end; first use is the order the torch importer reads from the code.
    """
    first_use = {}
    for tensor_name, param_name in names.items():
        users = [index.position[id(n)] for n in index.consumers.get(tensor_name, ())]
        first_use[param_name] = min(users) if users else len(index.position)
    order = {p.name: i for i, p in enumerate(params)}
    return sorted(params, key=lambda p: (first_use[p.name], order[p.name]))


def _model_names(model, path: Path) -> tuple:
    meta = {p.key: p.value for p in model.metadata_props}
    architecture = meta.get(ARCHITECTURE_KEY, "")
    if not architecture:
        for node in model.graph.node:
            for prop in node.metadata_props:
                if prop.key == HIERARCHY_KEY:
                    first = prop.value.strip("[]").split(",")[0].strip("'\" ")
                    if first and not first.startswith("_"):
                        architecture = first.rsplit(".", 1)[-1]
                        break
            if architecture:
                break
    name = meta.get(NAME_KEY, "") or path.stem
    return name, architecture or model.graph.name or "onnx"


def _routed_groups(groups) -> list:
    """Every group with a router: MoE layers and the attention experts inside attention stages."""
    return [g for g in groups if g.is_moe] + [inner for g in groups for inner in g.attention_experts]


def _owner(groups, names: dict, gate):
    """The routed group (MoE layer or attention experts) whose router holds the gate's weight."""
    router_param = names.get(gate.router_weight or "", "")
    return next((g for g in _routed_groups(groups) if router_param.startswith(g.router + ".")), None)


def _structural_names(model, gates, unowned, names: dict, params) -> dict:
    """Initializer -> parameter names for gates whose experts are found by data flow alone."""
    index = GraphIndex(model.graph)
    shapes = {p.name: p.shape for p in params}
    order = sorted(gates, key=lambda g: index.position[id(g.node)])
    overrides = {}
    for gate in unowned:
        at = order.index(gate)
        later = order[at + 1] if at + 1 < len(order) else None
        stop = len(model.graph.node)
        if later is not None:
            stop = index.position[id(later.router_node if later.router_node is not None else later.node)]
        stage = node_module_path(gate.node) or f"moe{at}"
        num_experts = shapes[names[gate.router_weight]][0]
        overrides.update(expert_weight_names(index, gate, stage, stop, num_experts))
        overrides[gate.router_weight] = f"{stage}.gate.weight"
    return overrides


def _gate_owners(model, path: Path) -> tuple:
    """(groups, [(gate, owning routed group)]) for the graph: every gate with the MoE layer or
    attention-expert set whose router it reads; one-line UserError when that cannot be done."""
    gates = find_gates(model)
    if not gates:
        by_weights = [g.name for g in classify_parameter_groups(graph_params(model, [])[0]) if g.is_moe]
        if by_weights:
            raise UserError(
                f"{path}: {len(by_weights)} MoE layers by their weights ({by_weights[0]}, ...) but no gate the "
                "importer knows (router MatMul -> Softmax/Sigmoid -> TopK, experts picked one by one by "
                "ArgMax with masking, or com.microsoft MoE): this model routes another way; import the "
                "torch model instead"
            )
        raise UserError(
            f"no MoE gating pattern (MatMul->Softmax->TopK or com.microsoft MoE) found in {path}: "
            "moeplan plans MoE models only"
        )
    params, names = graph_params(model, gates)
    groups = classify_parameter_groups(params)
    unowned = [g for g in gates if _owner(groups, names, g) is None and g.kind == "pattern"]
    if unowned:
        overrides = _structural_names(model, gates, unowned, names, params)
        params, names = graph_params(model, gates, overrides)
        groups = classify_parameter_groups(params)
    owners = []
    for gate in gates:
        owner = _owner(groups, names, gate)
        if owner is None:
            where = gate.node.name or gate.node.op_type
            raise UserError(
                f"{path}: gate {where!r} (router weight {gate.router_weight!r}) belongs to no "
                "recognisable expert set; expert weights need module-path names such as "
                "layers.0.moe.experts.3.w_up.weight (torch.onnx.export(..., dynamo=True) keeps them)"
            )
        owners.append((gate, owner))
    return groups, owners


def moe_layer_gates(model, path) -> list:
    """The gates of `model`'s MoE layers (the IR's MoE stages), in graph order: not those of
    attention experts (JetMoE's), which the IR counts inside attention and tracing does not record."""
    groups, owners = _gate_owners(model, Path(path))
    layers = {id(g) for g in groups if g.is_moe}
    return [gate for gate, owner in owners if id(owner) in layers]


def import_onnx(path) -> ModelIR:
    """The IR of the ONNX model at `path`; one-line UserError when it is not an MoE model."""
    path = Path(path)
    model = load_onnx_model(path)
    groups, owners = _gate_owners(model, path)
    top_k, sources = {}, {}
    for gate, owner in owners:
        if owner.name in top_k:
            raise UserError(f"{path}: MoE layer {owner.name!r} has two gates; expected one TopK per layer")
        top_k[owner.name] = gate.top_k
        sources[owner.name] = f"onnx:{gate.node.name or gate.node.op_type}"
    missing = [g.name for g in _routed_groups(groups) if g.name not in top_k]
    if missing:
        raise UserError(
            f"{path}: MoE layer {missing[0]!r} has expert weights but no gate (Softmax->TopK) "
            "uses its router; check that the graph is complete"
        )
    name, architecture = _model_names(model, path)
    return build_model_ir(
        groups, name=name, architecture=architecture, top_k=top_k,
        source_format="onnx", sources=sources,
    )
