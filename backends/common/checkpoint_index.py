"""A Hugging Face safetensors checkpoint -> bundle `TensorEntry`s, without loading it.

The checkpoint's tensor names are mapped to the library model's state dict the way transformers
maps them when it loads (its own conversion mapping for the architecture: renamings, then per-expert
tensors such as Mixtral's `experts.N.w1/w3` merged into a fused `experts.gate_up_proj`), but
applied per expert: each bundle tensor gets a *recipe* (`runtime/checkpoint_reader.py`) that reads
only that expert's tensors. Fused checkpoint tensors ([E, ...], DBRX's [E * r, D]) are cut by
rows. Only the headers are read here; tensors are read when an entry is loaded.

Fine-grained FP8 checkpoints (DeepSeek-V3, Qwen3 `-FP8`): a weight stored as F8_E4M3/F8_E5M2 is
read with its `<name>_scale_inv` and the config's `quantization_config.weight_block_size` and
dequantized to the library model's dtype (`runtime/fp8_blocks.py`); the scale tensors themselves
map to no library tensor. Followed: transformers 5.24 `integrations/finegrained_fp8.py`.

Followed: transformers 5.23 `core_model_loading.py` (`rename_source_key`, `MergeModulelist`,
`Concatenate`) and `conversion_mapping.py` for what the operations mean; the ops supported per
expert are MergeModulelist(dim=0) optionally followed by Concatenate(dim>=1), which covers every
MoE architecture the runtime runs. Anything else is refused with the reason.
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

from moeplan.backends.common.tensor_entries import TensorEntry, expert_params, expert_shape, per_expert_rows
from moeplan.runtime.checkpoint_reader import (DTYPE_NAMES, DTYPES, file_sha256, header_sha256,
                                                        read_header, read_recipe)
from moeplan.runtime.fp8_blocks import FP8_DTYPES, SCALE_SUFFIX
from moeplan.core.errors import UserError

INDEX = "model.safetensors.index.json"


def checkpoint_tensors(directory: Path) -> dict:
    """checkpoint tensor name -> (file name, header entry), from the index json or every *.safetensors file."""
    directory = Path(directory)
    if (directory / INDEX).is_file():
        try:
            weight_map = json.loads((directory / INDEX).read_text())["weight_map"]
        except (ValueError, KeyError, TypeError):
            raise UserError(f"{directory / INDEX} has no valid \"weight_map\"; fix or remove the index file") from None
        files = sorted(set(weight_map.values()))
    else:
        weight_map, files = None, sorted(p.name for p in directory.glob("*.safetensors"))
    out = {}
    for name in files:
        path = directory / name
        if not path.is_file():
            raise UserError(f"checkpoint file '{path}' named by {INDEX} is missing; complete the download")
        try:
            header = read_header(path)
        except (OSError, ValueError, UnicodeDecodeError) as exc:
            raise UserError(f"cannot read the safetensors header of '{path}' ({exc}); the file is damaged") from None
        for key, info in header.items():
            if key != "__metadata__" and (weight_map is None or weight_map.get(key) == name):
                out[key] = (name, info)
    return out


def checkpoint_files(directory: Path, tensors: dict) -> dict:
    """{file name: {"sha256", "header_sha256", "size"}} of the files the entries read."""
    directory = Path(directory)
    return {name: {"sha256": file_sha256(directory / name), "header_sha256": header_sha256(directory / name),
                   "size": (directory / name).stat().st_size}
            for name in sorted({f for f, _ in tensors.values()})}


def _conversions(model):
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming

    mapping = get_model_conversion_mapping(model)
    return ([m for m in mapping if isinstance(m, WeightRenaming)], [m for m in mapping if isinstance(m, WeightConverter)])


def _per_expert_cat_dim(converter, spec: str):
    """The dimension one expert's parts are concatenated along, or None for a single part."""
    ops = [(type(op).__name__, getattr(op, "dim", None)) for op in converter.operations]
    if ops == [("MergeModulelist", 0)] and len(converter.source_patterns) == 1:
        return None
    if len(ops) == 2 and ops[0] == ("MergeModulelist", 0) and ops[1][0] == "Concatenate" and ops[1][1] >= 1:
        return ops[1][1] - 1
    raise UserError(f"cannot stream '{spec}': its checkpoint needs the conversion {[name for name, _ in ops]}, which "
                    "moeplan cannot apply one expert at a time")


