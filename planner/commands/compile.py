"""`moeplan compile MODEL --trace T [--target NAME] --out DIR`: plan and write a target's bundle.

Every target, its flags and its pass list are in the target registry (`planner/pipeline/targets.py`);
this parses the flags (`options.py`, built from `planner/pipeline/flags.py`) and prints the result.
The bundle appears at --out only when every pass succeeded. `--json` prints a summary object as the
last line.
"""
from __future__ import annotations

import json
from pathlib import Path

import click

from moeplan.planner.commands.options import TargetCommand, flag_values, given_flags, output_options, target_options
from moeplan.planner.pipeline.targets import BUNDLE_TARGETS, DEFAULT_TARGET, TARGETS

EXAMPLES = (
    "moeplan compile examples/tiny_moe --trace t.npz --nodes 2 --gpus-per-node 2 --out bundle/",
    "moeplan compile examples/tiny_moe --trace t.npz --target kubernetes --gpus-per-node 2 --image reg/moe:1 --out k8s/",
    "moeplan compile examples/tiny_moe --trace t.npz --gpus-per-node 2 --expert-cache 12 --out cached/",
    "moeplan compile examples/tiny_moe --trace t.npz --target lambda --slo 5 --out sam/",
    "moeplan compile examples/configs/deepseek-v3.json --trace t.npz --target sglang --nodes 4 --gpus-per-node 8 "
    "--redundant 32 --out sglang/",
)


@click.command("compile", cls=TargetCommand, examples=EXAMPLES, targets={n: TARGETS[n].about for n in BUNDLE_TARGETS},
               short_help="Compile a model and its routing trace into a deployable bundle.")
@click.argument("model")
@click.option("--trace", "trace_path", required=True, help="routing trace (.npz) recorded from MODEL")
@click.option("--target", type=click.Choice(list(BUNDLE_TARGETS)), default=DEFAULT_TARGET, show_default=True,
              help="what to write (Targets above)")
@target_options(compile_only=True)
@click.option("--out", required=True, type=click.Path(file_okay=False), help="bundle directory to write")
@click.option("--report", "with_report", is_flag=True,
              help="also write report.html into the bundle (moeplan report; the manifest lists it)")
@output_options
def compile_cmd(model, trace_path, target, out, as_json, quiet, with_report=False, **_):
    """Compile MODEL with its routing trace into a deployable bundle for --target.

    Each group of options below names the targets it applies to; an option given for another
    target is refused.
    """
    from moeplan.planner.pipeline.targets import compile_target

    ctx = click.get_current_context()
    finish = None
    if with_report:  # issue 31: the bundle's own report.html, listed in its manifest before any signature
        from moeplan.planner.commands.report import write_bundle_report

        finish = lambda bundle: write_bundle_report(Path(bundle), [trace_path])
    outcome = compile_target(target, model, trace_path, out, flag_values(ctx), given_flags(ctx), quiet=quiet or as_json,
                             finish=finish)
    if as_json:
        click.echo(json.dumps(outcome.summary, sort_keys=True))
    elif not quiet:
        click.echo(outcome.describe())
