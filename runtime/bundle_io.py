"""Reading a bundle from the runtime's side: plan, placement, model config and one rank's shard,
and the rank's model built with the library's own code.

A rank's weights are its shard (`shards/rank-N.safetensors`) or, for a bundle compiled with
`--weights reference`, its index (`shards/rank-N.index.json`) into the original checkpoint, read
tensor by tensor from the checkpoint directory ($MOEPLAN_CHECKPOINT, else the path in the plan)
after checking the files' sizes and headers against the plan. A Hugging Face model is built on
`meta` and receives only these tensors, so a rank holds dense weights + its own experts.

Only the standard library, torch, safetensors (and transformers / tokenizers for Hugging Face
models): the bundle is self-contained. The planner's validation (`moeplan run`) checks hashes
before launching; the runtime re-checks what would make ranks disagree (world size, shard
presence, library version) and fails with one line if the launch is wrong.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from .checkpoint_reader import (CheckpointError, check_checkpoint, checkpoint_directory, read_header, read_part,
                                read_reference_shard)
from .ep.expert_table import ExpertTable
from .model.library_model import (ModelError, RankModel, build_tiny_moe, build_transformers, expert_tensor_names,
                                  transformers_top_k)
from .precision import FP8, PRECISION_ENV, device_precision, held_dtypes, torch_dtype
from .text_codec import TextCodec

ARCHITECTURES = ("tiny_moe", "transformers")


class BundleError(Exception):
    """The bundle or its launch does not match: one line for the operator."""


def bundle_root() -> Path:
    return Path(__file__).resolve().parent.parent


def read_json(root: Path, name: str) -> dict:
    path = root / name
    if not path.is_file():
        raise BundleError(f"bundle file '{path}' is missing; re-run 'moeplan compile'")
    return json.loads(path.read_text())


def world_size_of(plan: dict) -> int:
    topo = plan["topology"]
    return int(topo["nodes"]) * int(topo["gpus_per_node"])


def run_modes(plan: dict, requested: str | None = None) -> list:
    """The expert-parallel modes a run serves: `requested` (comma-separated), else the mode the plan
    decided (`communication.mode`). The one default of every way a bundle runs: `moeplan run`,
    `moeplan serve`, launch.sh (with and without --serve), the Kubernetes pods."""
    return (requested or plan.get("communication", {}).get("mode", "coherent")).split(",")


def architecture(plan: dict) -> str:
    name = plan["model"]["architecture"]
    if name not in ARCHITECTURES:
        raise BundleError(f"this runtime runs architectures {list(ARCHITECTURES)}, the plan names '{name}'; recompile the bundle")
    return name


def check_library(plan: dict) -> None:
    """The transformers version the plan was compiled with must be the one installed."""
    pinned = plan["model"].get("library", {}).get("transformers")
    if not pinned:
        return
    import transformers

    if transformers.__version__ != pinned:
        raise BundleError(f"the bundle was compiled with transformers {pinned} but {transformers.__version__} is "
                          f"installed; pip install -r requirements.txt (transformers=={pinned})")


def read_rank_tensors(root: Path, plan: dict, rank: int, full_check: bool = False, keep_fp8=None) -> dict:
    """The tensors of `rank`'s shard or reference index, as stored (dense weights, gates, its experts);
    from a reference index, those `keep_fp8(name)` names as the checkpoint's FP8 values and scales."""
    path = root / plan["shards"][rank]
    if not path.is_file():
        raise BundleError(f"shard '{path}' for rank {rank} is missing; re-run 'moeplan compile'")
    if not path.name.endswith(".index.json"):  # read as the checkpoint is: one tensor, one block at a time
        return {name: read_part(path.parent, {"file": path.name, "tensor": name})
                for name in sorted(read_header(path)) if name != "__metadata__"}
    if not isinstance(plan["model"].get("checkpoint"), dict):
        raise BundleError(f"shard '{path}' is a checkpoint index but plan.json names no checkpoint; recompile the bundle")
    directory = checked_checkpoint_directory(root, plan, full=full_check)
    try:
        return read_reference_shard(directory, path, keep_fp8)
    except CheckpointError as exc:
        raise BundleError(str(exc)) from None


def checked_checkpoint_directory(root: Path, plan: dict, full: bool = False):
    """For a `--weights reference` bundle, where the checkpoint is ($MOEPLAN_CHECKPOINT, else the
    path in the plan) after checking every file's size and header against the plan, and with
    `full` its sha256 (moeplan run does that once before the ranks start); None for a copy bundle."""
    reference = plan["model"].get("checkpoint")
    if not isinstance(reference, dict):
        return None
    try:
        directory = checkpoint_directory(root, reference)
        check_checkpoint(directory, reference, full=full)
    except CheckpointError as exc:
        raise BundleError(str(exc)) from None
    return directory


