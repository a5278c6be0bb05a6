"""The `moeplan` command line: one click group; each command lives in `planner/commands/`.

User mistakes surface as `UserError` and print one line with exit code 2; anything else is a
moeplan bug and keeps its traceback.
"""
from __future__ import annotations

import sys

import click

from moeplan.planner.errors import UserError


class MoeplanGroup(click.Group):
    """Turns `UserError` (and unreadable-input OS errors) into one line and exit code 2."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except UserError as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(UserError.exit_code)


@click.group(cls=MoeplanGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="moeplan")
def main():
    """moeplan: ahead-of-time compiler for Mixture-of-Experts inference deployments."""


def _register():
    from moeplan.planner.commands.calibrate import calibrate_cmd
    from moeplan.planner.commands.codegen import codegen
    from moeplan.planner.commands.compile import compile_cmd
    from moeplan.planner.commands.export_onnx import export_onnx_cmd
    from moeplan.planner.commands.inspect import inspect
    from moeplan.planner.commands.place import place
    from moeplan.planner.commands.plan import plan
    from moeplan.planner.commands.run import run
    from moeplan.planner.commands.simulate import simulate
    from moeplan.planner.commands.trace import trace

    for command in (inspect, trace, place, compile_cmd, codegen, run, plan, simulate, export_onnx_cmd, calibrate_cmd):
        main.add_command(command)


_register()

if __name__ == "__main__":
    main()
