"""What the corpus placements pay end to end: predicted tokens/s and bytes of each row's deployment.

Why: `benchmarks/placement.py --corpus` compares placements by GPU-local fraction, the proxy the
ILP optimises. A placement is better only if its deployment is faster. Here every row is priced
by the cost model (`passes/cost/cost_model.py`, the runtime's exchanges replayed exactly; its
bytes equal the measured counters of real runs, tests/test_cost_model.py) in both modes, on the
held-out half's routing, and the faster mode is reported beside EPLB+R in standard mode.

Deployment shapes (the routing is the trace's, the widths a production model's, stated per case):
* trained cases: the production config of the same architecture (examples/configs/
  mixtral-8x7b.json, qwen3-30b-a3b.json, olmoe-1b-7b.json) with the traced model's experts, top-k
  and MoE layers;
* drift cases (no architecture): Mixtral-8x7B's widths with the trace's experts, top-k and layers;
* DeepSeek-V3-shaped cases: examples/configs/deepseek-v3.json as it is.
Hardware: `h100-sxm` (published specifications; 2 x 4 or 8 x 8 GPUs as the case's topology) and
the same profile with no per-call overhead (`h100-sxm, no op overhead`): the runtime's exchange makes
a dozen torch calls per peer and call, which at 64 ranks outweighs the bytes; without them, what
is left is bytes and message latency, the part a placement can change (as in a fused all-to-all
kernel). Workloads as benchmarks/cost_at_scale.py: 256 requests x 16 prompt + 4 new tokens on 4
and 8 GPUs, 512 x 4 + 3 on the DeepSeek-V3-shaped cases' 64 (`--workload` for every case).

    python benchmarks/placement_deployment.py [--corpus-cases mixtral deepseek] [--policies eplb ilp] [--json]

With --json the last line is {"rows": [{"case", "policy", "hardware", "gpu_local_fraction",
"max_over_mean_load", "standard", "coherent", "best_mode", "tokens_per_second", "ratio"}]}, each
mode {"tokens_per_second", "total_bytes_per_token", "compute_share"}; ratio: the best mode's
tokens/s over EPLB+R's in standard mode, same case and hardware.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CONFIGS = REPO / "examples" / "configs"
ROWS = ("contiguous", "eplb", "ilp")  # corpus rows (label prefixes) priced by default
HARDWARE = "h100-sxm"


# trained architecture -> (production config, its key for routed experts, keys set to the layer count)
PRODUCTION = {
    "qwen3_moe": ("qwen3-30b-a3b.json", "num_experts", ("num_hidden_layers", "max_window_layers")),
    "olmoe": ("olmoe-1b-7b.json", "num_experts", ("num_hidden_layers",)),
    "mixtral": ("mixtral-8x7b.json", "num_local_experts", ("num_hidden_layers",)),
}


def deployment_config(case, trace) -> dict:
    """The production config the case's routing is priced on (module docstring)."""
    if case.deepseek_shaped:
        return json.loads((CONFIGS / "deepseek-v3.json").read_text())
    name, experts_key, layer_keys = PRODUCTION[case.source.get("trained", {}).get("arch", "mixtral")]
    return {**json.loads((CONFIGS / name).read_text()), experts_key: trace.num_experts,
            "num_experts_per_tok": trace.top_k, **dict.fromkeys(layer_keys, trace.num_layers)}


def deployment_shape(config: dict, scratch: Path):
    """ModelShape of a config built on the meta device, with the runtime's context rows, bf16 on the wire."""
    from moeplan.passes.importers import load_model
    from moeplan.passes.cost.context import context_plan_of, shape_with_context

    text = json.dumps(config, sort_keys=True)
    path = scratch / f"{hashlib.sha256(text.encode()).hexdigest()[:12]}.json"
    path.write_text(text)
    loaded = load_model(str(path))
    return replace(shape_with_context(loaded.ir, context_plan_of(loaded.module)), element_bytes=2)


def profiles() -> dict:
    """{label: HardwareProfile}: the published H100 profile, and the same with no per-call overhead."""
    from moeplan.core.hardware import load_hardware

    h100 = load_hardware(HARDWARE)
    return {HARDWARE: h100, f"{HARDWARE}, no op overhead": replace(h100, op_overhead_s=0.0, runtime_op_overhead_s=0.0)}