def check_referenced_checkpoint(root: Path, plan: dict) -> None:
    """Before the ranks start: the referenced checkpoint's full sha256 is the compiled one."""
    checked_checkpoint_directory(root, plan, full=True)


def weight_dtypes(root: Path, plan: dict, device, expert_cache: bool = False) -> dict:
    """{"dense", "experts"}: the dtypes this rank holds the bundle's weights at on `device`
    (`precision.py`: the checkpoint's precision where the device computes at it). The checkpoint's
    dtype is the plan's model description's, else its config's (`dtype`, `torch_dtype`)."""
    ir = plan["model"].get("ir") or {}
    stored = ir.get("dtype")
    if stored is None:
        config = read_json(root, plan["model"]["config"])
        stored = config.get("dtype") or config.get("torch_dtype") or "float32"
    device = torch.device(device)
    return held_dtypes(stored, ir.get("quantization", ""), device.type == "cuda", device_precision(device), expert_cache)


def fp8_block(config: dict) -> tuple:
    """The FP8 block [rows, columns] experts are held in: the checkpoint's `weight_block_size`
    (DeepSeek-V3 and Qwen3 FP8: 128 x 128), that grid where a checkpoint has none."""
    block = (config.get("quantization_config") or {}).get("weight_block_size") or (128, 128)
    return int(block[0]), int(block[1])


def build_rank_model(root: Path, plan: dict, rank: int, table, device) -> tuple:
    """(RankModel with this rank's experts, TextCodec) for a bundle."""
    arch = architecture(plan)
    offload = plan.get("communication", {}).get("expert_cache")  # issue 13: experts stay in the shard until used
    dtypes = weight_dtypes(root, plan, device, expert_cache=bool(offload))
    dtype = torch_dtype(dtypes["dense"])
    local: dict = {}
    for layer, expert in table.experts_on(rank):
        local.setdefault(layer, []).append(expert)
    config_path = root / plan["model"]["config"]
    config = json.loads(config_path.read_text())
    block = fp8_block(config) if dtypes["experts"] == FP8 else None
    if block is not None and arch == "tiny_moe":
        raise BundleError(f"this runtime holds FP8 experts for transformers models only; on this FP8 device set "
                          f"{PRECISION_ENV}=bf16 to hold them at bfloat16")
    keep_fp8 = None
    if arch == "tiny_moe":
        model = build_tiny_moe(config_path, root / plan["model"]["source"]).to(dtype)
        max_positions, vocab, top_k = int(config["max_positions"]), int(config["vocab_size"]), int(config["top_k"])
        codec = TextCodec(None, vocab, native_bytes=True)
    else:
        check_library(plan)
        model = build_transformers(config_path.parent, device="meta", buffers="cpu", dtype=dtype)
        text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        max_positions, vocab = int(getattr(text, "max_position_embeddings", 1 << 30)), int(text.vocab_size)
        top_k = transformers_top_k(text)
        codec = TextCodec(config_path.parent / "tokenizer.json", vocab)
        if block is not None:  # a reference index gives the checkpoint's own FP8 experts and scales
            keep_fp8 = set(expert_tensor_names(model)).__contains__
    weights = None if offload else read_rank_tensors(root, plan, rank, keep_fp8=keep_fp8)  # cast one by one as they load
    if offload:
        from .offload.expert_cache import offloaded_rank_model

        rank_model = offloaded_rank_model(root / plan["shards"][rank], model, arch, offload, rank,
                                          {l: sorted(e) for l, e in local.items()}, max_positions, device,
                                          checkpoint_dir=checked_checkpoint_directory(root, plan))
    else:
        try:
            rank_model = RankModel(model, arch, None, {l: sorted(e) for l, e in local.items()}, weights, max_positions,
                                   fp8_block=block)
        except ModelError as exc:
            raise BundleError(str(exc)) from None
    rank_model.top_k = top_k
    rank_model.weight_dtype = str(dtype).replace("torch.", "")
    rank_model.expert_weight_dtype = dtypes["experts"] if block is not None else rank_model.weight_dtype
    model.to(device)
    return rank_model, codec


def load_bundle(root: Path, rank: int, world: int, device, mode: str | None) -> tuple:
    """(plan, expert table, modes, RankModel, TextCodec) of one bundle for this rank; BundleError
    when the launch does not fit the plan."""
    plan = read_json(root, "plan.json")
    if world != world_size_of(plan):
        raise BundleError(f"launched with {world} ranks but the plan is for {world_size_of(plan)} "
                          f"({plan['topology']['nodes']} nodes x {plan['topology']['gpus_per_node']})")
    table = ExpertTable.from_placement(read_json(root, "placement.json"))
    modes = run_modes(plan, mode)
    model, codec = build_rank_model(root, plan, rank, table, device)
    return plan, table, modes, model, codec
