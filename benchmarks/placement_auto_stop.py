"""`--policy auto` with and without its early stop (issue 38 item 5): what the stop saves in wall
time and what it costs in predicted time, measured in the same run.

For each case the candidates are built and priced twice by `choose_placement`, as `moeplan plan`
does (the trace, model shape, hardware profile and workload of the case):
* every candidate (`error=None`: contiguous, EPLB and the ILP's load-cap ladder, each with and
  without one replica slot per GPU; what `--policy auto` did before the stop);
* stopped (the default: once the placement floor, the least time any placement is predicted to
  take, is within `MODEL_ERROR` of the best so far; `passes/cost/placement_floor.py`).
It prints, beside the 1-minute load average, the candidate each chose and its predicted time per
token, the ratio stopped / every (<= 1 + MODEL_ERROR by construction, 1.0 where the stop chose the
same), the floor, the wall and CPU seconds of each and their ratio.

Cases (routing from the trace named; the synthetic ones are `moeplan trace synth`'s generator):
* tiny-2x2: examples/tiny_moe (6 MoE layers x 16 experts, top-2) on 2 x 2 ranks, cpu-gloo,
  workload 8x32+8, a planted trace (affinity 0.6, Zipf 0.8, 20,000 tokens) or `--tiny-trace`
  (e.g. one recorded by `moeplan trace examples/tiny_moe`);
* mixtral-1x8: Mixtral-8x7B on 1 x 8 H100 (h100-sxm), examples/ci/mixtral-8x7b.trace.npz;
* deepseek-8x8: DeepSeek-V3 on 8 x 8 H100, a planted 58 x 256 top-8 trace of 20,000 tokens
  (the size of benchmarks/placement.py's deepseek-v3 case). Trying every candidate here takes
  tens of minutes on 2 cores (the ILP's ladder); run it with `--cases deepseek-8x8`.

    python benchmarks/placement_auto_stop.py [--cases tiny-2x2 mixtral-1x8 deepseek-8x8] [--json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CASES = {
    # name: (model, trace (None: planted with these sizes), nodes, gpus per node, hardware, workload)
    "tiny-2x2": (REPO / "examples" / "tiny_moe", dict(layers=6, experts=16, top_k=2), 2, 2, "cpu-gloo", "8x32+8"),
    "mixtral-1x8": (REPO / "examples" / "configs" / "mixtral-8x7b.json", REPO / "examples" / "ci" / "mixtral-8x7b.trace.npz",
                    1, 8, "h100-sxm", "8x32+8"),
    "deepseek-8x8": (REPO / "examples" / "configs" / "deepseek-v3.json", dict(layers=58, experts=256, top_k=8), 8, 8,
                     "h100-sxm", "8x32+8"),
}
DEFAULT_CASES = ("tiny-2x2", "mixtral-1x8")


def load_case(name: str, tiny_trace: str | None):
    from moeplan.core.hardware import load_hardware
    from moeplan.passes.analysis.trace.format import load_trace
    from moeplan.passes.analysis.trace.synth_planted import synthesize_trace
    from moeplan.passes.cost.context import attention_of, context_plan_of, shape_with_context
    from moeplan.passes.cost.options import parse_workload
    from moeplan.passes.importers import load_model
    from moeplan.passes.optimize.placement.policies import PlacementRequest
    from moeplan.passes.optimize.placement.schema import Topology

    model, trace_from, nodes, per_node, hardware, workload = CASES[name]
    loaded = load_model(str(model))
    if name == "tiny-2x2" and tiny_trace:
        trace_from = Path(tiny_trace)
    trace = (synthesize_trace(**trace_from, tokens=20000, affinity=0.6, zipf=0.8, seed=0) if isinstance(trace_from, dict)
             else load_trace(str(trace_from)))
    shape = shape_with_context(loaded.ir, context_plan_of(loaded.module), attention_of(loaded.module, loaded.ir))
    return (trace, PlacementRequest(topology=Topology(nodes, per_node)), shape, load_hardware(hardware),
            parse_workload(workload), f"{nodes}x{per_node} {hardware}, workload {workload}")


def timed(fn, *args, **kwargs):
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - wall, time.process_time() - cpu, os.getloadavg()[0]


def run_case(name: str, tiny_trace: str | None) -> dict:
    from moeplan.passes.cost.by_predicted_time import MODEL_ERROR, choose_placement

    trace, request, shape, profile, workload, what = load_case(name, tiny_trace)
    out = {"case": name, "setting": what, "error": MODEL_ERROR}
    for key, error in (("every", None), ("stopped", MODEL_ERROR)):
        (placement, rows, stop), wall, cpu, load = timed(choose_placement, trace, request, shape, profile, workload,
                                                         "auto", error=error)
        chosen = next(r for r in rows if r["chosen"])
        out[key] = {"chosen": chosen["label"], "mode": chosen["mode"], "seconds_per_token": chosen["seconds_per_token"],
                    "priced": [r["label"] for r in rows], "skipped": stop["skipped"], "wall_s": wall, "cpu_s": cpu,
                    "load_1min": load, "floor_seconds_per_token": stop["floor_seconds_per_token"]}
    out["predicted_ratio"] = out["stopped"]["seconds_per_token"] / out["every"]["seconds_per_token"]
    out["wall_ratio"] = out["stopped"]["wall_s"] / out["every"]["wall_s"]
    out["cpu_ratio"] = out["stopped"]["cpu_s"] / out["every"]["cpu_s"]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", nargs="+", choices=sorted(CASES), default=list(DEFAULT_CASES))
    ap.add_argument("--tiny-trace", default=None, help="a trace of examples/tiny_moe for tiny-2x2 (default: planted)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    results = []
    for name in args.cases:
        r = run_case(name, args.tiny_trace)
        results.append(r)
        e, s = r["every"], r["stopped"]
        print(f"{name}: {r['setting']}; model error {r['error']:.0%}, floor {s['floor_seconds_per_token'] * 1e3:.3f} ms/token")
        for key, v in (("every candidate", e), ("stopped", s)):
            print(f"  {key:<16} chose {v['chosen']:<22} {v['mode']:<9} {v['seconds_per_token'] * 1e3:9.3f} ms/token  "
                  f"wall {v['wall_s']:8.1f} s  cpu {v['cpu_s']:8.1f} s  (load {v['load_1min']:.1f})  "
                  f"priced {len(v['priced'])}, skipped {', '.join(v['skipped']) or 'none'}")
        print(f"  stopped / every: predicted time {r['predicted_ratio']:.4f}, wall {r['wall_ratio']:.3f}, "
              f"cpu {r['cpu_ratio']:.3f}")
    if args.json:
        print(json.dumps({"cases": results}, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
