"""`moeplan compile` as passes: import -> trace -> affinity -> placement -> plan -> codegen.

Each pass is a small function over named facts, run by the PassManager (timed, cached by input
hash, progress per pass). The placement itself is the placement pass of
`passes/optimize/placement/policies.py`; this file only wires it. The codegen pass writes the bundle into
a temporary directory that is renamed onto --out only when everything succeeded.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from moeplan.planner.errors import UserError
from moeplan.planner.pass_manager import Pass, PassManager
from moeplan.planner.plan import Plan


def _import(facts):
    from moeplan.backends.common.model_source import model_files
    from moeplan.planner.importers import load_model

    arch, files = model_files(facts["model_spec"])
    loaded = load_model(facts["model_spec"])
    if loaded.module is None or not loaded.has_weights:
        raise UserError(f"model '{facts['model_spec']}' has no weights to ship; the torchrun target needs a runnable model")
    return {"model": loaded, "model_files": {"architecture": arch, "files": files}}


def _trace(facts):
    from moeplan.passes.analysis.trace.format import load_trace, trace_file_sha256

    path = Path(facts["trace_path"])
    trace = load_trace(path)
    return {"trace": trace, "trace_sha256": trace_file_sha256(path)}


def _affinity(facts):
    from moeplan.passes.analysis.affinity import top1_affinity

    return {"affinity": np.asarray(top1_affinity(facts["trace"]))}


def check_trace_matches(ir, trace, trace_name: str = "the trace") -> None:
    """A trace recorded from another model fails here, before any profiling or solving."""
    moe = ir.moe_stages
    if trace.num_layers != len(moe):
        raise UserError(f"{trace_name} has {trace.num_layers} MoE layers but the model has {len(moe)}; record the trace from this model")
    if trace.num_experts > moe[0].num_experts:
        raise UserError(f"{trace_name} routes to {trace.num_experts} experts but the model has {moe[0].num_experts} per layer")
    if trace.top_k != moe[0].top_k:
        raise UserError(f"{trace_name} records top-{trace.top_k} routing but the model routes each token to "
                        f"top-{moe[0].top_k} experts; record the trace from this model")
    vocab = int(getattr(ir, "vocab_size", 0) or 0)
    if trace.token_ids is not None and vocab > 0 and trace.num_tokens and int(trace.token_ids.max()) >= vocab:
        raise UserError(f"{trace_name} holds token id {int(trace.token_ids.max())} but the model's vocabulary has "
                        f"{vocab} entries; record the trace from this model")


def _placement(facts):
    from moeplan.passes.optimize.placement.decision import Topology

    topo = facts["topology"]
    options = facts["placement_options"]
    return {"placement": run_placement(facts["trace"], Topology(topo["nodes"], topo["gpus_per_node"]), **options)}


def run_placement(trace, topology, **options):
    """The placement pass of passes/optimize/placement/policies.py for the compile flags."""
    from moeplan.passes.optimize.placement.policies import PlacementRequest, plan_placement

    return plan_placement(trace, PlacementRequest(topology=topology, **options))


# Metrics that measure the solve rather than the placement; they would make bundle bytes differ.
NONDETERMINISTIC_METRICS = ("solve_seconds",)


def _plan(facts):
    from moeplan.backends.torchrun.codegen import shard_names
    from moeplan.backends.common.shards import state_dict_sha256
    from moeplan.passes.optimize.placement.metrics import score_placement
    from moeplan.passes.optimize.placement.decision import Topology

    loaded, trace, placement = facts["model"], facts["trace"], facts["placement"]
    check_trace_matches(loaded.ir, trace)
    topo = facts["topology"]
    topology = Topology(topo["nodes"], topo["gpus_per_node"])
    score = score_placement(trace, placement.hosts(), topology).as_dict()
    placement_doc = json.loads(placement.to_json())
    for key in NONDETERMINISTIC_METRICS:
        placement_doc.get("metrics", {}).pop(key, None)
    ir = loaded.ir
    plan = Plan(
        target=facts["target"]["name"],
        model={
            "name": ir.name, "architecture": facts["model_files"]["architecture"],
            "config": "model/config.json", "source": "model/model.py",
            "weights_sha256": state_dict_sha256(loaded.module.state_dict()),
            "moe_layers": len(ir.moe_stages), "num_experts": ir.moe_stages[0].num_experts,
            "top_k": ir.moe_stages[0].top_k, "ir": ir.to_dict(),
        },
        topology={"nodes": topology.nodes, "gpus_per_node": topology.gpus_per_node},
        placement=placement_doc,
        communication={
            "mode": facts["mode"], "gating": "dynamic",
            "layers": [{"layer": l, "all_to_all": "variable-size", "exchanges": (["dispatch", "merge"] if facts["mode"] == "coherent" else ["dispatch", "combine"])}
                       for l in range(len(ir.moe_stages))],
            "attention_state": ("replicated KV cache: every rank computes up to the first MoE router itself, then each "
                                "token's normed hidden state is sent to every rank at every later layer")
                               if facts["mode"] == "coherent" else "owner rank",
        },
        predicted={**score, "inter_layer_top1_affinity": [float(a) for a in facts["affinity"]]},
        shards=shard_names(topology.devices),
        inputs={"trace_sha256": facts["trace_sha256"], "trace_tokens": trace.num_tokens,
                "options": facts["placement_options"]},
    )
    return {"plan": plan}


def _codegen(facts):
    from moeplan.backends.torchrun.codegen import write_bundle
    from moeplan.planner.atomic import atomic_path

    out = Path(facts["out"])
    target = facts["target"]
    with atomic_path(out, kind="bundle") as tmp:
        manifest = write_bundle(tmp, facts["plan"], facts["model"].module.state_dict(), facts["model_files"]["files"])
        if target["name"] == "kubernetes":
            from moeplan.backends.kubernetes.codegen import write_manifests
            from moeplan.backends.common.manifest import write_manifest

            write_manifests(tmp, facts["plan"], image=target["image"], storage_class=target["storage_class"])
            manifest = write_manifest(tmp)
    return {"manifest": manifest}


def compile_passes() -> list:
    return [
        Pass("import", ("model_spec",), ("model", "model_files"), _import),
        Pass("trace", ("trace_path",), ("trace", "trace_sha256"), _trace, cacheable=False),
        Pass("affinity", ("trace",), ("affinity",), _affinity),
        Pass("placement", ("trace", "topology", "placement_options"), ("placement",), _placement),
        Pass("plan", ("model", "model_files", "trace", "trace_sha256", "placement", "topology", "affinity",
                      "placement_options", "mode", "target"), ("plan",), _plan),
        Pass("codegen", ("plan", "model", "model_files", "out", "target"), ("manifest",), _codegen, cacheable=False),
    ]


def compile_bundle(model_spec: str, trace_path: str, nodes: int, gpus_per_node: int, out: str,
                   placement_options: dict, mode: str = "coherent", quiet: bool = False,
                   target: dict | None = None) -> tuple:
    """Run the pipeline; returns (facts, pass timings).

    `target`: {"name": "torchrun"} (default) or {"name": "kubernetes", "image", "storage_class"}:
    the torchrun bundle plus `kubernetes/` manifests that run its launch.sh.
    """
    if nodes < 1 or gpus_per_node < 1:
        raise UserError(f"--nodes and --gpus-per-node must be at least 1, got {nodes} and {gpus_per_node}")
    manager = PassManager(compile_passes(), quiet=quiet)
    facts = manager.run({
        "model_spec": str(model_spec), "trace_path": str(trace_path),
        "topology": {"nodes": nodes, "gpus_per_node": gpus_per_node},
        "placement_options": placement_options, "mode": mode, "out": str(out),
        "target": target or {"name": "torchrun"},
    })
    return facts, manager.timings()