def _library_names(model, tensors: dict) -> tuple:
    """(plain: library name -> checkpoint name, fused: library name -> (converter, {pattern: {expert: name}}))."""
    from transformers.core_model_loading import apply_renamings, rename_source_key

    renamings, converters = _conversions(model)
    meta = model.state_dict()
    plain, fused = {}, {}
    for key in sorted(tensors):
        lib, pattern = rename_source_key(key, renamings, converters, model.base_model_prefix, meta)
        if lib not in meta and key in meta:
            lib, pattern = key, None
        if lib not in meta:
            continue  # transformers ignores unexpected checkpoint tensors too
        if pattern is None:
            plain[lib] = key
            continue
        converter = next(c for c in converters if pattern in c.source_patterns)
        match = re.search(re.escape(pattern).replace(r"\*", r"(\d+)"), apply_renamings(key, renamings))
        if match is None:
            raise UserError(f"cannot tell which expert checkpoint tensor '{key}' belongs to (pattern {pattern})")
        fused.setdefault(lib, (converter, {}))[1].setdefault(pattern, {})[int(match.group(1))] = key
    return plain, fused


def checkpoint_entries(directory: Path, model, containers: list, spec: str) -> tuple:
    """(entries in shard order, {checkpoint tensor: (file, header)}) for the library `model` (on meta)."""
    directory = Path(directory)
    tensors = checkpoint_tensors(directory)
    scales = fp8_scales(directory, tensors)
    plain, fused = _library_names(model, {k: v for k, v in tensors.items() if k not in scales.values()})
    tied = dict(getattr(model, "all_tied_weights_keys", None) or {})
    per_expert = expert_params(containers)
    entries = []

    def part(key, rows=None, squeeze=False):
        out = {"file": tensors[key][0], "tensor": key, "rows": rows, "squeeze": squeeze}
        if key in scales:
            out["scale"] = {"file": tensors[scales[key]][0], "tensor": scales[key], "block": scales.block}
        return out

    def add(name, lib, lib_shape, first, shape, dtype, parts, cat_dim=None):
        recipe = {"dtype": DTYPE_NAMES[dtype], "shape": list(shape), "cat_dim": cat_dim, "parts": parts}
        entries.append(TensorEntry(name, lib, lib_shape, first, tuple(shape), dtype,
                                   (lambda r=recipe: read_recipe(directory, r)), recipe))

    for lib, t in sorted(model.state_dict().items()):
        shape, dtype = tuple(t.shape), t.dtype
        if dtype not in DTYPE_NAMES:
            raise UserError(f"cannot stream '{spec}': parameter {lib} has dtype {dtype}, which bundles do not store")
        source = plain.get(lib, plain.get(tied.get(lib)))
        if lib in per_expert:
            c, p = per_expert[lib]
            one = expert_shape(shape, c.num_experts)
            if source is not None:  # fused in the checkpoint too: rows of it
                _check_shape(tensors, source, shape, spec)
                rows = per_expert_rows(shape, c.num_experts)
                if source in scales and shape[0] != c.num_experts and scales.block and rows % scales.block[0]:
                    raise UserError(f"cannot stream '{spec}': an expert's {rows} rows of FP8 tensor {source} do not fall on "
                                    f"its {scales.block[0]}-row scale blocks")
                for e in range(c.num_experts):
                    add(f"{c.path}.{e}.{p}", lib, shape, e == 0, one, dtype,
                        [part(source, [e * rows, (e + 1) * rows], squeeze=shape[0] == c.num_experts)])
                continue
            if lib not in fused:
                raise UserError(f"the checkpoint in '{directory}' has no tensors for {lib}; it does not fit the model in its config")
            converter, by_pattern = fused[lib]
            cat_dim = _per_expert_cat_dim(converter, spec)
            for e in range(c.num_experts):
                missing = [pat for pat in converter.source_patterns if e not in by_pattern.get(pat, {})]
                if missing:
                    raise UserError(f"the checkpoint in '{directory}' lacks expert {e} of {lib} ({missing[0]})")
                add(f"{c.path}.{e}.{p}", lib, shape, e == 0, one, dtype,
                    [part(by_pattern[pat][e]) for pat in converter.source_patterns], cat_dim)
            continue
        if source is None:
            what = "a converted tensor" if lib in fused else "no tensor"
            raise UserError(f"the checkpoint in '{directory}' has {what} for {lib}; moeplan streams dense tensors only as "
                            "they are stored (does the checkpoint fit the model in its config?)")
        _check_shape(tensors, source, shape, spec)
        add(lib, lib, shape, True, shape, dtype, [part(source)])
    return entries, tensors