def price(placement, shape, workload, held_out, hardware) -> dict:
    """Both modes' prediction on the held-out routing, and the faster one (`by_predicted_time.choose_mode`)."""
    from moeplan.passes.cost.by_predicted_time import choose_mode, predict_modes

    modes = predict_modes(placement.hosts(), placement.topology.gpus_per_node, shape, workload, held_out.experts,
                          hardware)
    best = choose_mode(modes)
    out = {m: {"tokens_per_second": 1.0 / p["seconds_per_token"], "total_bytes_per_token": p["total_bytes_per_token"],
               "compute_share": p["compute_share"]} for m, p in modes.items()}
    return {**out, "best_mode": best, "tokens_per_second": out[best]["tokens_per_second"]}


def run_case(case, args, scratch: Path, log) -> list:
    """Rows of one corpus case: each placement planned on the first half, priced on the second under every profile."""
    from placement import corpus_placements, split_by_sequence
    from placement_corpus import load_case_trace
    from moeplan.passes.optimize.placement.policies import evaluate_placement
    from moeplan.passes.cost.options import parse_workload

    plan_trace, held_out = split_by_sequence(load_case_trace(case, log))
    shape = deployment_shape(deployment_config(case, plan_trace), scratch)
    workload = parse_workload(args.workload or ("512x4+3" if case.deepseek_shaped else "256x16+4"))
    hardware_profiles = profiles()
    rows = []
    for label, placement, _, _ in corpus_placements(case, plan_trace, args.time_limit, log, args.effort, args.policies):
        score = evaluate_placement(placement, held_out)
        for hw_label, hardware in hardware_profiles.items():
            row = {"case": case.name, "policy": label, "hardware": hw_label,
                   "gpu_local_fraction": score["gpu_local_fraction"], "max_over_mean_load": score["max_over_mean_load"],
                   **price(placement, shape, workload, held_out, hardware)}
            rows.append(row)
            log(f"  {case.name:22s} {label:32s} {hw_label:26s} gpu-local {row['gpu_local_fraction']:.4f} "
                f"max/mean {row['max_over_mean_load']:.4f}  standard {row['standard']['tokens_per_second']:9.1f} tok/s "
                f"coherent {row['coherent']['tokens_per_second']:9.1f} tok/s")
    for hw_label in hardware_profiles:
        base = next((r for r in rows if r["hardware"] == hw_label and r["policy"] == f"eplb+{case.redundant}"), None)
        for r in rows:
            if r["hardware"] == hw_label:
                r["ratio"] = r["tokens_per_second"] / base["standard"]["tokens_per_second"] if base else None
    return rows


def print_table(rows: list) -> None:
    header = (f"{'case':22s} {'policy':32s} {'hardware':26s} {'gpu-local':>9s} {'max/mean':>8s} {'std tok/s':>10s} "
              f"{'coh tok/s':>10s} {'best':>8s} {'x eplb+R':>8s} {'std B/tok':>12s} {'coh B/tok':>12s}")
    print(header)
    print("-" * len(header))
    for r in rows:
        ratio = f"{r['ratio']:.3f}" if r.get("ratio") is not None else "-"
        print(f"{r['case']:22s} {r['policy']:32s} {r['hardware']:26s} {r['gpu_local_fraction']:9.4f} "
              f"{r['max_over_mean_load']:8.4f} {r['standard']['tokens_per_second']:10.1f} "
              f"{r['coherent']['tokens_per_second']:10.1f} {r['best_mode']:>8s} {ratio:>8s} "
              f"{r['standard']['total_bytes_per_token']:12.0f} {r['coherent']['total_bytes_per_token']:12.0f}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus-cases", nargs="*", default=None, help="corpus cases whose name contains one of these")
    parser.add_argument("--policies", nargs="*", default=list(ROWS), help="corpus rows whose label starts with one of these")
    parser.add_argument("--workload", default=None, help="REQUESTSxPROMPT+NEW for every case (default: 512x4+3 DeepSeek-V3-shaped, else 256x16+4)")
    parser.add_argument("--time-limit", type=float, default=3000.0, help="ilp safety-net time limit per row (seconds)")
    parser.add_argument("--effort", type=float, default=1.0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    sys.path.insert(0, str(REPO / "benchmarks"))
    from placement_corpus import CORPUS

    def log(message):
        print(message, file=sys.stderr if args.json else sys.stdout, flush=True)

    rows = []
    with tempfile.TemporaryDirectory(prefix="moeplan-deploy-") as scratch:
        for case in CORPUS:
            if args.corpus_cases and not any(c in case.name for c in args.corpus_cases):
                continue
            rows += run_case(case, args, Path(scratch), log)
    if args.json:
        print(json.dumps({"rows": rows}, sort_keys=True))
    else:
        print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
