"""`moeplan codegen plan.json --out DIR [--model MODEL]`: the bundle of a written plan.

A bundle is a function of (plan.json, weights): this runs the plan's target codegen alone (the
target registry, `planner/pipeline/targets.py: codegen_plan`), with
the weights of the model the plan names (`inputs.model`, the spec as given to plan/compile) or
of `--model`, which must hash to the plan's `weights_sha256`. Compiling and planning + codegen
give byte-identical bundles.
"""
from __future__ import annotations

import json
from pathlib import Path

import click

from moeplan.core import progress
from moeplan.planner.commands.options import output_options
from moeplan.core.errors import UserError


def read_plan_file(path: Path):
    from moeplan.core.plan import Plan

    if not path.is_file():
        raise UserError(f"plan file '{path}' does not exist; write one with 'moeplan plan MODEL --trace T --out {path}'")
    try:
        return Plan.from_json(path.read_text(encoding="utf-8"))
    except (ValueError, TypeError, UnicodeDecodeError) as exc:
        raise UserError(f"plan file '{path}' is not a moeplan plan ({exc}); write one with 'moeplan plan'") from None


@click.command("codegen", short_help="Write the bundle of a plan.json (byte-identical to compile's).")
@click.argument("plan_path", metavar="PLAN", type=click.Path(path_type=Path))
@click.option("--model", default=None, help="model whose weights the bundle ships (default: the plan's inputs.model)")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="bundle directory to write")
@output_options
def codegen(plan_path, model, out, as_json, quiet):
    """Write the bundle of PLAN (from 'moeplan plan' or a bundle's plan.json)."""
    from moeplan.planner.pipeline.targets import codegen_plan

    plan = read_plan_file(plan_path)
    model = model or plan.inputs.get("model")
    if not model:
        raise UserError(f"plan file '{plan_path}' names no model; give the model with --model")
    # a pass line per step on a terminal only: piped, codegen prints its one result line, as it always did
    outcome = codegen_plan(plan, str(model), out, quiet=quiet or as_json or not progress.enabled())
    summary = {"out": str(out), "target": plan.target, "files": len(outcome.facts["manifest"]["files"])}
    click.echo(json.dumps(summary, sort_keys=True) if as_json else f"wrote {out}: {plan.target} bundle, {summary['files']} files")
