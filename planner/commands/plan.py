"""`moeplan plan MODEL --trace T --target lambda|torchrun|kubernetes --out plan.json`: the plan alone.

The same pass list as `moeplan compile --target ...`, asked for the plan only: it stops before
codegen and skips what only codegen needs, so config-only (meta) models plan at full size. The
plan is written atomically; `moeplan codegen plan.json --out DIR` turns it into the bundle later.
Lambda: profile operators (cached by model hash), predict per-expert loads from the trace's token
ids, optionally refine by BO, size every expert function (MILP + ODS), partition the dense stages.
Prints cost, throughput and per-layer decisions; `--json` prints the summary as one JSON line.
"""
from __future__ import annotations

import json

import click

from moeplan.planner.commands.compile import describe, pipeline_inputs, summary_of
from moeplan.planner.commands.plan_offload import OFFLOAD_FLAGS, offload_options, offload_request, plan_offload_command
from moeplan.planner.commands.options import (PLACEMENT_FLAGS, SERVERLESS_FLAGS, auto_placement_options, cost_options,
                                               kubernetes_options, output_options, pop, serverless_options,
                                               topology_options)


@click.command("plan")
@click.argument("model")
@click.option("--trace", "trace_path", required=True, help="routing trace (.npz) recorded from MODEL (lambda: with token ids)")
@click.option("--target", type=click.Choice(["lambda", "torchrun", "kubernetes", "offload"]), default="lambda", show_default=True)
@topology_options(required=False)
@auto_placement_options
@cost_options
@kubernetes_options
@serverless_options
@click.option("--out", required=True, type=click.Path(dir_okay=False), help="plan.json to write")
@offload_options
@output_options
def plan(model, trace_path, target, nodes, gpus_per_node, mode, image, storage_class, out, as_json, quiet, hardware,
         workload, **flags):
    """Plan MODEL's deployment for a target and write plan.json (no bundle)."""
    offload = pop(flags, OFFLOAD_FLAGS)
    if target == "offload":  # one GPU whose experts do not all fit: passes/optimize/offload/
        return plan_offload_command(model, trace_path, out, flags["validation_fraction"], flags["seed"], as_json, quiet,
                                    hardware=hardware, **offload)
    from moeplan.planner.atomic import write_text_atomic
    from moeplan.planner.pipeline.targets import run_target

    say = (lambda msg: None) if quiet or as_json else (lambda msg: click.echo(msg, err=True))
    cache = offload_request(offload, flags["validation_fraction"], flags["seed"], target=target) if target != "lambda" else None
    facts = pipeline_inputs(model, trace_path, target, nodes, gpus_per_node, mode, image, storage_class,
                            pop(flags, PLACEMENT_FLAGS), pop(flags, SERVERLESS_FLAGS), None, say,
                            {"hardware": hardware, "workload": workload}, cache)
    facts, timings = run_target(target, facts, plan_only=True, quiet=quiet or as_json)
    the_plan = facts["plan"]
    write_text_atomic(out, the_plan.to_json(), kind="plan")
    summary = summary_of(the_plan, out, timings)
    if target == "lambda":
        summary["bo_iterations"] = facts["sizing"].bo["iterations"] if facts["sizing"].bo else 0
    if as_json:
        click.echo(json.dumps(summary, sort_keys=True))
        return
    if quiet:
        return
    click.echo(describe(summary))
    if target == "lambda":
        from moeplan.planner.commands.simulate import print_layers

        print_layers(facts["sizing"].result.layers)
        click.echo("predictor error (tokens per expert): " + ", ".join(f"{k} {v:.1f}" for k, v in summary["predictor_error"].items()))
        profile_s = sum(t["seconds"] for t in timings if t["pass"] == "profile")
        click.echo(f"planning took {sum(t['seconds'] for t in timings):.1f} s (profile {profile_s:.1f} s"
                   f"{', cached' if facts['profile'].cached else ''})")
