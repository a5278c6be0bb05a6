"""`moeplan diff A B [--json] [--all] [--fail-on EXPR]`: what changed between two plans (or bundles).

Compact by default: the decisions that differ (the placement as one line: how many MoE layers
moved), then the headline figures (`figures.py` aliases: time and bytes per token, balance,
locality, cost, hit ratio, serving), changed ones first with B / A, each figure once (a path an
alias names is not listed again), under what they are for (workload, hardware, trace), and a count
of the other predicted numbers that changed (`--all` lists them, `--json` has every one). A
decision or figure that one plan does not record (a plan file has no `weights_sha256` before
codegen; a --policy auto plan has candidates) is not a change: it is named once, as recorded by
one side only. With `--fail-on` (planner/report/fail_on.py) exits 1 when B crosses a threshold
against A, so a CI job can ask "is this plan worse than the one on main?". A bad expression is one
line and exit 2.
"""
from __future__ import annotations

import json
import math
import sys

import click

from moeplan.core.errors import UserError


def _numeric(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def compare(a: dict, b: dict) -> dict:
    """{"decisions": [{name, a, b}] changed, "placement": {layers, moved} or None, "headline": [{name, a, b,
    ratio, changed}] changed first, "figures": [{name, a, b, ratio}] every changed number once,
    "one_side": [{name, side}] recorded by one plan only, "basis": {a, b}}."""
    from moeplan.planner.report.figures import alias_paths, basis, decisions, figures

    da, db = decisions(a), decisions(b)
    fa, fb = figures(a), figures(b)
    pa, pb = alias_paths(a), alias_paths(b)
    one_side = [{"name": k, "side": "A" if k in da else "B"} for k in _ordered(da, db) if (k in da) != (k in db)]
    layer_keys = [k for k in _ordered(da, db) if k.startswith("placement.layer.")]
    changed = [{"name": k, "a": da[k], "b": db[k]} for k in _ordered(da, db)
               if k in da and k in db and da[k] != db[k] and k not in layer_keys and k != "placement.layout"]
    moved = [k for k in layer_keys if k in da and k in db and da[k] != db[k]]
    placement = None
    if moved or da.get("placement.layout") != db.get("placement.layout") and "placement.layout" in da and "placement.layout" in db:
        placement = {"layers": sum(1 for k in layer_keys if k in da and k in db), "moved": len(moved),
                     "a": da.get("placement.layout"), "b": db.get("placement.layout")}
    headline = []
    for k in _ordered(pa, pb):
        x, y = fa.get(k), fb.get(k)
        if x is None or y is None:
            continue
        headline.append({"name": k, "a": x, "b": y, "ratio": _ratio(x, y), "changed": x != y})
    headline.sort(key=lambda r: not r["changed"])  # changed first, each group in alias order
    aliased = {p for k, p in pa.items() if pb.get(k) == p}  # the same path under the same alias in both
    moved_figures = []
    for k in _ordered(fa, fb):
        if k in pa or k in pb or k in aliased:
            continue
        x, y = fa.get(k), fb.get(k)
        if x is None or y is None:
            one_side.append({"name": k, "side": "A" if y is None else "B"})
        elif x != y:
            moved_figures.append({"name": k, "a": x, "b": y, "ratio": _ratio(x, y)})
    return {"decisions": changed, "placement": placement, "headline": headline, "figures": moved_figures,
            "one_side": one_side, "basis": {"a": basis(a), "b": basis(b)}}


def _ratio(x, y):
    return (y / x) if _numeric(x) and _numeric(y) and x != 0 else None


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
@click.option("--json", "as_json", is_flag=True, help="print one JSON object (every changed number)")
@click.option("--all", "show_all", is_flag=True, help="also list every other predicted number that changed")
@click.option("--fail-on", "fail_on", default=None, metavar="EXPR",
              help="exit 1 when B crosses a threshold against A, e.g. 'seconds_per_token>+5%,cost>+0%,hit_ratio<-0.01' "
                   "(a time, bytes or cost needs % or a unit: +2ms, +1KB, +0.0001usd)")
def diff(a, b, as_json, show_all, fail_on):
    """Compare plan (or bundle) B with plan A: changed decisions, then the headline figures with B / A."""
    from pathlib import Path

    from moeplan.planner.commands.report import read_plan_document
    from moeplan.planner.report.fail_on import FailOnError, parse

    try:
        checks = parse(fail_on) if fail_on is not None else []
    except FailOnError as exc:
        raise UserError(str(exc)) from None
    plan_a, _, _ = read_plan_document(Path(a), check="plan")
    plan_b, _, _ = read_plan_document(Path(b), check="plan")
    result = compare(plan_a, plan_b)
    result["fail_on"] = evaluate(checks, plan_a, plan_b)
    result["crossed"] = any(r["crossed"] for r in result["fail_on"])
    if as_json:
        click.echo(json.dumps(result, sort_keys=True))
    else:
        _print(result, a, b, show_all)
    if result["crossed"]:
        sys.exit(1)


def _print(result: dict, a, b, show_all: bool) -> None:
    changed_any = result["decisions"] or result["placement"] or any(r["changed"] for r in result["headline"]) \
        or result["figures"]
    basis = result["basis"]
    if basis["a"] == basis["b"]:
        click.echo(f"figures for {basis['a']} (both)")
    else:
        click.echo(f"figures for A: {basis['a']}; B: {basis['b']} (a time figure depends on its workload and hardware)")
    if not changed_any:
        click.echo(f"no decision or predicted figure differs between {a} and {b}")
    rows = [(r["name"], _fmt(r["a"]), _fmt(r["b"])) for r in result["decisions"]]
    p = result["placement"]
    if p is not None:
        rows.append(("placement (layout digest)", str(p["a"]), f"{p['b']} ({p['moved']} of {p['layers']} MoE layers moved)"))
    if rows:
        width = max(24, *(len(r[0]) for r in rows))
        click.echo(f"{'decision':<{width}}  {'A':<24}  B")
        for name, x, y in rows:
            click.echo(f"{name:<{width}}  {x:<24}  {y}")
    lines = [r for r in result["headline"] if r["changed"]] + (list(result["figures"]) if show_all else [])
    if lines:
        width = max(24, *(len(r["name"]) for r in lines))
        click.echo(f"{'figure':<{width}}  {'A':>14}  {'B':>14}  {'B / A':>8}")
        for r in lines:
            ratio = f"{r['ratio']:.4f}" if r["ratio"] is not None else "-"
            click.echo(f"{r['name']:<{width}}  {_fmt(r['a']):>14}  {_fmt(r['b']):>14}  {ratio:>8}")
    same = [r for r in result["headline"] if not r["changed"]]
    if same:
        click.echo("unchanged: " + ", ".join(f"{r['name']} {_fmt(r['a'])}" for r in same))
    if result["figures"] and not show_all:
        click.echo(f"{len(result['figures'])} other predicted number(s) changed (--all lists them, --json has every one)")
    if result["one_side"]:
        only = {side: [r["name"] for r in result["one_side"] if r["side"] == side] for side in ("A", "B")}
        click.echo("recorded by one plan only (not compared): " + "; ".join(
            f"{side}: {_names(names)}" for side, names in only.items() if names))
    for r in result["fail_on"]:
        state = "CROSSED" if r["crossed"] else r.get("note", "ok")
        click.echo(f"fail-on {r['check']}: A {_fmt(r['a'])}, B {_fmt(r['b'])}: {state}")


def _names(names: list, shown: int = 4) -> str:
    """Names grouped by table ('predicted.cost.alternatives[*] (23 numbers)'), a few shown and how many more."""
    groups = {}
    for name in names:
        key = name.split("[", 1)[0] + "[*]" if "[" in name else name
        groups[key] = groups.get(key, 0) + 1
    parts = [k if n == 1 else f"{k} ({n} numbers)" for k, n in groups.items()]
    return ", ".join(parts[:shown]) + (f" and {len(parts) - shown} more" if len(parts) > shown else "")
