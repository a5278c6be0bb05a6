"""The pass manager checks what passes produce (`Pass.ensures`) and names, when a pass breaks, the
passes that ran before it; the placement is checked right after the placement pass."""
import pytest
from click.testing import CliRunner

from moeplan.passes.analysis.trace.format import save_trace
from moeplan.planner.cli import main
from moeplan.core.errors import UserError
from moeplan.core.pass_manager import Pass, PassError, PassManager
from runtime_fixtures import SMALL, random_trace, small_model_dir


def chain(*passes):
    return PassManager(list(passes), quiet=True)


def test_a_broken_postcondition_names_the_pass_and_those_before_it():
    def at_most_ten(facts):
        if facts["z"] > 10:
            raise ValueError(f"z = {facts['z']} is over 10")

    manager = chain(Pass("double", ("x",), ("y",), lambda f: {"y": f["x"] * 2}),
                    Pass("square", ("y",), ("z",), lambda f: {"z": f["y"] ** 2}, ensures=at_most_ten),
                    Pass("after", ("z",), ("w",), lambda f: {"w": 0}))
    assert manager.run({"x": 1})["z"] == 4
    with pytest.raises(PassError) as caught:
        manager.run({"x": 3})
    assert str(caught.value) == "pass 'square' (after the passes double) broke its postcondition: z = 36 is over 10"
    assert caught.value.pass_name == "square" and caught.value.before == ["double"]
    assert isinstance(caught.value.__cause__, ValueError)
    assert [t["pass"] for t in manager.timings()] == ["double"]  # nothing ran after it


def test_the_postcondition_sees_what_the_pass_read_and_wrote():
    seen = {}
    chain(Pass("p", ("x",), ("y",), lambda f: {"y": f["x"] + 1}, ensures=lambda f: seen.update(f))).run({"x": 1, "other": 2})
    assert seen == {"x": 1, "y": 2}


def test_a_pass_that_raises_is_named_with_the_passes_before_it():
    def broken(facts):
        raise KeyError("layers")

    manager = chain(Pass("trace", (), ("t",), lambda f: {"t": 1}), Pass("affinity", ("t",), ("a",), lambda f: {"a": 1}),
                    Pass("placement", ("a",), ("p",), broken))
    with pytest.raises(PassError, match=r"^pass 'placement' \(after the passes trace, affinity\) failed: KeyError: 'layers'$"):
        manager.run({})
    with pytest.raises(PassError, match=r"^pass 'first' \(as the first pass\) wrote \['b'\], declared \['a'\]$"):
        chain(Pass("first", (), ("a",), lambda f: {"b": 1})).run({})


def test_user_errors_stay_one_line_naming_the_pass():
    def refuse(facts):
        raise UserError("the trace has 3 MoE layers")

    manager = chain(Pass("trace", (), ("t",), lambda f: {"t": 1}), Pass("placement", ("t",), ("p",), refuse))
    with pytest.raises(UserError, match="^placement: the trace has 3 MoE layers$"):
        manager.run({})


def test_a_given_fact_skips_its_writer_and_what_only_it_needs():
    """`moeplan codegen`: the plan is given, so only codegen and what it reads run."""
    ran = []

    def step(name, writes):
        return Pass(name, {"plan": ("placement",), "codegen": ("plan", "model"), "placement": (), "import": ()}[name],
                    (writes,), lambda f: ran.append(name) or {writes: name})

    passes = [step("placement", "placement"), step("plan", "plan"), step("import", "model"), step("codegen", "manifest")]
    facts = chain(*passes).run({"plan": "given"}, want=("manifest",))
    assert facts["manifest"] == "codegen" and facts["plan"] == "given" and ran == ["import", "codegen"]


def test_the_placement_pass_checks_the_placement_it_wrote(tmp_path, monkeypatch):
    """A placement policy that drops an expert is caught by the placement pass's postcondition, in
    the real compile pipeline, before any cost or codegen pass sees it."""
    from moeplan.passes.optimize.placement import policies

    model = small_model_dir(tmp_path)
    save_trace(random_trace(200, SMALL["num_layers"], SMALL["num_experts"]), tmp_path / "t.npz")
    real = policies.plan_placement

    def dropping(trace, request):
        placement = real(trace, request)
        placement.layers[0][0] = [e for e in placement.layers[0][0] if e != placement.layers[0][0][0]]
        return placement

    monkeypatch.setattr(policies, "plan_placement", dropping)
    result = CliRunner().invoke(main, ["compile", str(model), "--trace", str(tmp_path / "t.npz"), "--gpus-per-node", "2",
                                       "--policy", "contiguous", "--mode", "standard", "--out", str(tmp_path / "b"), "--quiet"])
    assert isinstance(result.exception, PassError), result.output
    assert str(result.exception).startswith("pass 'placement' (after the passes runtime, import, trace, affinity) broke "
                                            "its postcondition: layer 0 places no replica of expert")
    assert not (tmp_path / "b").exists()


def test_every_plan_pass_checks_its_plan_serialises_and_reads_back():
    """A plan holding something plan.json cannot hold (here a numpy array) fails at the pass that
    made it, not later while a bundle is half written."""
    import numpy as np

    from moeplan.core.plan import Plan, plan_reads_back
    from moeplan.planner.pipeline.targets import TARGETS

    def plan_with(predicted):
        return lambda f: {"plan": Plan(target="torchrun", model={}, topology={"nodes": 1, "gpus_per_node": 1},
                                       placement={}, communication={}, predicted=predicted)}

    unwritable = plan_with({"loads": np.arange(3)})({})
    for target in TARGETS.values():
        plans = [p for p in target.passes if p.name == "plan"]
        assert len(plans) == 1 and plans[0].ensures is not None, target.name
        with pytest.raises((ValueError, TypeError)):  # each target's own check, whatever else it adds, reads back
            plans[0].ensures(unwritable)

    good = Pass("plan", (), ("plan",), plan_with({"gpu_local_fraction": 0.5}), ensures=plan_reads_back)
    assert chain(good).run({})["plan"].predicted == {"gpu_local_fraction": 0.5}
    bad = Pass("plan", (), ("plan",), plan_with({"loads": np.arange(3)}), ensures=plan_reads_back)
    with pytest.raises(PassError, match=r"^pass 'plan' \(as the first pass\) broke its postcondition: "):
        chain(bad).run({})
