"""`moeplan compile MODEL --trace T --target sglang|trtllm`: the command side of the engine targets.

The pass list is `planner/pipeline/engines.py`; this turns the compile flags into its input facts
(placement flags left at their defaults become None, so the pipeline applies the engine defaults:
`eplb`, expert groups from the config) and prints the summary.
"""
from __future__ import annotations

import json

import click

from moeplan.planner.errors import UserError

ENGINE_DEFAULTED = ("policy", "expert_groups")


def compile_engine(model, trace_path, target, nodes, gpus_per_node, placement: dict, kubernetes: bool, image, out,
                   as_json: bool, quiet: bool, ignored: dict) -> None:
    """Run the engine target's passes; `ignored`: flags of other targets, refused when given."""
    from click.core import ParameterSource

    from moeplan.planner.pipeline.engines import engine_summary
    from moeplan.planner.pipeline.targets import run_target

    context = click.get_current_context()
    given = [name for name in ignored if context.get_parameter_source(name) != ParameterSource.DEFAULT]
    if given:
        flags = ", ".join("--" + name.replace("_", "-") for name in given)
        raise UserError(f"{flags}: not used by --target {target}, which writes placement files only; drop them")
    if image is not None and not kubernetes:
        raise UserError("--image applies to --target sglang with --kubernetes (the pods' image)")
    if kubernetes and target != "sglang":
        raise UserError("--kubernetes applies to --target sglang; the torchrun bundle has --target kubernetes")
    if nodes < 1 or gpus_per_node < 1:
        raise UserError(f"--nodes and --gpus-per-node must be at least 1, got {nodes} and {gpus_per_node}")
    placement = {k: (None if k in ENGINE_DEFAULTED and context.get_parameter_source(k) == ParameterSource.DEFAULT else v)
                 for k, v in placement.items()}
    spec = {"name": target}
    if kubernetes:
        from moeplan.backends.sglang.codegen import DEFAULT_IMAGE

        spec.update(kubernetes=True, image=image or DEFAULT_IMAGE)
    facts = {"model_spec": str(model), "trace_path": str(trace_path), "out": str(out),
             "topology": {"nodes": nodes, "gpus_per_node": gpus_per_node}, "placement_options": placement,
             "target": spec}
    facts, timings = run_target(target, facts, quiet=quiet or as_json)
    summary = engine_summary(facts["plan"], out, timings, facts["manifest"])
    if as_json:
        click.echo(json.dumps(summary, sort_keys=True))
    elif not quiet:
        click.echo(f"wrote {out} ({summary['files']} files): {target} placement for {summary['world_size']} EP ranks "
                   f"({summary['policy']}, {summary['redundant']} redundant slots); predicted max/mean rank load "
                   f"{summary['predicted']['max_over_mean_load']:.3f}")
