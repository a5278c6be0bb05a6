"""The `moeplan` command line: one click group; each command lives in `planner/commands/`.

User mistakes surface as `UserError` and print one line with exit code 2; click's own usage
errors (`--nodes abc`) are reshaped into the same one line. Anything else is a moeplan bug and
keeps its traceback. Every command runs inside `output_guard.guard_command` (inputs declared,
`--force` added where there is an `--out`; see core/atomic.py).
"""
from __future__ import annotations

import sys

import click

from moeplan.planner.commands.help_format import ListingGroup
from moeplan.core.errors import UserError, one_line_usage_error


class MoeplanGroup(ListingGroup):
    """Turns `UserError` and click's usage errors into one `error:` line and exit code 2."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except UserError as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(UserError.exit_code)

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        try:
            result = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except click.ClickException as exc:
            click.echo(f"error: {one_line_usage_error(exc)}", err=True)
            sys.exit(UserError.exit_code if isinstance(exc, click.UsageError) else exc.exit_code)
        except click.Abort:
            click.echo("error: aborted", err=True)
            sys.exit(1)
        sys.exit(result if isinstance(result, int) else 0)


@click.group(cls=MoeplanGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="moeplan")
def main():
    """moeplan: ahead-of-time compiler for Mixture-of-Experts inference deployments."""


def _register():
    from moeplan.planner.commands.calibrate import calibrate_cmd
    from moeplan.planner.commands.codegen import codegen
    from moeplan.planner.commands.diff import diff
    from moeplan.planner.commands.compile import compile_cmd
    from moeplan.planner.commands.export_onnx import export_onnx_cmd
    from moeplan.planner.commands.inspect import inspect
    from moeplan.planner.commands.place import place
    from moeplan.planner.commands.plan import plan
    from moeplan.planner.commands.report import report
    from moeplan.planner.commands.run import run
    from moeplan.planner.commands.serve import serve
    from moeplan.planner.commands.simulate import simulate
    from moeplan.planner.commands.trace import trace

    from moeplan.planner.output_guard import guard_command

    for command in (inspect, trace, place, compile_cmd, codegen, run, serve, plan, simulate, export_onnx_cmd, calibrate_cmd,
                    report, diff):
        guard_command(command)
        main.add_command(command)


_register()

if __name__ == "__main__":
    main()
