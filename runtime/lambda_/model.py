"""A Lambda function's share of the library's own model: a run of decoder blocks between two cuts,
or one MoE layer's experts.

Why: a Lambda bundle cuts the model into functions (dense slices between MoE layers, one function
per expert replica), yet every function must run the library's code, as the torchrun runtime does
(`library_model`, `moe_adapter`), never a re-derivation. A dense function therefore builds the
model class named by the config, loads only its own tensors (the rest go to the meta device) and
runs the library's forward with three kinds of cut, all by hooks on the decoder blocks:

* start: at the model's input (ids), at a block's input (the residual stream `x` carried in the
  state), or right after an MoE layer's experts ("post"): the block's input `x` is injected, its
  attention module replays the output recorded by the function that routed the layer, and the
  library runs the rest of the block (norm, router, shared experts, residual) with the routed
  sum combined from the expert functions standing for the experts module (`MoEAdapter.route_fn`);
* stop: before a block (its input becomes `x`), at an MoE layer's experts (the library's router
  has chosen: the experts' input rows, ids and weights go to the expert functions; `x` and the
  attention output are kept for the "post" start), or at the logits;
* blocks outside the run are skipped (their forward returns its input).

An expert function runs `MoEAdapter.local_expert_output`: the library's experts module holding
only this function's expert. Batches are one generation step's flat rows (the step's tokens of every
sequence, sorted by sequence), laid out here as a left-padded [B, W] batch whose attention reaches
the K/V of earlier steps through the library's own cache (`kv.py` keeps it between
invocations): a prompt is one step of all its tokens, each decode step one token per sequence.
"""
from __future__ import annotations

from pathlib import Path

import torch

from .kv import append_names, flatten_layer, restore_layer
from ..model.library_model import ATTENTION_NAMES, build_tiny_moe, build_transformers, cache_kwarg, decoder_layers
from ..model.moe_adapter import MoEAdapter, find_containers


class Stop(Exception):
    """Raised through the library's forward at the part's end; `values` are what it carries."""

    def __init__(self, **values):
        super().__init__("part ends here")
        self.values = values


def model_dir_of(runtime_dir: Path) -> Path:
    """The model files shipped beside the runtime (functions/model/ in the image)."""
    return Path(runtime_dir).resolve().parent / "model"


def architecture_of(model_dir: Path) -> str:
    return "tiny_moe" if (Path(model_dir) / "model.py").is_file() else "transformers"


def build(model_dir: Path, device: str = "cpu"):
    """The library's model for the shipped config (transformers, or the shipped model.py)."""
    if architecture_of(model_dir) == "tiny_moe":
        return build_tiny_moe(Path(model_dir) / "config.json", Path(model_dir) / "model.py")
    return build_transformers(Path(model_dir), device=device)


def attention_module(layer):
    for name in ATTENTION_NAMES:
        try:
            return name, layer.get_submodule(name)
        except AttributeError:
            continue
    raise ValueError(f"decoder block {type(layer).__name__} has no attention module among {ATTENTION_NAMES}")


def _skip(hidden_states, *args, **kwargs):
    return hidden_states


def _unload_others(model, loaded: set) -> None:
    """Parameters this function was not given move to the meta device (they are never run)."""
    for prefix, module in model.named_modules():
        for name, param in list(module._parameters.items()):
            full = f"{prefix}.{name}" if prefix else name
            if param is not None and full not in loaded and not param.is_meta:
                module._parameters[name] = torch.nn.Parameter(torch.empty(param.shape, dtype=param.dtype, device="meta"),
                                                              requires_grad=False)


