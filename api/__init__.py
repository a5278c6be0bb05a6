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
command prints). Bad input raises `moeplan.UserError` with the message the command would print.
Progress lines go to stderr unless `quiet` (the default here).
"""
from __future__ import annotations

from moeplan.core.errors import UserError

__all__ = ["compile", "plan", "codegen", "targets", "options", "UserError"]


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

    target = target or registry.DEFAULT_TARGET
    values = flags.resolve(options)
    with _guard((model, trace, values.get("sign_key")), out, "bundle", force):
        return registry.compile_target(target, str(model), str(trace), str(out), values, set(options), quiet=quiet)


def plan(model, trace, target: str | None = None, out=None, *, quiet: bool = True, force: bool = False, **options):
    """The plan of MODEL with its routing TRACE for `target` (default: torchrun), without a bundle,
    as `moeplan plan` makes it; written as plan.json at `out` when given."""
    from moeplan.planner.pipeline import flags, targets as registry

    target = target or registry.DEFAULT_TARGET
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
