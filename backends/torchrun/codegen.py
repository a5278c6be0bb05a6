"""Write a torchrun bundle from a Plan, the source weights and the model's own files.

Layout: plan.json, placement.json, launch.sh, README.md, requirements.txt, model/ (config + source
file), runtime/ (copied from moeplan.runtime, `backends/common/files.py`: its top level, model/, ep/
and serving/, the inference service `launch.sh --serve` runs; with expert caches also offload/), shards/rank-NNNNN.safetensors (or, with `--weights
reference`, shards/rank-NNNNN.index.json pointing into the original checkpoint), manifest.json.
Weights arrive as `TensorEntry`s (an in-memory state dict, or a checkpoint read tensor by tensor:
`backends/common/checkpoint_index.py`) and are written in one streaming pass. Every byte is a
function of the inputs (no timestamps, sorted JSON, fixed shard metadata), so compiling twice gives
identical bundles. `write_bundle` builds it in a temporary directory renamed onto the target only
on success (`core/atomic.py: atomic_path`), and writes the manifest once, last.

`codegen_pass(backend)` is the codegen pass of the torchrun and Kubernetes targets: the plan's bundle
written by this `write_bundle` (or `backends/kubernetes/codegen.py`'s: the torchrun bundle plus
manifests), its weights read from the model (`weights_source`: a Hugging Face safetensors
directory is streamed into the shards tensor by tensor, so compile never holds the model's
weights; with `--weights reference` the bundle holds per-rank indexes into the checkpoint).
"""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path


from moeplan.backends.common.templating import template_env
from moeplan.backends.common.model_source import expert_containers, needs_weights, requirements
from moeplan.runtime.model.moe_adapter import expert_owner
from moeplan.backends.common.files import copy_runtime, finish_bundle, write_file
from moeplan.backends.common.shards import entries_sha256, holders, shard_name, write_rank_shards, write_reference_indexes
from moeplan.backends.common.tensor_entries import entries_from_state
from moeplan.core.atomic import atomic_path
from moeplan.core.errors import UserError
from moeplan.core.model_dirs import streamable_directory
from moeplan.core.pass_manager import Pass


def write_weights(out: Path, plan, weights, containers: list) -> str:
    """Each rank's shard (or reference index) from `weights` (a state dict or a list of TensorEntry);
    returns the weights' `state_dict_sha256`."""
    entries = entries_from_state(weights, containers) if isinstance(weights, dict) else weights
    ranks_of = holders(plan.placement, expert_owner(containers))
    if plan.shards and plan.shards[0].endswith(".index.json"):
        write_reference_indexes(out, plan.shards, entries, ranks_of)
        digest = entries_sha256(entries)
    else:
        digest = write_rank_shards(out, plan.shards, entries, ranks_of)
    for rel in plan.shards:
        os.chmod(out / rel, 0o644)
    return digest


def bundle_plan(plan, model_files: dict, checkpoint: dict | None = None):
    """The plan with the bundle's layout filled in: shard names, model files' paths, and for
    `--weights reference` the checkpoint the indexes point into (`write_files` adds the weights' hash)."""
    model = dict(plan.model, config="model/config.json")
    if "model/model.py" in model_files["files"]:
        model["source"] = "model/model.py"
    form = "reference" if checkpoint is not None else "copy"
    if checkpoint is not None:
        model["checkpoint"] = checkpoint
    return dataclasses.replace(plan, model=model, shards=[shard_name(r, form) for r in range(plan.world_size)])


def write_bundle(out, plan, weights, model_files: dict, checkpoint: dict | None = None) -> dict:
    """The torchrun bundle written atomically at `out`; returns its manifest.

    `weights`: the library state dict or `TensorEntry`s streamed from a checkpoint; `model_files`:
    {"architecture", "files": {bundle path: bytes}}; `checkpoint`: the referenced checkpoint
    ({"path", "files"}) for `--weights reference`.
    """
    plan = bundle_plan(plan, model_files, checkpoint)
    with atomic_path(Path(out), kind="bundle") as tmp:
        write_files(tmp, plan, weights, model_files["files"])
        return finish_bundle(tmp)