class Scales(dict):
    """FP8 weight name -> its `_scale_inv` tensor's name, and the block [bn, bk] they share (None: per tensor)."""
    block: list | None = None


def fp8_scales(directory: Path, tensors: dict) -> Scales:
    """The FP8 weights of a checkpoint and their scales; an FP8 tensor without a scale is refused."""
    scales = Scales()
    for key, (_, info) in tensors.items():
        if info["dtype"] not in FP8_DTYPES:
            continue
        if key + SCALE_SUFFIX not in tensors:
            raise UserError(f"checkpoint tensor {key} in '{directory}' is stored as {info['dtype']} without a "
                            f"'{key}{SCALE_SUFFIX}' scale; moeplan reads FP8 checkpoints in the fine-grained format "
                            "(weights with block scales), dequantize it first")
        scales[key] = key + SCALE_SUFFIX
    if scales:
        config = Path(directory) / "config.json"
        qconfig = (json.loads(config.read_text()).get("quantization_config") or {}) if config.is_file() else {}
        block = qconfig.get("weight_block_size")
        scales.block = [int(b) for b in block] if block else None
        for key, scale in scales.items():
            _check_scale_grid(directory, key, tensors[key][1]["shape"], tensors[scale][1]["shape"], scales.block)
    return scales


def _check_scale_grid(directory: Path, key: str, shape: list, scale_shape: list, block: list | None) -> None:
    """A scale tensor covers its weight: one scale (per tensor), or one per block of `block` over the last two
    dimensions (leading dimensions, a fused tensor's experts, alike)."""
    if math.prod(scale_shape) == 1:
        return
    grid = None if block is None else [*shape[:-2], -(-shape[-2] // block[0]), -(-shape[-1] // block[1])]
    if list(scale_shape) != grid:
        raise UserError(f"checkpoint tensor {key} in '{directory}' has shape {list(shape)} but its scale has "
                        f"{list(scale_shape)}, not one per {'x'.join(map(str, block)) if block else '(no weight_block_size)'} "
                        "block; the config's quantization_config.weight_block_size does not fit the checkpoint")


def _check_shape(tensors: dict, key: str, shape: tuple, spec: str) -> None:
    stored = tuple(tensors[key][1]["shape"])
    if stored != shape or tensors[key][1]["dtype"] not in DTYPES:  # FP8 ones have their scales (`fp8_scales`)
        raise UserError(f"checkpoint tensor {key} of '{spec}' has shape {list(stored)} ({tensors[key][1]['dtype']}), the "
                        f"model in its config expects {list(shape)}; the checkpoint does not fit its config")