class Batch:
    """One step's flat rows <-> a left-padded [B, W] batch attending to `past` earlier columns.

    key_mask [B, past + W] is False where a column is padding (prompts are left-padded to the
    longest, as the torchrun engine pads them), so every step appends W columns to every
    sequence's cache and decode steps are [B, 1]."""

    def __init__(self, seq: torch.Tensor, positions: torch.Tensor, key_mask: torch.Tensor):
        self.key_mask = key_mask.to(torch.bool)
        self.B = int(self.key_mask.shape[0])
        counts = torch.bincount(seq, minlength=self.B)
        self.W = int(counts.max()) if seq.numel() else 0
        self.past = int(self.key_mask.shape[1]) - self.W
        starts = torch.cumsum(counts, 0) - counts
        rank = torch.arange(seq.numel()) - starts[seq]          # rows are sorted by sequence
        self.index = seq * self.W + (self.W - counts[seq]) + rank  # flat row -> padded row
        self.positions = self.pad(positions)

    def pad(self, rows: torch.Tensor) -> torch.Tensor:
        """[N, ...] -> [B, W, ...] (zeros in padding)."""
        out = rows.new_zeros(self.B * self.W, *rows.shape[1:])
        out[self.index] = rows
        return out.view(self.B, self.W, *rows.shape[1:])

    def unpad(self, padded: torch.Tensor) -> torch.Tensor:
        """[B, W, ...] or [B * W, ...] -> [N, ...]."""
        return padded.reshape(self.B * self.W, *padded.shape[2 if padded.shape[:2] == (self.B, self.W) else 1:])[self.index]