def write_files(out: Path, plan, weights, model_files: dict):
    """Every file of the bundle but its manifest, into `out` (which must not exist yet); returns the
    plan as written (with `weights_sha256`). The weights must hash to the plan's `weights_sha256`
    when it is set (a bundle regenerated from its plan), else a `UserError`.
    """
    out = Path(out)
    out.mkdir(parents=True)
    arch = plan.model["architecture"]
    placement = plan.placement
    expert_cache = bool(plan.communication.expert_cache)
    digest = write_weights(out, plan, weights, expert_containers(arch, model_files))
    expected = plan.model.get("weights_sha256")
    if expected is not None and expected != digest:
        raise UserError("the weights are not those the plan was made for (weights_sha256 differs); "
                        "give the plan's model with --model or plan again")
    plan = dataclasses.replace(plan, model=dict(plan.model, weights_sha256=digest))
    write_file(out / "plan.json", plan.to_json())
    write_file(out / "placement.json", json.dumps(placement.to_json(), indent=1, sort_keys=True) + "\n")
    for rel, content in sorted(model_files.items()):
        write_file(out / rel, content)
    copy_runtime(out / "runtime", "torchrun", expert_cache=expert_cache)
    write_file(out / "requirements.txt", requirements(arch))
    env = template_env("torchrun")
    topo = plan.topology
    shown = plan.as_written().predicted  # as plan.json holds the figures
    context = {
        "model_name": plan.model["name"], "nodes": int(topo["nodes"]), "gpus_per_node": int(topo["gpus_per_node"]),
        "world_size": plan.world_size, "plan_version": plan.version, "policy": placement.policy or "unknown",
        "mode": plan.communication.mode,
        "gpu_local": _shown(shown.gpu_local_fraction), "node_local": _shown(shown.node_local_fraction),
        "load": _shown(shown.max_over_mean_load),
        "checkpoint": (plan.model.get("checkpoint") or {}).get("path"),
        "has_transformers": arch == "transformers", "has_tokenizer": "model/tokenizer.json" in model_files,
        "has_template": _has_chat_template(model_files),
        "ranks": [
            {"rank": r, "node": r // int(topo["gpus_per_node"]), "shard": plan.shards[r],
             "experts": "; ".join(",".join(str(e) for e in layer["devices"][r]) for layer in placement.layers)}
            for r in range(plan.world_size)
        ],
    }
    write_file(out / "launch.sh", env.get_template("launch.sh.j2").render(**context), executable=True)
    write_file(out / "README.md", env.get_template("README.md.j2").render(**context))
    return plan


def _shown(value):
    return "n/a" if value is None else value


def _has_chat_template(model_files: dict) -> bool:
    """Whether the serving front will find a chat template among the model files (chat_prompt.py)."""
    if "model/chat_template.jinja" in model_files:
        return True
    try:
        config = json.loads(model_files.get("model/tokenizer_config.json", b"{}"))
    except ValueError:
        return False
    return isinstance(config, dict) and bool(config.get("chat_template"))


def weights_source(model_spec: str, loaded, model_files: dict, form: str = "copy") -> tuple:
    """(weights for codegen, referenced checkpoint or None): a Hugging Face safetensors directory is
    streamed (`TensorEntry`s reading one tensor at a time); other models give their state dict."""
    directory = streamable_directory(model_spec) if model_files["architecture"] == "transformers" else None
    if directory is None:
        if form == "reference":
            raise UserError(f"--weights reference needs a Hugging Face model directory with safetensors weights; "
                            f"'{model_spec}' is not one: use --weights copy")
        return loaded.module.state_dict(), None
    from moeplan.backends.common.checkpoint_index import checkpoint_entries, checkpoint_files
    from moeplan.backends.common.model_source import expert_containers

    containers = expert_containers("transformers", model_files["files"], spec=model_spec)
    entries, tensors = checkpoint_entries(directory, loaded.module, containers, model_spec)
    if form != "reference":
        return entries, None
    return entries, {"path": str(directory.resolve()), "files": checkpoint_files(directory, tensors)}


def write_target_bundle(backend: str, out, plan, model_spec: str, loaded, model_files: dict) -> dict:
    """The plan's bundle at `out` by `backends/<backend>/codegen.py` (torchrun, or kubernetes: the
    torchrun bundle plus manifests), its weights read from the model."""
    import importlib

    weights, checkpoint = weights_source(model_spec, loaded, model_files, plan.deployment.get("weights", "copy"))
    writer = write_bundle if backend == "torchrun" else importlib.import_module(f"moeplan.backends.{backend}.codegen").write_bundle
    return writer(out, plan, weights, model_files, checkpoint)


def codegen_pass(backend: str) -> Pass:
    """The codegen pass writing the bundle with `backends/<backend>/codegen.py`."""
    def codegen(facts):
        return {"manifest": write_target_bundle(backend, facts["out"], facts["plan"], facts["model_spec"], facts["model"],
                                         facts["model_files"])}

    return Pass("codegen", ("plan", "model", "model_spec", "model_files", "out"), ("manifest",), codegen, check=needs_weights)
