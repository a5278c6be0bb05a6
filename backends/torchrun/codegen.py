"""Write a torchrun bundle from a Plan, the source weights and the model's own files.

Layout: plan.json, placement.json, launch.sh, README.md, model/ (config + source file),
runtime/ (copied from moeplan.backends.runtime), shards/rank-NNNNN.safetensors, manifest.json.
Every byte is a function of the inputs (no timestamps, sorted JSON, fixed shard metadata), so
compiling twice gives identical bundles. The caller writes into a temporary directory and renames
it on success (`planner.atomic.atomic_path`).
"""
from __future__ import annotations

import json
import os
from pathlib import Path


from moeplan.backends.common.templating import template_env
from moeplan.backends.common.model_source import expert_containers, requirements
from moeplan.backends.runtime.moe_adapter import expert_owner, split_expert_state
from moeplan.backends.common.files import copy_runtime, write_file
from moeplan.backends.common.manifest import write_manifest
from moeplan.backends.common.shards import split_state_dict, write_shard

def shard_layout(arch: str, model_files: dict) -> tuple:
    """(state transform, tensor name -> (MoE layer, expert) or None): per-expert slices apart."""
    containers = expert_containers(arch, model_files)
    return (lambda state: split_expert_state(state, containers)), expert_owner(containers)


def write_bundle(out: Path, plan, state: dict, model_files: dict) -> dict:
    """Write the bundle into `out` (which must not exist yet); returns the manifest."""
    out = Path(out)
    out.mkdir(parents=True)
    arch = plan.model["architecture"]
    transform, owner = shard_layout(arch, model_files)
    placement = plan.placement
    plan_doc = plan.to_json()
    write_file(out / "plan.json", plan_doc)
    write_file(out / "placement.json", json.dumps(placement, indent=1, sort_keys=True) + "\n")
    for rel, content in sorted(model_files.items()):
        write_file(out / rel, content)
    for rank, tensors in enumerate(split_state_dict(transform(state), placement, owner)):
        write_shard(out / plan.shards[rank], tensors, rank)
        os.chmod(out / plan.shards[rank], 0o644)
    copy_runtime(out / "runtime")
    write_file(out / "requirements.txt", requirements(arch))
    env = template_env("torchrun")
    topo = plan.topology
    context = {
        "model_name": plan.model["name"], "nodes": int(topo["nodes"]), "gpus_per_node": int(topo["gpus_per_node"]),
        "world_size": plan.world_size, "plan_version": plan.version, "policy": placement.get("policy", "unknown"),
        "mode": plan.communication["mode"],
        "gpu_local": plan.to_dict()["predicted"].get("gpu_local_fraction", "n/a"),
        "node_local": plan.to_dict()["predicted"].get("node_local_fraction", "n/a"),
        "load": plan.to_dict()["predicted"].get("max_over_mean_load", "n/a"),
        "ranks": [
            {"rank": r, "node": r // int(topo["gpus_per_node"]), "shard": plan.shards[r],
             "experts": "; ".join(",".join(str(e) for e in layer["devices"][r]) for layer in placement["layers"])}
            for r in range(plan.world_size)
        ],
    }
    write_file(out / "launch.sh", env.get_template("launch.sh.j2").render(**context), executable=True)
    write_file(out / "README.md", env.get_template("README.md.j2").render(**context))
    return write_manifest(out)
