"""Reading tensors straight out of a safetensors checkpoint, one tensor (or one expert) at a time.

A *recipe* says how one bundle tensor is made from the checkpoint: a list of parts, each a tensor
of one checkpoint file, optionally cut to rows [start, stop) of its first dimension (one expert of
a fused [E, ...] tensor, or of DBRX's flattened [E * r, D]) and squeezed; several parts are
concatenated along `cat_dim` (transformers' MergeModulelist + Concatenate for per-expert
checkpoints, e.g. Mixtral's w1 and w3 into gate_up_proj), then cast to `dtype`. A part stored as FP8
carries its `scale` (the `<name>_scale_inv` tensor and the config's block) and is dequantized as it
is read (`fp8_blocks.py`), so bundles hold the weights at the precision the runtime computes at:

    {"dtype": "F32", "shape": [2I, D], "cat_dim": 0,
     "parts": [{"file": "model-00001-of-00002.safetensors", "tensor": "...experts.3.w1.weight",
                "rows": null, "squeeze": false}, ...]}

Compile uses recipes to stream a checkpoint into per-rank shards (`--weights copy`); ranks use
them to read only their own tensors from the original checkpoint (`--weights reference`). Every
read opens the file, reads the slice with safetensors' `get_slice` and closes it again, so no
mapping of a whole file stays resident; an expert cache's store, which reads one expert per miss
for the whole run, keeps its files open instead (`OpenFiles`). Runtime code: torch and safetensors only.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import struct
from pathlib import Path

import torch
from safetensors import safe_open

from .fp8_blocks import FP8_DTYPES, SCALE_SUFFIX, dequantize

DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
          "I64": torch.int64, "I32": torch.int32, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool, **FP8_DTYPES}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
CHECKPOINT_ENV = "MOEPLAN_CHECKPOINT"
CHUNK_BYTES = 32 << 20


class CheckpointError(Exception):
    """A referenced checkpoint is missing or not the one the bundle was compiled from: one line."""


def read_header(path: Path) -> dict:
    """The JSON header of a safetensors file (tensor name -> dtype, shape, data_offsets)."""
    with open(path, "rb") as fh:
        size = struct.unpack("<Q", fh.read(8))[0]
        return json.loads(fh.read(size))


def header_sha256(path: Path) -> str:
    """sha256 of a safetensors file's length prefix and header: cheap, and changes with any layout change."""
    with open(path, "rb") as fh:
        prefix = fh.read(8)
        return hashlib.sha256(prefix + fh.read(struct.unpack("<Q", prefix)[0])).hexdigest()


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 24), b""):
            h.update(block)
    return h.hexdigest()


class OpenFiles:
    """Checkpoint files kept open across reads (`safe_open` handles by file name), for a reader that
    reads many small slices (an expert cache's store): each read then costs no header parse.
    Without one, every block opens and closes its file (see `read_part`)."""

    def __init__(self, directory: Path):
        self.directory, self.handles = Path(directory), {}

    def __call__(self, name: str):
        if name not in self.handles:
            self.handles[name] = safe_open(str(self.directory / name), framework="pt")
        return contextlib.nullcontext(self.handles[name])


def _opener(directory: Path, files: OpenFiles | None):
    """file name -> a context manager giving an open handle: `files`' own, or a fresh one."""
    return files if files is not None else (lambda name: safe_open(str(Path(directory) / name), framework="pt"))


def _part_layout(directory: Path, part: dict, files: OpenFiles | None = None) -> tuple:
    """(file path, first row, stop row, stored shape, stored dtype, shape the part yields), from the header."""
    path = str(Path(directory) / part["file"])
    with _opener(directory, files)(part["file"]) as fh:
        view = fh.get_slice(part["tensor"])
        shape, dtype = list(view.get_shape()), DTYPES[view.get_dtype()]
    if not shape:
        return path, 0, 0, shape, dtype, []
    start, stop = (0, shape[0]) if part.get("rows") is None else (int(part["rows"][0]), int(part["rows"][1]))
    yields = shape[1:] if part.get("squeeze") else [stop - start, *shape[1:]]
    return path, start, stop, shape, dtype, yields


