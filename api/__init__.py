"""moeplan's Python API: plan and compile Mixture-of-Experts deployments from Python.

The same target registry as the command line (`planner/pipeline/targets.py`): the same targets,
the same options with the same defaults and checks (`planner/pipeline/flags.py`; an option's
keyword is its flag with `_` for `-`: `gpus_per_node=2` is `--gpus-per-node 2`), the same pass
lists, so `moeplan.compile(...)` writes the same bytes as `moeplan compile ...`.

    import moeplan

    result = moeplan.plan("examples/tiny_moe", "trace.npz", target="torchrun", gpus_per_node=2)
    result.plan.predicted.gpu_local_fraction
    bundle = moeplan.compile("examples/tiny_moe", "trace.npz", out="bundle", gpus_per_node=2, policy="eplb")
    bundle.summary["files"]

Each returns an `Outcome`: `.plan` (the `Plan`), `.facts` (with `manifest` for a bundle),
`.timings` (seconds per pass), `.summary` (what `--json` prints) and `.describe()` (the lines the
command prints; a plan not written says so). Bad input raises `moeplan.UserError` with the message
the command would print, its flags written as this API's keywords (`gpus_per_node=3`, not
`--gpus-per-node 3`; `keyword_text`). Progress goes to a terminal's stderr unless `quiet` (the
default here).
"""
from __future__ import annotations

import contextlib
import re

from moeplan.core.errors import UserError

__all__ = ["compile", "plan", "codegen", "targets", "options", "keyword_text", "UserError"]


def targets() -> dict:
    """{target name: one line about it} for every target."""
    from moeplan.planner.pipeline.targets import TARGETS

    return {name: t.about for name, t in TARGETS.items()}


def options(target: str | None = None) -> dict:
    """{keyword: default} of every option (or of those `target` takes)."""
    from moeplan.planner.pipeline import flags

    return {f.name: f.default for f in flags.FLAGS if target is None or target in f.targets}


def compile(model, trace, out, target: str | None = None, *, quiet: bool = True, force: bool = False, **options):
    """Plan MODEL with its routing TRACE for `target` (default: torchrun) and write the bundle at
    `out`, as `moeplan compile MODEL --trace TRACE --target TARGET --out OUT [options]` does.
    `force`: replace an `out` that is not an earlier moeplan bundle (inputs are never replaced)."""
    from moeplan.planner.pipeline import flags, targets as registry

    with _keywords():
        target = target or registry.DEFAULT_TARGET
        flags.refuse_inapplicable(target, set(options), keywords=True)
        values = flags.resolve(options)
        with _guard((model, trace, values.get("sign_key")), out, "bundle", force):
            return registry.compile_target(target, str(model), str(trace), str(out), values, set(options), quiet=quiet)


def plan(model, trace, target: str | None = None, out=None, *, quiet: bool = True, force: bool = False, **options):
    """The plan of MODEL with its routing TRACE for `target` (default: torchrun), without a bundle,
    as `moeplan plan` makes it; written as plan.json at `out` when given."""
    from moeplan.planner.pipeline import flags, targets as registry

    with _keywords():
        target = target or registry.DEFAULT_TARGET
        flags.refuse_inapplicable(target, set(options), keywords=True)
        values = flags.resolve(options, compile_only=False)
        with _guard((model, trace), out, "plan", force):
            return registry.plan_target(target, str(model), str(trace), None if out is None else str(out), values,
                                        set(options), quiet=quiet)


def codegen(plan, out, model=None, *, quiet: bool = True, force: bool = False):
    """The bundle of `plan` (a `Plan`, or the path of a plan.json) at `out`, with the weights of
    `model` (default: the model the plan names), as `moeplan codegen` writes it."""
    from pathlib import Path

    from moeplan.planner.pipeline import targets as registry
    from moeplan.core.plan import Plan

    with _keywords():
        path = None
        if not isinstance(plan, Plan):
            path = Path(plan)
            if not path.is_file():
                raise UserError(f"plan file '{path}' does not exist")
            plan = Plan.from_json(path.read_text(encoding="utf-8"))
        model = model or plan.inputs.get("model")
        if not model:
            raise UserError("the plan names no model; give model=")
        with _guard((model, path), out, "bundle", force):
            return registry.codegen_plan(plan, str(model), str(out), quiet=quiet)


def _guard(inputs, out, kind: str, force: bool):
    """As the CLI does for every command: the inputs are declared (never replaced, never inside an
    output) and `out` is checked before any work."""
    import contextlib

    from moeplan.core.atomic import check_output, command_scope

    @contextlib.contextmanager
    def scope():
        with command_scope([str(p) for p in inputs if p is not None], force=force):
            if out is not None:
                check_output(out, kind)
            yield

    return scope()


FLAG_WORD = re.compile(r"--([a-z][a-z0-9-]*)(?: ([^\s,;:()]+))?")


def keyword_text(message: str) -> str:
    """A command's message in this API's terms: `--gpus-per-node 3` -> `gpus_per_node=3`, `--target
    lambda` -> `target='lambda'`, a flag named without its value -> its keyword (`--slo` -> `slo`).
    A word after a flag is read as its value only where it can be one (a number, one of the flag's
    choices, a target); `--force` is `force=True`; a quoted command ('moeplan ...') stays as it is."""
    from moeplan.planner.pipeline import flags, targets as registry

    by_option = {f.option: f for f in flags.FLAGS}

    def value_of(flag, word: str):
        if word is None:
            return None
        if re.fullmatch(r"[+-]?\d+(\.\d*)?([eE][+-]?\d+)?", word):
            return word
        choices = getattr(flag.type, "choices", None) if flag is not None else registry.TARGETS
        return repr(word) if choices and word in choices else None

    def replace(m):
        option, word = f"--{m.group(1)}", m.group(2)
        flag = by_option.get(option)
        if flag is None and m.group(1) not in ("target", "out", "trace", "model", "force"):
            return m.group(0)
        name = flag.name if flag is not None else m.group(1)
        if flag is not None and flag.is_flag or name == "force":
            return f"{name}=True" + ("" if word is None else f" {word}")
        value = value_of(flag, word)
        if value is not None:
            return f"{name}={value}"
        return name + ("" if word is None else f" {word}")

    # a command quoted whole ('moeplan trace ... --out T.npz') is advice to run it: left as it is
    parts = re.split(r"('moeplan [^']*')", message)
    return "".join(part if i % 2 else FLAG_WORD.sub(replace, part) for i, part in enumerate(parts))


@contextlib.contextmanager
def _keywords():
    """UserErrors raised inside say what they say in this API's keywords (`keyword_text`)."""
    try:
        yield
    except UserError as exc:
        raise UserError(keyword_text(str(exc))) from None