class DenseShare:
    """The library's model holding one dense function's tensors; `run(state, part, routed)`."""

    def __init__(self, model_dir: Path, weights: dict):
        self.kind = architecture_of(model_dir)
        self.model = build(model_dir)
        self.prefix, self.layers = decoder_layers(self.model)
        containers = find_containers(self.layers, self.prefix)
        result = self.model.load_state_dict(weights, strict=False, assign=True)
        if result.unexpected_keys:
            raise ValueError(f"tensors {result.unexpected_keys[:3]} are not parameters of {type(self.model).__name__}")
        self.adapters = {c.moe: MoEAdapter(self.model, c, [], {}, self._route) for c in containers}
        if self.kind != "tiny_moe":  # TinyMoE is small and embeds every call: keep its unused tensors
            _unload_others(self.model, set(weights))
        self.model.eval()
        self.cache_kwarg = cache_kwarg(self.model) if self.kind != "tiny_moe" else None
        self._stop_moe = self._post_moe = None
        self._routed = None

    # --- the routed computation of the MoE blocks this part touches --------------------------
    def _route(self, adapter, h, ids, weights):
        if adapter.moe == self._stop_moe:
            raise Stop(h=h, ids=ids, weights=weights)
        if adapter.moe == self._post_moe:
            if self._routed.shape[0] != h.shape[0]:
                raise RuntimeError(f"MoE layer {adapter.moe} saw {h.shape[0]} rows, the combined outputs have {self._routed.shape[0]}")
            return self._routed.to(h.dtype)
        raise RuntimeError(f"MoE layer {adapter.moe} is outside this function's part")

    def run(self, state: dict, part: dict, routed: torch.Tensor | None = None, kv: dict | None = None) -> tuple:
        """Run one part on `state` (one step's flat rows: ids, positions, seq, key_mask [B, past + W],
        and x / attn / route_* when it starts inside the model) attending to `kv` (this part's
        layers' cache state from earlier steps, `kv`); returns (new state, routing or None,
        kv after this step, append names) where routing is (h [N, D], ids [N, k], weights [N, k])
        of the MoE layer the part stops at."""
        batch = Batch(state["seq"], state["positions"], state["key_mask"])
        start, stop = part["start"], part["stop"]
        first, last = self._bounds(part)
        own = self.own_layers(part)
        cache = self._cache_view(batch, own, kv or {})
        hooks, patched, keep = [], [], {}
        self._stop_moe = stop.get("moe") if stop["at"] == "routing" else None
        self._post_moe = start.get("moe") if start["at"] == "post" else None
        try:
            for i, layer in enumerate(self.layers):
                if not first <= i < last:
                    layer.forward = _skip
                    patched.append((layer, "forward"))
            if start["at"] in ("layer", "post"):
                hooks.append(self._inject(first, batch.pad(state["x"].float())))
            if start["at"] == "post":
                L = int(start["layer"])
                _, attn = attention_module(self.layers[L])
                replay = self._replay(batch.pad(state["attn"].float()), int(state["attn_items"]))
                attn.forward = lambda *a, **k: replay
                patched.append((attn, "forward"))
                self._routed = batch.pad(routed.float()).reshape(batch.B * batch.W, -1)
            if stop["at"] == "layer":
                hooks.append(self._stop_before(int(stop["layer"])))
            if stop["at"] == "routing":
                L = int(stop["layer"])
                hooks.append(self.layers[L].register_forward_pre_hook(self._keeper(keep, "x"), with_kwargs=True))
                _, attn = attention_module(self.layers[L])
                hooks.append(attn.register_forward_hook(lambda m, a, out: keep.update(attn=out)))
            try:
                with torch.no_grad():
                    logits = self._forward(batch, state, start["at"] == "ids", cache)
                stopped = {}
            except Stop as end:
                stopped = end.values
        finally:
            for h in hooks:
                h.remove()
            for module, name in patched:
                delattr(module, name)
            self._routed = None
        after, append = self._cache_state(cache, own)
        out = {k: state[k] for k in ("ids", "positions", "seq", "key_mask")}
        if stop["at"] == "logits":
            out["logits"] = batch.unpad(logits).float()
            return out, None, after, append
        if stop["at"] == "layer":
            out["x"] = batch.unpad(stopped["x"]).float()
            return out, None, after, append
        if "h" not in stopped:
            raise RuntimeError(f"the part should stop at MoE layer {stop.get('moe')} but the forward ended")
        attn = keep["attn"]
        items = len(attn) if isinstance(attn, tuple) else 0
        out["x"] = batch.unpad(keep["x"]).float()
        out["attn"] = batch.unpad(attn[0] if items else attn).float()
        out["attn_items"] = torch.tensor(items)
        idx = batch.index
        h = stopped["h"].reshape(batch.B * batch.W, -1)[idx].float()
        ids = stopped["ids"].reshape(batch.B * batch.W, -1)[idx].to(torch.int64)
        w = stopped["weights"].reshape(batch.B * batch.W, -1)[idx].float()
        out["route_ids"], out["route_w"] = ids, w
        return out, (h, ids, w), after, append

    def _bounds(self, part: dict) -> tuple:
        """[first, last) decoder blocks the part runs (the others are skipped)."""
        start, stop = part["start"], part["stop"]
        first = {"ids": 0, "layer": start.get("layer"), "post": start.get("layer")}[start["at"]]
        last = {"layer": stop.get("layer"), "routing": (stop.get("layer") or 0) + 1, "logits": len(self.layers)}[stop["at"]]
        return first, last

    def own_layers(self, part: dict) -> list:
        """Blocks whose attention this part runs, so whose cache it keeps (a "post" start replays
        its first block's attention: that block's cache is the routing part's)."""
        first, last = self._bounds(part)
        return [i for i in range(first, min(last, len(self.layers))) if not (part["start"]["at"] == "post" and i == first)]

    def _forward(self, batch: Batch, state: dict, from_ids: bool, cache):
        ids = batch.pad(state["ids"]) if from_ids else torch.zeros(batch.B, batch.W, dtype=torch.int64)
        if self.kind == "tiny_moe":
            return self.model.forward_incremental(ids, batch.positions, cache, batch.key_mask)
        embeds = None if from_ids else torch.zeros(batch.B, batch.W, state["x"].shape[-1])
        out = self.model(input_ids=ids if from_ids else None, inputs_embeds=embeds,
                         attention_mask=batch.key_mask.to(torch.int64), position_ids=batch.positions, use_cache=True,
                         **{self.cache_kwarg: cache})
        return out.logits

    # --- the library's cache, rebuilt per invocation -------------------------------------------
    def _cache_view(self, batch: Batch, own: list, kv: dict):
        """The library's cache for this forward: this part's layers (`own`) hold their state from
        earlier steps; every other layer of a transformers cache holds a stand-in of the right
        length (a [B, 1, past, 1] zero key), because the library sizes the attention mask from one
        layer's length and that layer may belong to another function."""
        if self.kind == "tiny_moe":
            return [dict(kv.get(i, {})) if i in own else {} for i in range(len(self.layers))]
        from transformers.cache_utils import DynamicCache, DynamicLayer

        cache = DynamicCache(config=self.model.config)
        for i, layer in enumerate(cache.layers):
            if i in own and i in kv:
                restore_layer(layer, kv[i])
            elif i not in own and batch.past and isinstance(layer, DynamicLayer):
                stand_in = torch.zeros(batch.B, 1, batch.past, 1)
                layer.update(stand_in, stand_in)
        return cache

    def _cache_state(self, cache, own: list) -> tuple:
        """({layer: flat state}, {layer: append names}) of this part's layers after the forward."""
        if self.kind == "tiny_moe":
            return ({i: dict(cache[i]) for i in own if cache[i]}, {i: {"k", "v"} for i in own if cache[i]})
        state = {i: flatten_layer(cache.layers[i]) for i in own if i < len(cache.layers)}
        return state, {i: append_names(cache.layers[i]) for i in state}

    # --- hooks ------------------------------------------------------------------------------
    def _inject(self, layer: int, x: torch.Tensor):
        """The residual stream enters at block `layer` (after the last block: as its output)."""
        if layer < len(self.layers):
            def pre(module, args, kwargs):
                if args:
                    return (x.to(args[0].dtype),) + tuple(args[1:]), kwargs
                return args, dict(kwargs, hidden_states=x.to(kwargs["hidden_states"].dtype))
            return self.layers[layer].register_forward_pre_hook(pre, with_kwargs=True)
        return self.layers[-1].register_forward_hook(lambda m, a, out: x.to(out.dtype))

    def _stop_before(self, layer: int):
        if layer < len(self.layers):
            def pre(module, args, kwargs):
                raise Stop(x=args[0] if args else kwargs["hidden_states"])
            return self.layers[layer].register_forward_pre_hook(pre, with_kwargs=True)

        def post(module, args, out):
            raise Stop(x=out)
        return self.layers[-1].register_forward_hook(post)

    @staticmethod
    def _keeper(keep: dict, key: str):
        def pre(module, args, kwargs):
            keep[key] = args[0] if args else kwargs["hidden_states"]
        return pre

    @staticmethod
    def _replay(output: torch.Tensor, items: int):
        """The attention module's recorded output in its own shape: a tensor, or a tuple whose
        first item is the output (the blocks discard the others: attention weights, router logits)."""
        return output if items == 0 else (output,) + (None,) * (items - 1)


class ExpertShare:
    """The library's experts module of one MoE layer holding one expert: weighted outputs of rows."""

    def __init__(self, model_dir: Path, weights: dict, moe: int, expert: int):
        kind = architecture_of(model_dir)
        model = build(model_dir, device="cpu" if kind == "tiny_moe" else "meta")
        prefix, layers = decoder_layers(model)
        container = next((c for c in find_containers(layers, prefix) if c.moe == moe), None)
        if container is None:
            raise ValueError(f"the model has no MoE layer {moe}")
        self.model = model  # keeps the block (and the adapter's experts module) alive
        self.adapter = MoEAdapter(model, container, [expert], weights, None)

    def run(self, rows: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """rows [m, D], gate weights [m] -> weighted outputs [m, D] (the library's experts module)."""
        with torch.no_grad():
            return self.adapter.local_expert_output(rows, torch.zeros(rows.shape[0], dtype=torch.int64), weights).float()
