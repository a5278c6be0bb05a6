"""The order a module's submodules run in, read from the source of its `forward` without running it.

Stage order matters to planning (pipeline cuts, activation hand-offs), and registration order is
not forward order: Hugging Face decoder layers register `self_attn, mlp, input_layernorm,
post_attention_layernorm` but run the norms first. Running the model to find out is not an option
for full-size models on `meta` (their expert dispatch is data-dependent), so the order is read
from the code: every `self.<child>` a class's `forward` touches, in Python's evaluation order
(a call's arguments before the call itself, so `self.attn(self.attn_norm(x))` runs `attn_norm`
first), following `self.<method>(...)` into helper methods. Children the code never names keep
their registration order after the named ones; container modules (ModuleList, Sequential, ...)
run their children in registration order. Deterministic, and a no-op for models whose
registration order is already forward order, such as the example TinyMoE.
"""
from __future__ import annotations

import ast
import functools
import inspect
import textwrap
from collections.abc import Iterator


@functools.cache
def _method_tree(cls: type, method: str):
    func = getattr(cls, method, None)
    if func is None or not callable(func):
        return None
    try:
        source = textwrap.dedent(inspect.getsource(inspect.unwrap(func)))
        return ast.parse(source)
    except (OSError, TypeError, SyntaxError, IndentationError):
        return None


def _self_names_in_evaluation_order(node) -> Iterator[str]:
    """Attribute names `X` of `self.X`, in the order Python evaluates them (call args first)."""
    if isinstance(node, ast.Call):
        for arg in node.args:
            yield from _self_names_in_evaluation_order(arg)
        for kw in node.keywords:
            yield from _self_names_in_evaluation_order(kw.value)
        yield from _self_names_in_evaluation_order(node.func)
        return
    if isinstance(node, ast.Assign):  # the value runs before the targets are bound
        yield from _self_names_in_evaluation_order(node.value)
        for target in node.targets:
            yield from _self_names_in_evaluation_order(target)
        return
    if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"):
        yield node.attr
        return
    for child in ast.iter_child_nodes(node):
        yield from _self_names_in_evaluation_order(child)


@functools.cache
def child_call_order(cls: type, children: tuple) -> tuple:
    """`children` (attribute names of submodules) in the order `cls.forward` first touches them."""
    wanted = set(children)
    seen: list = []
    visited_methods: set = set()

    def walk(method: str) -> None:
        if method in visited_methods:
            return
        visited_methods.add(method)
        tree = _method_tree(cls, method)
        if tree is None:
            return
        for name in _self_names_in_evaluation_order(tree):
            if name in wanted:
                if name not in seen:
                    seen.append(name)
            elif callable(getattr(cls, name, None)) and not name.startswith("__"):
                walk(name)

    walk("forward")
    return tuple(seen) + tuple(c for c in children if c not in seen)


def _is_container(module) -> bool:
    import torch.nn as nn

    return isinstance(module, (nn.ModuleList, nn.ModuleDict, nn.Sequential, nn.ParameterList, nn.ParameterDict))


def module_ranks(root) -> dict:
    """Module path -> position in forward order (depth-first, children in run order)."""
    ranks: dict = {}

    def visit(module, path: str) -> None:
        ranks[path] = len(ranks)
        names = tuple(name for name, _ in module.named_children())
        if not _is_container(module):
            names = child_call_order(type(module), names)
        for name in names:
            visit(module._modules[name], f"{path}.{name}" if path else name)

    visit(root, "")
    return ranks


def rank_of(path: str, ranks: dict) -> int:
    """The rank of `path`, or of its nearest ancestor module when `path` names a parameter."""
    while path not in ranks and path:
        path = path.rpartition(".")[0]
    return ranks.get(path, 0)