def read_part(directory: Path, part: dict, out: torch.Tensor | None = None, files: OpenFiles | None = None) -> torch.Tensor:
    """One part of a recipe (a checkpoint tensor, or rows [start, stop) of its first dimension),
    written into `out` (any view of the part's shape; cast to its dtype) or into a new tensor.

    Read in blocks of at most CHUNK_BYTES, the file opened for each block (unless `files` keeps it
    open): safetensors maps the file, and the pages a read touches count as this process's memory
    until the mapping closes, so a big tensor read in one go would cost twice its size at the peak.
    """
    _, start, stop, shape, dtype, yields = _part_layout(directory, part, files)
    if part.get("scale") is not None:
        out = torch.empty(yields, dtype=torch.float32) if out is None else out
        return _read_fp8_part(part, out, _opener(directory, files), start, stop, shape)
    out = torch.empty(yields, dtype=dtype) if out is None else out
    opener = _opener(directory, files)
    if not shape:
        with opener(part["file"]) as fh:
            return out.copy_(fh.get_tensor(part["tensor"]))
    dest = out.unsqueeze(0) if part.get("squeeze") else out
    step = max(1, CHUNK_BYTES // max(1, math.prod(shape[1:]) * dtype.itemsize))
    for a in range(start, stop, step):
        b = min(stop, a + step)
        with opener(part["file"]) as fh:
            dest[a - start:b - start] = fh.get_slice(part["tensor"])[a:b]
    return out


def _read_scale(part: dict, opener, start: int, stop: int, shape: list) -> torch.Tensor:
    """An FP8 part's scales, whole (one value per block: small); a fused [E, N, K]'s rows [start, stop) of [E, ...]."""
    with opener(part["scale"]["file"]) as fh:
        s = fh.get_slice(part["scale"]["tensor"])
        return s[start:stop] if len(shape) == 3 and len(s.get_shape()) == 3 else s[:]


def _read_fp8_part(part: dict, out: torch.Tensor, opener, start: int, stop: int, shape: list) -> torch.Tensor:
    """An FP8 part dequantized into `out` (cast as it is copied): a 2-D weight in runs of whole
    scale blocks of at most about CHUNK_BYTES at float32; one expert of a fused [E, N, K] with its
    scales' rows [start, stop) of [E, ...]."""
    block = part["scale"].get("block")
    dest = out.unsqueeze(0) if part.get("squeeze") else out
    s = _read_scale(part, opener, start, stop, shape)
    if len(shape) != 2 or block is None:
        with opener(part["file"]) as fh:
            q = fh.get_slice(part["tensor"])[start:stop]
        dest.copy_(dequantize(q, s, block))
        return out
    rows = int(block[0])
    if start % rows:
        raise CheckpointError(f"rows {start}:{stop} of FP8 tensor {part['tensor']} do not start at a scale block "
                              f"({rows} rows); recompile the bundle against this checkpoint")
    step = max(rows, CHUNK_BYTES // max(1, shape[1] * 4) // rows * rows)
    for a in range(start, stop, step):
        b = min(stop, a + step)
        with opener(part["file"]) as fh:
            q = fh.get_slice(part["tensor"])[a:b]
        dest[a - start:b - start] = dequantize(q, s[a // rows:-(-b // rows)], block)
    return out


def read_recipe(directory: Path, recipe: dict, files: OpenFiles | None = None) -> torch.Tensor:
    """The bundle tensor a recipe describes, in the recipe's dtype and shape: each part is read
    straight into its place along `cat_dim` (no concatenated copy); `files`: handles kept open."""
    out = torch.empty(recipe["shape"], dtype=DTYPES[recipe["dtype"]])
    dim, offset = int(recipe.get("cat_dim") or 0), 0
    for part in recipe["parts"]:
        yields = _part_layout(directory, part, files)[5]
        size = yields[dim] if yields else 0
        if (len(yields) != out.dim() or any(y != o for i, (y, o) in enumerate(zip(yields, out.shape)) if i != dim)
                or offset + size > (out.shape[dim] if out.dim() else 0)):
            raise CheckpointError(f"checkpoint tensor {part['tensor']} gives shape {yields}, the bundle expects "
                                  f"{list(recipe['shape'])}; recompile the bundle against this checkpoint")
        read_part(directory, part, out.narrow(dim, offset, size) if out.dim() else out, files)
        offset += size
    if out.dim() and offset != out.shape[dim]:
        raise CheckpointError(f"checkpoint tensors {[p['tensor'] for p in recipe['parts']]} fill {offset} of "
                              f"{out.shape[dim]} rows of a bundle tensor; recompile the bundle against this checkpoint")
    return out


def checkpoint_directory(root: Path, reference: dict) -> Path:
    """Where the referenced checkpoint is: $MOEPLAN_CHECKPOINT if set (a mounted volume), else the
    path recorded at compile time (relative paths are relative to the bundle)."""
    env = os.environ.get(CHECKPOINT_ENV)
    path = Path(env) if env else Path(reference["path"])
    return path if path.is_absolute() else Path(root) / path


def check_checkpoint(directory: Path, reference: dict, full: bool) -> None:
    """Refuse a checkpoint whose files differ from those compiled against: sizes and headers always,
    the full sha256 of every file when `full` (moeplan run does that once before launching)."""
    for name, expected in sorted(reference["files"].items()):
        path = Path(directory) / name
        if not path.is_file():
            raise CheckpointError(f"checkpoint file '{path}' referenced by the bundle is missing; mount the checkpoint "
                                  f"there or set {CHECKPOINT_ENV} to its directory")
        if (path.stat().st_size != expected["size"] or header_sha256(path) != expected["header_sha256"]
                or (full and file_sha256(path) != expected["sha256"])):
            raise CheckpointError(f"checkpoint file '{path}' is not the one the bundle was compiled from (sha256 "
                                  "differs); restore it or recompile the bundle with --weights reference")


def read_recipe_fp8(directory: Path, recipe: dict) -> tuple | None:
    """(FP8 values, their block scales) of a recipe whose every part is FP8 on one block grid, its parts
    joined along `cat_dim` on block boundaries: the checkpoint's own bytes and scales; None where that
    does not hold (then `read_recipe` dequantizes)."""
    parts = recipe["parts"]
    blocks = {tuple(p["scale"]["block"]) if p.get("scale") and p["scale"].get("block") else None for p in parts}
    if len(blocks) != 1 or None in blocks or len(recipe["shape"]) != 2:
        return None
    block, dim = next(iter(blocks)), int(recipe.get("cat_dim") or 0)
    opener = _opener(directory, None)
    qs, ss = [], []
    for part in parts:
        _, start, stop, shape, _, yields = _part_layout(directory, part)
        if len(yields) != 2 or (len(shape) == 2 and part.get("rows") is not None) \
                or (len(parts) > 1 and yields[dim] % block[dim]):
            return None
        with opener(part["file"]) as fh:
            qs.append(fh.get_slice(part["tensor"])[start:stop].reshape(yields))
        s = _read_scale(part, opener, start, stop, shape)
        ss.append(s.reshape(s.shape[-2:]))
    if len({s.dtype for s in ss}) != 1:
        return None
    q = torch.cat(qs, dim)
    return (q, torch.cat(ss, dim)) if list(q.shape) == list(recipe["shape"]) else None


def read_reference_shard(directory: Path, index_path: Path, keep_fp8=None) -> dict:
    """{bundle tensor name: tensor} of one rank's reference index, read from the checkpoint; tensors
    `keep_fp8(name)` names stay FP8 where the checkpoint stores them so, beside `<name>_scale_inv`."""
    index = json.loads(Path(index_path).read_text())
    out = {}
    for name, recipe in sorted(index["tensors"].items()):
        pair = read_recipe_fp8(directory, recipe) if keep_fp8 is not None and keep_fp8(name) else None
        if pair is None:
            out[name] = read_recipe(directory, recipe)
        else:
            out[name], out[name + SCALE_SUFFIX] = pair
    return out
