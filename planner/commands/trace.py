"""`moeplan trace`: record a routing trace from a model, or import, synthesise and summarise traces.

`moeplan trace MODEL --data TEXT --out T.npz` records; the named subcommands (`import`, `stats`,
and later ones) take precedence when the first argument is one of their names.
"""
from __future__ import annotations

import click

from moeplan.planner.commands.help_format import ListingGroup


class DefaultToRecordGroup(ListingGroup):
    """A group whose first argument is a MODEL unless it names a subcommand."""

    default_command = "record"

    def parse_args(self, ctx, args):
        if args and args[0] not in self.commands and args[0] not in ("-h", "--help"):
            args = [self.default_command, *args]
        return super().parse_args(ctx, args)

    def format_usage(self, ctx, formatter):
        formatter.write_usage(ctx.command_path, "MODEL --data TEXT --out T.npz [OPTIONS]")
        formatter.write_usage(ctx.command_path, "COMMAND [ARGS]...", prefix="   or: ")

    def format_options(self, ctx, formatter):
        """The default command's options first: `trace MODEL ...` is how most runs start."""
        record = self.commands[self.default_command]
        with ctx.scope(cleanup=False):
            sub = click.Context(record, info_name=self.default_command, parent=ctx)
            params = [p for p in record.get_params(sub) if isinstance(p, click.Option) and p.name != "help"]
            rows = [r for r in (p.get_help_record(sub) for p in params) if r]
        with formatter.section(f"Options for recording (trace MODEL ..., same as `trace {self.default_command}`)"):
            formatter.write_dl(rows)
        super().format_options(ctx, formatter)


@click.group(cls=DefaultToRecordGroup)
def trace():
    """Record (MODEL --data TEXT --out T.npz), import, synthesise or summarise routing traces."""


def _register():
    from moeplan.planner.commands import trace_record, trace_import, trace_stats

    trace.add_command(trace_record.record)
    trace.add_command(trace_import.import_log)
    trace.add_command(trace_stats.stats)
    from moeplan.planner.commands.trace_synth import synth
    trace.add_command(synth)


_register()
