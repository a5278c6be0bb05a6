"""Command listings in help that wrap a command's first sentence instead of cutting it with "...".

click shortens each command's help line to what fits beside its name; `ListingGroup` gives the
whole first sentence and lets the formatter wrap it.
"""
from __future__ import annotations

import click

SENTENCE_LIMIT = 300


class ListingGroup(click.Group):
    """A click group whose `Commands:` listing shows every command's whole first sentence."""

    def format_commands(self, ctx, formatter):
        rows = []
        for name in self.list_commands(ctx):
            command = self.get_command(ctx, name)
            if command is not None and not command.hidden:
                rows.append((name, command.get_short_help_str(limit=SENTENCE_LIMIT)))
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)
