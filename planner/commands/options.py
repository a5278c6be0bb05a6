"""The click side of the flags: options built from `planner/pipeline/flags.py`, and help by target.

`target_options` adds every flag of `plan`/`compile` (one definition each, in the flag table);
`TargetCommand` prints them in sections, one per flag group with the targets it serves, and the
command's examples. `placement_options` and `topology_options` give `place` the same placement
flags (its own policy list and required topology). `given_flags` names the flags a user typed,
which the target registry refuses when they do not apply.
"""
from __future__ import annotations

import click
from click.core import ParameterSource

from moeplan.planner.pipeline import flags as F


def _apply(options, f):
    for option in reversed(options):
        f = option(f)
    return f


def click_option(flag: F.Flag, **overrides):
    """The click option of a flag (overrides: click.option keywords)."""
    kwargs = dict(default=flag.default, help=flag.help, show_default=flag.show_default)
    if flag.is_flag:
        kwargs["is_flag"] = True
    elif flag.type is not None:
        kwargs["type"] = flag.type
    kwargs.update(overrides)
    return click.option(flag.option, flag.name, **kwargs)


def target_options(compile_only: bool):
    """Every flag of the targets (those marked compile-only only when `compile_only`)."""
    return lambda f: _apply([click_option(flag) for flag in F.FLAGS if compile_only or not flag.compile_only], f)


def topology_options(required: bool):
    """--nodes / --gpus-per-node: required where a placement is scored elsewhere, 1 x 1 by default otherwise."""
    return lambda f: _apply([click_option(F.BY_NAME[name], **({"default": None, "show_default": False} if required else {}))
                             for name in ("nodes", "gpus_per_node")], f)


def placement_options(f):
    """`place`'s placement flags: those of the table, with the policies that need no model (ilp by default)."""
    policy = click_option(F.BY_NAME["policy"], type=click.Choice(["ilp", "eplb", "contiguous"]), default="ilp",
                          help="placement policy")
    return _apply([policy] + [click_option(F.BY_NAME[n]) for n in F.PLACEMENT_FLAGS if n != "policy"], f)


def output_options(f):
    return _apply([
        click.option("--json", "as_json", is_flag=True, help="print a JSON summary as the last line"),
        click.option("--quiet", is_flag=True, help="no progress output"),
    ], f)


def given_flags(ctx: click.Context) -> set:
    """The names of the table's flags given on the command line (not left at their defaults)."""
    return {name for name in F.BY_NAME if name in ctx.params and ctx.get_parameter_source(name) != ParameterSource.DEFAULT}


def flag_values(ctx: click.Context) -> dict:
    """The table's flags' values of this command."""
    return {name: value for name, value in ctx.params.items() if name in F.BY_NAME}


class TargetCommand(click.Command):
    """A command whose help lists its targets (`targets`: {name: what it writes}), its flags by group,
    each group naming the targets it serves, and examples (`examples`: lines of shell)."""

    def __init__(self, *args, targets=None, examples=(), **kwargs):
        super().__init__(*args, **kwargs)
        self.targets = dict(targets or {})
        self.examples = tuple(examples)

    def format_options(self, ctx, formatter):
        if self.targets:
            with formatter.section("Targets (--target)"):
                formatter.write_dl(list(self.targets.items()))
        sections = {"Options": []}
        serves = dict(F.GROUPS)
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx) if isinstance(param, click.Option) else None
            if record is None:
                continue
            flag = F.BY_NAME.get(param.name)
            title = f"{flag.group} ({serves[flag.group]})" if flag else "Options"
            sections.setdefault(title, []).append(record)
        for title, rows in sections.items():
            with formatter.section(title):
                formatter.write_dl(rows)

    def format_epilog(self, ctx, formatter):
        if self.examples:
            with formatter.section("Examples"):
                for line in self.examples:
                    formatter.write_text("\b\n" + line)
        super().format_epilog(ctx, formatter)
