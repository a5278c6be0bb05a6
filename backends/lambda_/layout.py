"""Where a Lambda plan's dense units sit in the library's model, and which tensors each function ships.

Why: the bundle's functions run the library's own model (`runtime/lambda_/model.py`), which can
start and stop only at decoder-block boundaries and at an MoE layer's experts. This file maps the
planner's dense units (IR stages, each router after its layer's norm) onto those places:

* a unit's *piece* is `embed` (before the first decoder block), the index of its decoder block,
  or `tail` (after the last); units of one piece in one segment must share a function, which the
  partition pass guarantees by grouping them (`partition.group_units`);
* a part of a dense function (its units of one segment) starts at the ids, at a block's input,
  or, when it opens segment s > 0, right after MoE layer s-1's experts ("post": the rest of that
  block), and stops before a block, at MoE layer s's experts ("routing") or at the logits;
* tensors: a block's routed experts go to the expert functions; a part holds, for every block it
  runs, that block's other tensors (attention, norms, router, shared experts, dense MLP), for a
  "post" start the block's tensors but its attention's (the attention output is replayed), for a
  part that stops at an MoE layer's experts not the MoE block's tensors used only after them
  (shared experts: found by running the library's block on the meta device up to its experts),
  and the embedding or the final norm and head when it starts at the ids or ends at the logits.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from moeplan.runtime.lambda_.model import attention_module
from moeplan.core.errors import UserError
from moeplan.runtime.model.library_model import ModelError, decoder_layers
from moeplan.runtime.model.moe_adapter import expert_owner, find_containers


class LayoutError(UserError):
    """The model cannot be cut where the plan cuts it (one line)."""


@dataclass(frozen=True)
class Layout:
    prefix: str            # module path of the decoder blocks
    num_layers: int
    moe_layers: tuple      # decoder block of each MoE layer
    attention: tuple       # attention module path (relative to its block) per block
    containers: tuple      # moe_adapter.ExpertContainer per MoE layer
    tail_names: frozenset = frozenset()  # tensors outside the blocks that come after them (see `with_tail`)
    post_only: frozenset = frozenset()   # MoE-block tensors the library uses only after the experts (`with_routing`)

    @classmethod
    def of(cls, model) -> Layout:
        try:
            prefix, layers = decoder_layers(model)
            attention = tuple(attention_module(layer)[0] for layer in layers)
        except (ValueError, ModelError) as exc:  # no decoder blocks / attention module: the runtime cannot cut it
            raise LayoutError(f"the Lambda runtime cannot cut {type(model).__name__} into functions: {exc}") from None
        containers = tuple(find_containers(layers, prefix))
        return cls(prefix, len(layers), tuple(c.layer for c in containers), attention, containers)

    def block_of(self, source: str):
        """Decoder block index of a module path, None outside the blocks."""
        head = self.prefix + "."
        if not source.startswith(head):
            return None
        index = source[len(head):].split(".", 1)[0]
        return int(index) if index.isdigit() else None


def unit_pieces(layout: Layout, stages: list) -> dict:
    """unit name -> 'embed' | block index | 'tail', from the IR's stages (dicts: name, source, type)."""
    out, seen_block = {}, False
    for s in stages:
        block = layout.block_of(s.get("source") or s["name"])
        seen_block |= block is not None
        piece = block if block is not None else ("tail" if seen_block else "embed")
        out[s["name"] + (".router" if s.get("type") == "moe" else "")] = piece
    return out


def part_bounds(layout: Layout, pieces: dict, units: list, segment: int, opens: bool, closes: bool, next_unit) -> tuple:
    """(start, stop) of a part: its units of `segment`, whether it opens / closes the segment, and
    the first unit after it (None at the end)."""
    first = pieces[units[0]]
    if opens and segment > 0:
        start = {"at": "post", "layer": layout.moe_layers[segment - 1], "moe": segment - 1}
    elif first == "embed":
        start = {"at": "ids"}
    else:
        start = {"at": "layer", "layer": layout.num_layers if first == "tail" else int(first)}
    if closes:
        stop = {"at": "routing", "layer": layout.moe_layers[segment], "moe": segment} \
            if segment < len(layout.moe_layers) else {"at": "logits"}
    else:
        nxt = pieces[next_unit]
        if nxt == pieces[units[-1]]:
            where = f"decoder block {nxt}" if isinstance(nxt, int) else f"the model's {nxt}"
            raise LayoutError(f"the plan cuts {where} between '{units[-1]}' and '{next_unit}'; "
                              "regenerate it with this moeplan ('moeplan plan')")
        stop = {"at": "layer", "layer": layout.num_layers if nxt == "tail" else int(nxt)}
    return start, stop


def part_tensors(layout: Layout, names: list, start: dict, stop: dict) -> list:
    """State-dict names (experts split out) a part needs; `names` are every dense tensor's name."""
    first = {"ids": 0, "layer": start.get("layer"), "post": start.get("layer")}[start["at"]]
    last = {"layer": stop.get("layer"), "routing": (stop.get("layer") or 0) + 1, "logits": layout.num_layers}[stop["at"]]
    out = []
    for n in names:
        block = layout.block_of(n)
        if block is None:
            before = n not in layout.tail_names
            keep = (before and start["at"] == "ids") or (not before and stop["at"] == "logits")
        elif start["at"] == "post" and block == first:
            keep = not n.startswith(f"{layout.prefix}.{block}.{layout.attention[block]}.")
        else:
            keep = first <= block < last and not (stop["at"] == "routing" and block == last - 1 and n in layout.post_only)
        if keep:
            out.append(n)
    return out


