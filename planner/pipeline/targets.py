"""The target registry: every target's name -> the flags it takes, its pass list and its codegen.

This is the one place targets are dispatched. `moeplan compile` (`compile_target`), `moeplan plan`
(`plan_target`), `moeplan codegen` (`codegen_plan`) and the Python API (`moeplan.compile`,
`moeplan.plan`) all come here:

* the flags a target takes are those of `planner/pipeline/flags.py` that name it; any other flag
  given is refused in one line (`flags.refuse_inapplicable`);
* `inputs` turns the flags' values into the facts its pass list starts from (checking them first);
* the pass list ends in the codegen pass; `plan` asks it for the plan only, `codegen` gives it the
  plan and asks for the bundle (`PassManager(want=...)`);
* `summary` is the `--json` summary, `describe` the human lines.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from collections.abc import Callable

from moeplan.core import progress
from moeplan.core.errors import UserError
from moeplan.core.pass_manager import PassManager
from moeplan.planner.pipeline import engine_targets, flags, lambda_, offload, torchrun

DEFAULT_TARGET = "torchrun"


@dataclass(frozen=True)
class Target:
    """One deployment target (see the module docstring)."""

    name: str
    about: str
    passes: list
    inputs: Callable  # (model, trace, out, values, given) -> input facts
    summary: Callable  # facts -> the --json summary's target fields
    describe: Callable  # (summary, facts) -> what the plan or bundle holds, in lines
    bundles: bool = True  # False: plans only (no codegen yet)
    passes_for: Callable | None = None  # input facts -> the pass list, where the inputs choose another (--slo)

    def pass_list(self, facts: dict) -> list:
        return self.passes if self.passes_for is None else self.passes_for(facts)

    @property
    def flags(self) -> tuple:
        return flags.flags_of(self.name)


TARGETS = {t.name: t for t in (
    Target("torchrun", "torchrun bundle: expert-parallel ranks on GPUs (or gloo on CPU), launch.sh, shards",
           torchrun.PASSES, lambda m, t, o, v, g: torchrun.inputs("torchrun", m, t, o, v), torchrun.summary,
           torchrun.describe),
    Target("kubernetes", "the torchrun bundle plus kubernetes/ manifests: the OpenAI-compatible service (StatefulSets, Services, "
           "PodDisruptionBudget, ConfigMap, PVC), or with --batch-job an indexed Job",
           torchrun.KUBERNETES_PASSES, lambda m, t, o, v, g: torchrun.inputs("kubernetes", m, t, o, v), torchrun.summary,
           torchrun.describe),
    Target("lambda", "AWS Lambda (SAM) bundle: sized expert functions, partitioned dense stages (docs/serverless.md)",
           lambda_.PASSES, lambda m, t, o, v, g: lambda_.inputs(m, t, o, v), lambda_.summary, lambda_.describe),
    Target("sglang", "the placement file SGLang loads at startup, launch script (a config is enough; docs/interop.md)",
           engine_targets.PASSES, lambda m, t, o, v, g: engine_targets.inputs("sglang", m, t, o, v, g), engine_targets.summary,
           engine_targets.describe, passes_for=lambda f: engine_targets.passes_for("sglang", f)),
    Target("vllm", "vllm serve with expert parallelism and its EPLB sized from the trace's drift, launch script (vLLM "
           "loads no placement file; a config is enough; docs/interop.md)",
           engine_targets.VLLM_PASSES, lambda m, t, o, v, g: engine_targets.inputs("vllm", m, t, o, v, g),
           engine_targets.summary, engine_targets.describe, passes_for=lambda f: engine_targets.passes_for("vllm", f)),
    Target("trtllm", "TensorRT-LLM's static MoE load balancer file, launch script (a config is enough)",
           engine_targets.PASSES, lambda m, t, o, v, g: engine_targets.inputs("trtllm", m, t, o, v, g), engine_targets.summary,
           engine_targets.describe, passes_for=lambda f: engine_targets.passes_for("trtllm", f)),
    Target("offload", "one GPU whose experts do not all fit: expert cache, residents, eviction, prefetch, tiers "
           "(plan only; docs/offload.md)", offload.PASSES, lambda m, t, o, v, g: offload.inputs(m, t, o, v),
           offload.summary, offload.describe, bundles=False),
)}
BUNDLE_TARGETS = tuple(n for n, t in TARGETS.items() if t.bundles)


@dataclass
class Outcome:
    """What a plan, compile or codegen gives back: the facts (`plan`, and `manifest` for a bundle),
    the pass timings and the summary `--json` prints."""

    target: str
    facts: dict
    timings: list
    summary: dict

    @property
    def plan(self):
        return self.facts["plan"]

    def describe(self) -> str:
        s = self.summary
        if s["out"] is None:  # a plan kept in memory (the Python API without out=)
            what = f"{self.target} plan (not written)"
        else:
            what = f"wrote {s['out']}" + (f" ({s['files']} files)" if "files" in s else "")
        return f"{what}: {TARGETS[self.target].describe(s, self.facts)}"


def _outcome(target: Target, facts: dict, out, timings: list) -> Outcome:
    """The outcome with its summary: what every target reports, then the target's own fields."""
    summary = {"out": None if out is None else str(out), "target": target.name, "passes": timings,
               "seconds": round(sum(t["seconds"] for t in timings), 3)}
    if "manifest" in facts:
        summary["files"] = len(facts["manifest"]["files"])
    return Outcome(target.name, facts, timings, {**summary, **target.summary(facts)})


