"""`moeplan report PLAN_OR_BUNDLE [--trace T]... --out report.html`: one self-contained HTML page.

The page (docs/report.md) is a function of plan.json's bytes and the traces' bytes; a bundle is
checked against its manifest first, every file, and refused in one line when one fails. `--trace` may
be the planning trace (recognised by the plan's `inputs.trace_sha256`) and/or one held-out trace,
on which the plan is re-scored beside its predictions. `compile --report` writes the same page
into the bundle (`write_bundle_report`).
"""
from __future__ import annotations

import json
from pathlib import Path

import click

from moeplan.core.errors import UserError

REPORT_NAME = "report.html"


def read_plan_document(path: Path, check: str | None = "bundle") -> tuple:
    """(plan dict, plan.json bytes, plan.json path) of a plan file or a bundle directory.

    A bundle is checked against its manifest first (one line and exit 2 when it fails), as `run` and
    `serve` check it: `check="bundle"` every file's sha256 (a report describes the bundle, shards
    included), `"plan"` plan.json's own (diff reads nothing else), None not at all (`compile --report`,
    writing into the bundle it just made)."""
    plan_path = path / "plan.json" if path.is_dir() else path
    if not plan_path.is_file():
        raise UserError(f"'{path}' is neither a plan file nor a bundle directory with plan.json; "
                        "give what 'moeplan plan' or 'moeplan compile' wrote")
    if path.is_dir() and check is not None:
        _check_bundle(path, whole=check == "bundle")
    data = plan_path.read_bytes()
    try:
        plan = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UserError(f"plan file '{plan_path}' is not JSON ({exc.__class__.__name__}); give a moeplan plan.json") from None
    if not isinstance(plan, dict) or plan.get("version") != 1 or not isinstance(plan.get("target"), str) \
            or not isinstance(plan.get("placement"), dict) or not isinstance(plan.get("predicted"), dict):
        raise UserError(f"plan file '{plan_path}' is not a moeplan plan (version 1 with target, placement, predicted)")
    return plan, data, plan_path


def _check_bundle(bundle: Path, whole: bool) -> None:
    """The bundle's manifest: every file's hash (`whole`) or plan.json's alone; one UserError line."""
    from moeplan.backends.common.manifest import MANIFEST, BundleCheckError, sha256_file, verify_manifest

    try:
        if whole:
            verify_manifest(bundle)
            return
        files = json.loads((bundle / MANIFEST).read_text(encoding="utf-8"))["files"]
        if files.get("plan.json") != sha256_file(bundle / "plan.json"):
            raise BundleCheckError("bundle file 'plan.json' does not match its sha256 in manifest.json (modified or "
                                   "corrupt); recompile the bundle")
    except BundleCheckError as exc:
        raise UserError(f"bundle '{bundle}': {exc}") from None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        raise UserError(f"bundle '{bundle}' has no valid manifest.json; recompile the bundle") from None


def render(plan: dict, data: bytes, plan_path: Path, traces: list) -> str:
    from moeplan.passes.cost.by_predicted_time import TIE
    from moeplan.planner.commands.report_facts import report_facts, sort_traces
    from moeplan.planner.report.build import build_report

    planning, held_out = sort_traces(plan, traces)
    try:
        facts = report_facts(plan, plan_path, planning, held_out, TIE)
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise UserError(f"plan file '{plan_path}' lacks what its report needs ({exc.__class__.__name__}: {exc}); "
                        "regenerate it with this moeplan") from None
    return build_report(plan, data, facts)


def write_bundle_report(bundle: Path, traces: list) -> dict:
    """`compile --report`: the bundle's report.html, then its manifest (and signature) rewritten to list it."""
    from moeplan.backends.common.manifest import write_manifest
    from moeplan.core.atomic import write_text_atomic

    plan, data, plan_path = read_plan_document(bundle, check=None)
    write_text_atomic(bundle / REPORT_NAME, render(plan, data, plan_path, traces), kind="report")
    return write_manifest(bundle)


@click.command("report")
@click.argument("source", metavar="PLAN_OR_BUNDLE", type=click.Path(path_type=Path))
@click.option("--trace", "traces", multiple=True, type=click.Path(dir_okay=False),
              help="the planning trace (for loads, affinity and cache curves) and/or one held-out trace to re-score the "
                   "plan on; may be given twice")
@click.option("--out", required=True, type=click.Path(dir_okay=False), help="HTML file to write")
def report(source, traces, out):
    """Write one self-contained HTML page of a plan: decisions, reasons, predicted figures and their alternatives."""
    from moeplan.core.atomic import atomic_path

    plan, data, plan_path = read_plan_document(source)
    for t in traces:
        if not Path(t).is_file():
            raise UserError(f"trace file '{t}' does not exist; give the routing trace (.npz) the plan was made from or held-out traffic")
    page = render(plan, data, plan_path, list(traces))
    with atomic_path(Path(out), kind="report") as tmp:
        Path(tmp).write_text(page, encoding="utf-8")
    click.echo(f"wrote {out}: {plan.get('target')} report, {len(page.encode('utf-8')):,} bytes")
