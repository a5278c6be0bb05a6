"""The ilp placement depends on work budgets (--effort), not on the clock: the same inputs give the
same placement.json bytes on an idle and on a busy machine, and a solve the safety time limit cuts
short says so."""
import os
import subprocess
import sys
import time

import pytest

from moeplan.passes.analysis.trace.synth_planted import synthesize_trace
from moeplan.passes.optimize.placement.policies import PlacementRequest, plan_placement
from moeplan.passes.optimize.placement.schema import Topology
from moeplan.core.errors import UserError

BURN = "import time\nend = time.time() + {seconds}\nwhile time.time() < end:\n    pass\n"


@pytest.fixture(scope="module")
def planted():
    # big enough that the old deadline-driven sweeps were cut by the clock at a few seconds' limit
    return synthesize_trace(layers=8, experts=32, top_k=2, tokens=6000, affinity=0.7, zipf=0.6, seed=3)


def solve(trace, **options):
    request = PlacementRequest(Topology(2, 2), "ilp", redundant=4, balance=0.1, time_limit=60, **options)
    return plan_placement(trace, request)


@pytest.mark.slow
def test_same_bytes_on_an_idle_and_a_busy_machine(planted):
    start = time.perf_counter()
    idle = solve(planted)
    idle_seconds = time.perf_counter() - start
    assert idle.metrics["stopped_by"] == "work"
    # one busy-loop process per core, bounded in time, while the same placement is solved again
    burners = [subprocess.Popen([sys.executable, "-c", BURN.format(seconds=max(5.0, 4 * idle_seconds))])
               for _ in range(os.cpu_count() or 1)]
    try:
        busy = solve(planted)
    finally:
        for process in burners:
            process.kill()
            process.wait()
    assert busy.metrics["stopped_by"] == "work"
    assert busy.to_json() == idle.to_json()


def test_effort_changes_work_not_validity(planted):
    light = solve(planted, effort=0.25)
    assert light.metrics["effort"] == 0.25 and light.metrics["stopped_by"] == "work"
    assert light.to_json() == solve(planted, effort=0.25).to_json()
    with pytest.raises(UserError, match="--effort must be positive"):
        solve(planted, effort=0)


def test_time_limit_that_stops_the_solve_is_reported(planted):
    p = plan_placement(planted, PlacementRequest(Topology(2, 2), "ilp", redundant=4, balance=0.1, time_limit=0.01))
    assert p.metrics["stopped_by"] == "time_limit"
    assert any("may not be reproducible" in note for note in p.metrics["notes"])
    assert p.metrics["max_over_mean_load"] <= 1.1 + 1e-9  # still a valid, capped placement