def target_of(name: str, bundle: bool = False) -> Target:
    """The registered target `name`; `bundle`: it must have codegen."""
    if name not in TARGETS:
        raise UserError(f"unknown target '{name}'; use one of {', '.join(TARGETS)}")
    target = TARGETS[name]
    if bundle and not target.bundles:
        raise UserError(f"--target {name} plans only (no bundle yet): use 'moeplan plan --target {name}'")
    return target


def _run(target: Target, facts: dict, want, quiet: bool) -> tuple:
    say = (lambda msg: None) if quiet else (lambda msg: progress.say(msg))
    manager = PassManager(target.pass_list(facts), quiet=quiet)
    with progress.silenced(quiet):
        facts = manager.run({**facts, "progress": say}, want=want)
    return facts, manager.timings()


def _start(target: Target, model, trace, out, values: dict, given) -> dict:
    flags.refuse_inapplicable(target.name, given)
    return target.inputs(model, trace, out, values, set(given))


def compile_target(name: str, model, trace, out, values: dict, given=(), quiet: bool = False, finish=None) -> Outcome:
    """Plan and write the bundle of target `name` at `out`. `values`: every flag's value
    (`flags.resolve`); `given`: the names of the flags the user gave (the others are refused
    when they do not apply). `finish(out)`, if given, adds to the written bundle and returns its
    new manifest (`compile --report`), before the manifest is signed."""
    target = target_of(name, bundle=True)
    facts = _start(target, model, trace, out, values, given)
    signer = _signer(values.get("sign_key"))  # a bad key fails before any work
    facts, timings = _run(target, facts, None, quiet)
    if finish is not None:
        facts["manifest"] = finish(out)
    signer(out)
    return _outcome(target, facts, out, timings)


def plan_target(name: str, model, trace, out, values: dict, given=(), quiet: bool = False) -> Outcome:
    """The plan of target `name` alone (its pass list without codegen), written at `out` when given."""
    from moeplan.core.atomic import write_text_atomic

    target = target_of(name)
    facts = _start(target, model, trace, out, values, given)
    facts, timings = _run(target, facts, ("plan",), quiet)
    if out is not None:
        write_text_atomic(out, facts["plan"].to_json(), kind="plan")
    return _outcome(target, facts, out, timings)


def codegen_plan(plan, model_spec: str, out, quiet: bool = False) -> Outcome:
    """The bundle of a written plan: its target's pass list given the plan, asked for the bundle
    (so only the codegen pass and what it reads run: the weights' import, the runtime's files)."""
    target = target_of(plan.target, bundle=True)
    try:
        facts, timings = _run(target, {"plan": plan, "model_spec": str(model_spec), "out": str(out)}, ("manifest",), quiet)
    except UserError as exc:
        raise UserError(str(exc).replace("the weights are", f"the weights of '{model_spec}' are")) from None
    return _outcome(target, facts, out, timings)


def _signer(sign_key):
    """Load the signing key now; returns bundle -> None that signs its manifest."""
    if sign_key is None:
        return lambda out: None
    from moeplan.backends.common.signing import SigningError, load_private_key, sign_bundle

    try:
        key = load_private_key(sign_key)
    except SigningError as exc:
        raise UserError(f"--sign-key: {exc}") from None
    return lambda out: sign_bundle(Path(out), key)
