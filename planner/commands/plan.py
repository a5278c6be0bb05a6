"""`moeplan plan MODEL --trace T [--target NAME] --out plan.json`: the plan alone.

The same pass list as `moeplan compile --target ...` (the target registry,
`planner/pipeline/targets.py`), asked for the plan only: it stops before codegen, so config-only
(meta) models plan at full size. The plan is written atomically; `moeplan codegen plan.json --out
DIR` turns it into the bundle later. `--target offload` plans one GPU's expert cache (no bundle
yet). Prints the headline predictions (lambda: the sizing per layer); `--json` prints the summary
as one JSON line.
"""
from __future__ import annotations

import json

import click

from moeplan.planner.commands.options import TargetCommand, flag_values, given_flags, output_options, target_options
from moeplan.planner.pipeline.targets import DEFAULT_TARGET, TARGETS

EXAMPLES = (
    "moeplan plan examples/configs/mixtral-8x7b.json --trace t.npz --nodes 2 --gpus-per-node 4 --hardware a100-sxm "
    "--out plan.json",
    "moeplan plan examples/tiny_moe --trace t.npz --target lambda --slo 5 --out plan.json",
    "moeplan plan examples/tiny_moe --trace t.npz --target offload --expert-cache 40 --out plan.json",
    "moeplan codegen plan.json --out bundle/",
)


@click.command("plan", cls=TargetCommand, examples=EXAMPLES, targets={n: t.about for n, t in TARGETS.items()},
               short_help="Plan a deployment and write plan.json (no bundle).")
@click.argument("model")
@click.option("--trace", "trace_path", required=True, help="routing trace (.npz) recorded from MODEL (lambda: with token ids)")
@click.option("--target", type=click.Choice(list(TARGETS)), default=DEFAULT_TARGET, show_default=True,
              help="what to plan for (Targets above)")
@target_options(compile_only=False)
@click.option("--out", required=True, type=click.Path(dir_okay=False), help="plan.json to write")
@output_options
def plan(model, trace_path, target, out, as_json, quiet, **_):
    """Plan MODEL's deployment for --target and write plan.json (no bundle)."""
    from moeplan.planner.pipeline.targets import plan_target

    ctx = click.get_current_context()
    outcome = plan_target(target, model, trace_path, out, flag_values(ctx), given_flags(ctx), quiet=quiet or as_json)
    if as_json:
        click.echo(json.dumps(outcome.summary, sort_keys=True))
    elif not quiet:
        click.echo(outcome.describe())
