"""`moeplan diff A B [--json] [--fail-on EXPR]`: what changed between two plans (or bundles).

Prints every decision that differs and every predicted figure that changed, with B / A; with
`--fail-on` (planner/report/fail_on.py) exits 1 when B crosses a threshold against A, so a CI job
can ask "is this plan worse than the one on main?". A bad expression is one line and exit 2.
"""
from __future__ import annotations

import json
import math
import sys

import click

from moeplan.core.errors import UserError


def compare(a: dict, b: dict) -> dict:
    """{"decisions": [{name, a, b}], "figures": [{name, a, b, ratio}]} of what differs."""
    from moeplan.planner.report.figures import decisions, figures

    da, db = decisions(a), decisions(b)
    fa, fb = figures(a), figures(b)
    changed = [{"name": k, "a": da.get(k), "b": db.get(k)} for k in _ordered(da, db) if da.get(k) != db.get(k)]
    moved = []
    for k in _ordered(fa, fb):
        x, y = fa.get(k), fb.get(k)
        if x == y:
            continue
        ratio = (y / x) if isinstance(x, (int, float)) and isinstance(y, (int, float)) and x != 0 else None
        moved.append({"name": k, "a": x, "b": y, "ratio": ratio})
    return {"decisions": changed, "figures": moved}


def _ordered(x: dict, y: dict) -> list:
    return list(x) + [k for k in y if k not in x]


def evaluate(checks: list, a: dict, b: dict) -> list:
    """[{check, name, a, b, change, crossed}] per check; a name neither plan has is a usage error."""
    from moeplan.planner.report.figures import ALIASES, figures

    fa, fb = figures(a), figures(b)
    out = []
    for c in checks:
        if c.name in ALIASES and c.name not in fa and c.name not in fb:  # e.g. cost on a torchrun plan: one gate for every target
            out.append({"check": c.text, "name": c.name, "a": None, "b": None, "change": None, "crossed": False,
                        "note": "neither plan has this figure"})
            continue
        if c.name not in fa and c.name not in fb:
            known = ", ".join(ALIASES)
            raise UserError(f"--fail-on: '{c.name}' is not a figure of these plans; use one of {known} or a path "
                            "under predicted (moeplan diff --json lists them)")
        x, y = fa.get(c.name), fb.get(c.name)
        crossed = x is not None and y is not None and c.crossed(x, y)
        out.append({"check": c.text, "name": c.name, "a": x, "b": y,
                    "change": None if x is None or y is None else c.change(x, y), "crossed": crossed})
    return out


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.6g}" if math.isfinite(v) else str(v)
    return "-" if v is None else str(v)


@click.command("diff")
@click.argument("a", metavar="A", type=click.Path())
@click.argument("b", metavar="B", type=click.Path())
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
@click.option("--fail-on", "fail_on", default=None, metavar="EXPR",
              help="exit 1 when B crosses a threshold against A, e.g. 'seconds_per_token>+5%,cost>+0%,hit_ratio<-0.01'")
def diff(a, b, as_json, fail_on):
    """Compare plan (or bundle) B with plan A: changed decisions and predicted figures, B / A."""
    from pathlib import Path

    from moeplan.planner.commands.report import read_plan_document
    from moeplan.planner.report.fail_on import FailOnError, parse

    try:
        checks = parse(fail_on) if fail_on is not None else []
    except FailOnError as exc:
        raise UserError(str(exc)) from None
    plan_a, _, _ = read_plan_document(Path(a))
    plan_b, _, _ = read_plan_document(Path(b))
    result = compare(plan_a, plan_b)
    result["fail_on"] = evaluate(checks, plan_a, plan_b)
    result["crossed"] = any(r["crossed"] for r in result["fail_on"])
    if as_json:
        click.echo(json.dumps(result, sort_keys=True))
    else:
        _print(result, a, b)
    if result["crossed"]:
        sys.exit(1)


def _print(result: dict, a, b) -> None:
    if not result["decisions"] and not result["figures"]:
        click.echo(f"no decision or predicted figure differs between {a} and {b}")
    if result["decisions"]:
        click.echo(f"{'decision':<36}  {'A':<24}  B")
        for r in result["decisions"]:
            click.echo(f"{r['name']:<36}  {_fmt(r['a']):<24}  {_fmt(r['b'])}")
    if result["figures"]:
        if result["decisions"]:
            click.echo("")
        click.echo(f"{'predicted figure':<60}  {'A':>14}  {'B':>14}  {'B / A':>8}")
        for r in result["figures"]:
            ratio = f"{r['ratio']:.4f}" if r["ratio"] is not None else "-"
            click.echo(f"{r['name']:<60}  {_fmt(r['a']):>14}  {_fmt(r['b']):>14}  {ratio:>8}")
    for r in result["fail_on"]:
        state = "CROSSED" if r["crossed"] else r.get("note", "ok")
        click.echo(f"fail-on {r['check']}: A {_fmt(r['a'])}, B {_fmt(r['b'])}: {state}")
