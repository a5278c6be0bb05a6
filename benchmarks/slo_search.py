"""The SLO search at real size (issue 38 item 3: a whole search in <= 5 min): wall time, the chosen
deployment and the CPU load average, for Qwen3-30B-A3B and Mixtral-8x7B on H100 and DeepSeek-V3 on H200.

Each case runs the search as `moeplan plan --slo` does (`passes/engine_targets/slo_search_pass.py:
placement_route`: screening under balanced routing, the finalists under the eplb placement of the trace
the plan would write), with the measured tables where aiconfigurator-core is installed (the roofline
otherwise; the line says which). Traces: Mixtral's recorded CI trace; Qwen3 and DeepSeek-V3 a planted
synthetic trace of their shape (affinity 0.5, Zipf 1.0, seed 0). The baseline beside each figure is
the exhaustive search: every candidate of every GPU count up to --max-gpus, with every redundant-slot
choice, placed and priced under the trace (no balanced screening, no stop at the first count that meets
the SLO; memory still checked first), so the ratio is what screening and stopping buy.

    .venv/bin/python benchmarks/slo_search.py [--cases qwen3,mixtral,deepseek-v3] [--no-exhaustive]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CASES = {  # name: (config, hardware, workload, slo, trace)
    "qwen3": ("qwen3-30b-a3b.json", "h100-sxm", "512x4096+512", "tpot=35ms", ("planted", 48, 128, 8)),
    "mixtral": ("mixtral-8x7b.json", "h100-sxm", "512x4096+512", "tpot=35ms", ("file", "mixtral-8x7b.trace.npz")),
    "deepseek-v3": ("deepseek-v3.json", "h200-sxm", "512x4096+512", "tpot=35ms", ("planted", 58, 256, 8)),
}


def trace_of(spec):
    from moeplan.passes.analysis.trace.format import load_trace
    from moeplan.passes.analysis.trace.synth_planted import synthesize_trace

    if spec[0] == "file":
        return load_trace(ROOT / "examples" / "ci" / spec[1])
    _, layers, experts, top_k = spec
    return synthesize_trace(layers=layers, experts=experts, top_k=top_k, tokens=4096, affinity=0.5, zipf=1.0, seed=0)


def load() -> str:
    return "load average {:.1f} {:.1f} {:.1f}".format(*os.getloadavg())


def exhaustive(model, hardware, profile, workload, slo, max_gpus, use_measured, route) -> tuple:
    """(seconds, candidates priced) of the search without its shortcuts: every candidate of every GPU
    count up to max_gpus, with every redundant-slot choice, priced under the real placement of the trace
    (candidates that do not fit memory are still skipped before pricing)."""
    from dataclasses import replace

    from moeplan.passes.cost.engine import slo_search as S

    start, count, w = time.perf_counter(), 0, S.parse_workload(workload)
    pricer = S.CandidatePricer(model, "sglang", hardware, profile, w, slo, None, use_measured)
    for gpus, nodes, gpn in S.gpu_counts(8, max_gpus):
        for c in S.screen_candidates("sglang", gpus, nodes, gpn, w, False, model.num_experts):
            for redundant in S.Fixed().redundant(c.moe_ep):
                c = replace(c, redundant_experts=redundant)
                if pricer.memory(c)["fits"]:
                    pricer.price(c, route(c))
                    count += 1
    return time.perf_counter() - start, count


def main() -> int:
    from moeplan.core.hardware import load_hardware
    from moeplan.core.slo import parse_slo
    from moeplan.passes.cost.engine import measured
    from moeplan.passes.cost.engine import slo_search as S
    from moeplan.passes.cost.engine.model_shape import engine_model
    from moeplan.passes.engine_targets.slo_search_pass import placement_route

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--max-gpus", type=int, default=64)
    parser.add_argument("--no-exhaustive", action="store_true", help="skip the exhaustive baseline")
    args = parser.parse_args()
    use_measured = measured.installed_version() is not None
    print(f"# prices: {'aiconfigurator-core measured tables' if use_measured else 'roofline (aiconfigurator-core absent)'}"
          f"; {load()}")
    for name in args.cases.split(","):
        config, hardware, workload, slo, trace_spec = CASES[name]
        raw = json.loads((ROOT / "examples" / "configs" / config).read_text())
        model, profile = engine_model(raw, name), load_hardware(hardware)
        trace = trace_of(trace_spec)
        engine_model_facts = {"num_experts": model.num_experts, "expert_groups": int(raw.get("n_group") or 0)}
        start = time.perf_counter()
        route = placement_route(trace, engine_model_facts, {"policy": None, "expert_groups": None})
        result = S.search(model, "sglang", hardware, profile, workload, parse_slo(slo), max_gpus=args.max_gpus,
                          route=route, use_measured=use_measured)
        seconds = time.perf_counter() - start
        print(f"{name}: {workload} --slo {slo} on {hardware}: search {seconds:.1f} s ({load()}); "
              f"{len(result.screened)} screened, {len(result.finalists)} finalists placed; chosen "
              f"{result.chosen.text()}")
        print(f"  why: {result.why}")
        if not args.no_exhaustive:
            full, count = exhaustive(model, hardware, profile, workload, parse_slo(slo), args.max_gpus, use_measured,
                                     placement_route(trace, engine_model_facts, {"policy": None, "expert_groups": None}))
            print(f"  exhaustive: {count} fitting candidates up to {args.max_gpus} GPUs placed and priced: {full:.1f} s "
                  f"({load()}); search / exhaustive = {seconds / full:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
