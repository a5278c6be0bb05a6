"""Predicted throughput at scale (issue 12, item 6): the cost model, validated on CPU runs
(benchmarks/runtime.py), applied where no GPU is at hand.

Scenarios: DeepSeek-V3 (58 MoE layers x 256 experts, top-8) on 8 nodes x 8 H100 (h100-sxm),
Mixtral-8x7B (32 x 8, top-2) on 2 nodes x 4 A100 (a100-sxm), and the tiny GQA and MLA models of
examples/hf_tiny/kv_rows.py (the shapes benchmarks/runtime.py measures on CPU) on 1 x 2 and 2 x 2
H100s. For each: contiguous + standard EP,
EPLB (one redundant slot per GPU) + standard EP, and the planner's choice (`--policy auto
--mode auto` under the same profile), as predicted decode and overall tokens/s and ratios to
contiguous + standard, beside ExFlow's reported 2.2x (MoE-16 on 8 A100s over DeepSpeed-MoE);
coherent mode on the chosen placement with the hidden state as context row and with the
runtime's own per-block choice (`runtime/ep/context_exchange.py`: K/V or the MLA latent
where smaller).

Assumptions (all of them; change with the flags):
* routing: no trace of these models is at hand, so a planted synthetic trace
  (`passes/analysis/trace/synth_planted.py`) with inter-layer affinity `--affinity` (0.5) and Zipf
  popularity `--zipf` (1.0), `--trace-tokens` tokens; placements are computed on it and the
  served tokens' routing is sampled from it;
* workload `--workload` (requests x prompt + new tokens, default per scenario below): the batch
  the whole deployment serves at once, round-robin over ranks;
* the runtime is ours: its exchanges (two all_to_all calls per exchange, counts then rows), its
  rows (hidden state in `--element-bytes`, default 2 = bf16 as production engines send, plus
  our int64 metadata), its framework calls per block at the profile's launch overhead, no
  CUDA graphs, no overlap of compute and communication, replica choice on the device;
* hardware: the profiles' published peak FLOP/s, HBM and link bandwidths (no efficiency
  factor), latencies estimated (see core/hardware_data/*.yaml sources);
* compute per rank: max(FLOPs / peak, weight bytes read / HBM bandwidth) + launches; the slowest
  rank sets each layer's pace.

    python benchmarks/cost_at_scale.py [--json]

With --json the last line is {"scenarios": [{"model", "hardware", "nodes", "gpus_per_node",
"workload", "rows": [{"plan", "policy", "redundant", "mode", "decode_tokens_per_second",
"tokens_per_second", "ratio", "total_bytes_per_token"}], "exflow_reported_ratio": 2.2}]}.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
KV_ROWS = REPO / "examples" / "hf_tiny" / "kv_rows.py"
SCENARIOS = (
    # name, model config (or "kv_rows:NAME", a tiny model of examples/hf_tiny/kv_rows.py), nodes, gpus per node,
    # hardware profile, default workload
    ("deepseek-v3", REPO / "examples" / "configs" / "deepseek-v3.json", 8, 8, "h100-sxm", "512x4+3"),
    ("mixtral-8x7b", REPO / "examples" / "configs" / "mixtral-8x7b.json", 2, 4, "a100-sxm", "256x16+4"),
    ("tiny-gqa-2", "kv_rows:gqa", 1, 2, "h100-sxm", "8x32+8"),
    ("tiny-gqa-4", "kv_rows:gqa", 2, 2, "h100-sxm", "8x32+8"),
    ("tiny-mla-2", "kv_rows:mla", 1, 2, "h100-sxm", "8x32+8"),
    ("tiny-mla-4", "kv_rows:mla", 2, 2, "h100-sxm", "8x32+8"),
)
EXFLOW_RATIO = 2.2


def model_path(config, scratch: Path) -> str:
    """A config path as is; "kv_rows:NAME" built (seeded) under scratch."""
    if str(config).startswith("kv_rows:"):
        from moeplan.passes.importers.resolve import import_file

        return str(import_file(KV_ROWS).build(str(config).split(":", 1)[1], scratch))
    return str(config)


def scenario(name, config, nodes, per_node, hardware, workload_text, args, scratch: Path) -> dict:
    from moeplan.passes.cost.cost_model import ModelShape
    from moeplan.passes.analysis.trace.synth_planted import synthesize_trace
    from moeplan.passes.cost.by_predicted_time import choose_placement, predict_modes
    from moeplan.passes.optimize.placement.schema import Topology
    from moeplan.passes.optimize.placement.policies import PlacementRequest, plan_placement
    from moeplan.core.hardware import load_hardware
    from moeplan.passes.importers import load_model
    from moeplan.passes.cost.context import context_plan_of, shape_with_context
    from moeplan.passes.cost.options import parse_workload

    loaded = load_model(model_path(config, scratch))
    ir = loaded.ir
    moe = ir.moe_stages[0]
    context = context_plan_of(loaded.module)  # the runtime's context rows: hidden state or K/V / MLA latent, per block
    shape = replace(shape_with_context(ir, context), element_bytes=args.element_bytes)
    hidden_shape = replace(ModelShape.from_ir(ir), element_bytes=args.element_bytes)
    trace = synthesize_trace(layers=len(ir.moe_stages), experts=moe.num_experts, top_k=moe.top_k,
                             tokens=args.trace_tokens, affinity=args.affinity, zipf=args.zipf, seed=0)
    profile = load_hardware(hardware)
    workload = parse_workload(args.workload or workload_text)
    topology = Topology(nodes, per_node)
    D = topology.devices
    base = PlacementRequest(topology=topology, time_limit=args.time_limit, effort=args.effort)

    def priced(label, placement, mode, policy, redundant, model_shape=shape):
        p = predict_modes(placement.hosts(), per_node, model_shape, workload, trace.experts, profile, (mode,))[mode]
        decode = p["seconds_per_decode_step"]
        return {"plan": label, "policy": policy, "redundant": redundant, "mode": mode,
                "seconds_per_token": p["seconds_per_token"], "tokens_per_second": 1.0 / p["seconds_per_token"],
                "decode_tokens_per_second": len(workload.prompt_lengths) / decode if decode else 0.0,
                "total_bytes_per_token": p["total_bytes_per_token"], "compute_share": p["compute_share"]}

    rows = [priced("contiguous + standard", plan_placement(trace, replace(base, policy="contiguous")), "standard",
                   "contiguous", 0),
            priced("eplb + standard", plan_placement(trace, replace(base, policy="eplb", redundant=D)), "standard", "eplb", D)]
    chosen, table, _ = choose_placement(trace, base, shape, profile, workload, "auto")
    mode = next(r["mode"] for r in table if r["chosen"])
    redundant = int(chosen.metrics.get("redundant", 0))
    rows.append(priced("planner's choice", chosen, mode, chosen.policy, redundant))
    # coherent mode on the planner's placement: with the hidden state as the context row (the runtime
    # before item 5, `serve --context hidden`) and as the runtime ships it (K/V or the MLA latent where smaller)
    rows.append(priced("choice + coherent, hidden", chosen, "coherent", chosen.policy, redundant, hidden_shape))
    kinds = sorted({f"{k} {n}" for k, n in context}) or ["hidden"]
    rows.append(priced(f"choice + coherent, {'/'.join(kinds)}", chosen, "coherent", chosen.policy, redundant))
    for row in rows:
        row["ratio"] = rows[0]["seconds_per_token"] / row["seconds_per_token"]
        row["decode_ratio"] = row["decode_tokens_per_second"] / rows[0]["decode_tokens_per_second"]
    return {"model": name, "hardware": hardware, "nodes": nodes, "gpus_per_node": per_node,
            "workload": args.workload or workload_text, "rows": rows, "candidates": table, "context": context,
            "exflow_reported_ratio": EXFLOW_RATIO,
            "assumptions": {"affinity": args.affinity, "zipf": args.zipf, "trace_tokens": args.trace_tokens,
                            "element_bytes": args.element_bytes}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=[s[0] for s in SCENARIOS], default=None, nargs="?")
    ap.add_argument("--affinity", type=float, default=0.5)
    ap.add_argument("--zipf", type=float, default=1.0)
    ap.add_argument("--trace-tokens", type=int, default=4096)
    ap.add_argument("--workload", default=None, help="REQUESTSxPROMPT+NEW for every scenario (default: per scenario)")
    ap.add_argument("--element-bytes", type=int, default=2, help="bytes per hidden element on the wire")
    ap.add_argument("--time-limit", type=float, default=60.0)
    ap.add_argument("--effort", type=float, default=0.3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="moeplan-scale-") as scratch:
        out = [scenario(*s, args, Path(scratch)) for s in SCENARIOS if args.only in (None, s[0])]
    for sc in out:
        print(f"{sc['model']} on {sc['nodes']}x{sc['gpus_per_node']} {sc['hardware']}, workload {sc['workload']} "
              f"(ExFlow reports up to {EXFLOW_RATIO}x on MoE-16 / 8 A100s)")
        print(f"  {'plan':<32} {'policy':>10} {'mode':>9} {'tok/s':>10} {'ratio':>6} {'decode tok/s':>13} {'ratio':>6} "
              f"{'B/token':>10} {'compute':>8}")
        for r in sc["rows"]:
            print(f"  {r['plan']:<32} {r['policy'] + ('+' + str(r['redundant']) if r['redundant'] else ''):>10} "
                  f"{r['mode']:>9} {r['tokens_per_second']:>10.0f} {r['ratio']:>6.2f} {r['decode_tokens_per_second']:>13.0f} "
                  f"{r['decode_ratio']:>6.2f} {r['total_bytes_per_token']:>10.0f} {r['compute_share']:>8.2f}")
    if args.json:
        print(json.dumps({"scenarios": out}, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