class _Reached(Exception):
    pass


def with_routing(layout: Layout, model) -> Layout:
    """Record the MoE-block tensors the library uses only after the experts: each block runs on
    the meta device (a copy; no compute) until its experts module is called. A block that cannot
    run on meta (data-dependent routing code) keeps every tensor in the routing function."""
    import copy

    import torch

    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden = getattr(text, "hidden_size", None)
    post_only = set()
    for c in layout.containers:
        if hidden is None:
            break
        block = copy.deepcopy(model.get_submodule(c.block)).to("meta")
        rel = c.path[len(c.block) + 1:] if c.path != c.block else ""
        stops = {".".join(x for x in (rel, p.rpartition(".")[0]) if x) for p, _ in c.params}
        called, hooks = [], []
        for name, module in block.named_modules():
            def pre(m, args, name=name):
                if name in stops:  # noqa: B023 (called within this iteration)
                    raise _Reached()
                called.append(name)  # noqa: B023 (called within this iteration)
            hooks.append(module.register_forward_pre_hook(pre))
        try:
            with torch.no_grad():
                block(torch.zeros(1, 2, int(hidden), device="meta"))
            continue  # never reached its experts: keep everything
        except _Reached:
            pass
        except Exception:
            continue
        finally:
            for h in hooks:
                h.remove()
        used = {f"{m}.{p}" if m else p for m in set(called) for p, _ in block.get_submodule(m).named_parameters(recurse=False)}
        routed = {f"{rel}.{p}" if rel else p for p, _ in c.params}
        for p, _ in block.named_parameters():
            if p not in used and p not in routed:
                post_only.add(f"{c.block}.{p}")
    return replace(layout, post_only=frozenset(post_only))


def with_tail(layout: Layout, names: list, stages: list) -> Layout:
    """Record which non-block tensors come after the blocks (final norm, head), by the IR's order."""
    pieces = unit_pieces(layout, stages)
    sources = [(s.get("source") or s["name"], pieces[s["name"] + (".router" if s.get("type") == "moe" else "")])
               for s in stages]
    tail = set()
    for n in names:
        if layout.block_of(n) is not None:
            continue
        match = max((src for src, _ in sources if n == src or n.startswith(src + ".")), key=len, default=None)
        if match is None:
            raise LayoutError(f"tensor '{n}' belongs to no stage of the model's IR; the Lambda target cannot place it")
        if dict(sources)[match] == "tail":
            tail.add(n)
    return replace(layout, tail_names=frozenset(tail))


def expert_tensor_owner(layout: Layout):
    """Bundle tensor name (experts split out) -> (MoE layer, expert) or None."""
    return expert_owner(list(layout.containers))


def dense_tensor_bytes(layout: Layout, model, stages: list) -> tuple:
    """(layout with its tail tensors, {dense tensor name: bytes}) of a library model (meta is fine)."""
    routed = {f"{c.path}.{p}" for c in layout.containers for p, _ in c.params}
    sizes = {n: t.numel() * t.element_size() for n, t in model.state_dict().items() if n not in routed}
    return with_tail(layout, sorted(sizes), stages), sizes


def group_bytes(layout: Layout, sizes: dict, pieces: dict, unit_names: tuple, segment: int, opens: bool) -> int:
    """Bytes a function holds for a group of units: every block they touch (but its routed
    experts), the embedding / final norm and head, and, opening segment s > 0, the rest of MoE
    layer s-1's block (`part_tensors` ships the same)."""
    touched = {pieces[n] for n in unit_names}
    post = layout.moe_layers[segment - 1] if opens and segment > 0 else None
    total = 0
    for n, size in sizes.items():
        block = layout.block_of(n)
        if block is None:
            keep = ("tail" if n in layout.tail_names else "embed") in touched
        else:
            routing = segment < len(layout.moe_layers) and block == layout.moe_layers[segment]
            keep = (block in touched and not (routing and n in layout.post_only)) or \
                (block == post and not n.startswith(f"{layout.prefix}.{block}.{layout.attention[block]}."))
        total += size if keep else 0
    return total


def runtime_units(loaded, spec: str, units: list, group_units) -> list:
    """The partition pass's units grouped where the Lambda runtime can cut (between decoder blocks of
    the library's model) by `group_units` (passes/optimize/serverless/partition.py, which the pass
    gives), each group's bytes those its function will ship; unchanged for models the runtime cannot
    run (ONNX graphs: plan only)."""
    if loaded.module is None:
        return units
    try:
        layout = Layout.of(loaded.module)
    except LayoutError:
        return units
    stages = loaded.ir.to_dict()["stages"]
    layout, sizes = dense_tensor_bytes(with_routing(layout, _meta_model(loaded, spec)), loaded.module, stages)
    pieces = unit_pieces(layout, stages)
    if len(layout.moe_layers) != len(loaded.ir.moe_stages) or any(u not in pieces for x in units for u in x.names):
        return units
    return group_units(units, lambda name: pieces[name],
                       lambda u, opens: group_bytes(layout, sizes, pieces, u.names, u.segment, opens))


def _meta_model(loaded, spec: str):
    """The model as the bundle's functions build it (transformers: on the meta device), so that
    probing its blocks never copies real weights; the loaded module where no bundle could be made."""
    from moeplan.backends.common.model_source import bundle_model, model_files

    try:
        arch, files = model_files(spec)
        return bundle_model(arch, files, spec)
    except UserError:
        return loaded.module
