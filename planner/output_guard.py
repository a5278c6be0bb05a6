"""Declare every command's inputs to `planner.atomic`, and give commands that write an `--out` a `--force`.

Done once in `cli._register` for every command (and every subcommand of a group), so the command
files stay free of this plumbing: a parameter value that names an existing path is an input
(never replaced, never contained in an output); the parameters named in `OUTPUT_PARAMS` are
outputs or caches, not inputs.
"""
from __future__ import annotations

import functools
import os
from pathlib import Path

import click

from moeplan.core.atomic import check_not_input, check_output, command_scope

OUTPUT_PARAMS = frozenset({"out", "results", "cache_dir", "bo_storage", "force"})
# What each command's --out holds (core/atomic.py KINDS), so a bad --out fails before any work.
OUT_KIND = {"compile": "bundle", "codegen": "bundle", "place": "placement", "plan": "plan", "export-onnx": "onnx", "synth": "trace",
            "import": "trace", "record": "trace", "calibrate": "hardware", "report": "report"}


def _input_paths(params: dict) -> list:
    paths = []
    for name, value in params.items():
        if name in OUTPUT_PARAMS:
            continue
        for item in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(item, (str, os.PathLike)) and str(item) and "\0" not in str(item):
                try:
                    if os.path.lexists(item):
                        paths.append(item)
                except (OSError, ValueError):
                    continue
    return paths


def guard_command(command: click.Command) -> None:
    """Wrap `command` (recursively for groups) so its writes know its inputs and --force."""
    if isinstance(command, click.Group):
        for sub in command.commands.values():
            guard_command(sub)
        return
    if getattr(command.callback, "_moeplan_guarded", False):
        return
    writes = any(p.name == "out" for p in command.params)
    own_force = any(p.name == "force" for p in command.params)
    if writes and not own_force:
        command.params.append(click.Option(
            ["--force"], is_flag=True,
            help="replace an existing --out that is not an earlier moeplan output (inputs are never replaced)"))
    original = command.callback

    @functools.wraps(original)
    def guarded(*args, **kwargs):
        force = kwargs.get("force", False) if own_force else (kwargs.pop("force", False) if writes else False)
        with command_scope(_input_paths(kwargs), force=force):
            if writes and kwargs.get("out") is not None:
                check_output(kwargs["out"], OUT_KIND.get(command.name))
            if kwargs.get("results") is not None:  # run --results: never inside the bundle it runs
                check_not_input(Path(kwargs["results"]))
            return original(*args, **kwargs)

    guarded._moeplan_guarded = True
    command.callback = guarded
