"""`moeplan run BUNDLE [--verify]` for torchrun bundles: launch, then check what the ranks report.

The bundle is validated first (manifest hashes, shards, world size) so a tampered bundle stops
with one line before any rank starts; `planner/launch/torchrun_launch.py` starts the ranks. With
--verify the outputs are compared with the source model shipped in the bundle, run at the precision
the ranks held (`planner/launch/torchrun_verify.py`: max |logit diff| within `LOGIT_TOLERANCE` of
that precision, identical greedy tokens), and in
coherent mode the measured gpu_local_fraction must equal the placement metric of
`passes/optimize/placement/metrics.py` on the routing of the same tokens.
"""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

from moeplan.planner.launch.torchrun_launch import failure_reason, launch, read_prompts
from moeplan.core import progress
from moeplan.core.errors import UserError
from moeplan.planner.launch.open_bundle import open_bundle

# max |logit diff| against the source model at the same precision, by the dtype the ranks held
# (runtime/precision.py). float32: the runtime and the library sum the same terms in other orders.
# bfloat16: each side rounds every activation to 8 significand bits, and at 2 ranks the experts'
# partial sums meet in another order: qwen3_moe_hd32 in bfloat16 measured 0 at 1 rank and 0.0625 (one
# bfloat16 step at its logits' magnitude) at 2 ranks in both modes; the bound leaves 4x. float16 (GPUs
# only: CPUs hold it as bfloat16) rounds to 11 bits, 8x finer: bfloat16's bound / 8, rounded up, unmeasured.
LOGIT_TOLERANCE = {"float32": 1e-4, "bfloat16": 0.25, "float16": 0.04}


def predicted_locality(root: Path, out_dir: Path) -> float:
    """The planner's gpu_local_fraction for the tokens this run routed, under the bundle's placement."""
    import torch

    from moeplan.passes.analysis.trace.format import make_trace
    from moeplan.passes.optimize.placement.metrics import score_placement
    from moeplan.passes.optimize.placement.schema import placement_from_dict

    placement = placement_from_dict(json.loads((root / "placement.json").read_text()))
    routing = torch.load(out_dir / "routing.pt", weights_only=True)
    trace = make_trace(routing["experts"].numpy(), routing["weights"].numpy(), num_experts=placement.num_experts)
    return score_placement(trace, placement.hosts(), placement.topology).gpu_local_fraction


def run_bundle(bundle: str, nproc: int | None, prompts_path: str | None, new_tokens: int, mode: str, verify: bool,
               results: str | None, timeout: float) -> dict:
    """Launch, check and report one mode (see `run_modes`)."""
    return run_modes(bundle, nproc, prompts_path, new_tokens, (mode,), verify, results, timeout)[mode]


def run_modes(bundle: str, nproc: int | None, prompts_path: str | None, new_tokens: int, modes: tuple, verify: bool,
              results: str | None, timeout: float, context: str = "auto") -> dict:
    """One torchrun launch running every mode in turn on the same prompts; {mode: report}.
    `context`: coherent mode's context exchange (auto: hidden state or K/V per block; hidden)."""
    root = Path(bundle)
    plan = open_bundle(root, nproc)
    world = int(plan["topology"]["nodes"]) * int(plan["topology"]["gpus_per_node"])
    if new_tokens < 1:
        raise UserError(f"--new-tokens must be at least 1, got {new_tokens}")
    with tempfile.TemporaryDirectory(prefix="moeplan-run-") as scratch:
        scratch = Path(scratch)
        prompts = read_prompts(prompts_path)
        prompts_file = Path(prompts_path) if prompts_path is not None else scratch / "prompts.txt"
        if prompts_path is None:
            prompts_file.write_text("\n".join(prompts) + "\n")
        out_dir = Path(results) if results else scratch / "results"
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UserError(f"cannot create --results '{out_dir}' ({exc.strerror or exc}); choose a writable directory") from None
        with progress.step(f"running {world} rank{'s' if world > 1 else ''} ({', '.join(modes)}) with torchrun"):
            proc = launch(root, world, prompts_file, new_tokens, ",".join(modes), out_dir, timeout, context)
        if proc.returncode != 0:
            reason = failure_reason(proc.stderr + "\n" + proc.stdout)
            raise UserError(f"the bundle's ranks failed (exit {proc.returncode}): {reason}")
        reference_cache = {}
        with progress.step("verifying against the source model" if verify else "reading the ranks' results"):
            reports = {mode: _report(root, plan, world, mode, out_dir / mode, new_tokens, verify, reference_cache, context)
                       for mode in modes}
        encoding = [l[len("prompts: "):] for l in proc.stdout.splitlines() if l.startswith("prompts: ")]
        for report in reports.values():  # how the runtime read the prompts (tokenizer.json or byte fallback)
            report["prompt_encoding"] = encoding[0] if encoding else "unknown"
    return reports


def _report(root: Path, plan: dict, world: int, mode: str, out_dir: Path, new_tokens: int, verify: bool,
            reference_cache: dict, context: str = "auto") -> dict:
    summary = json.loads((out_dir / "result.json").read_text())
    report = {
        "mode": mode, "world_size": world, "texts": summary["texts"],
        "gpu_local_fraction": summary["gpu_local_fraction"],
        "predicted_gpu_local_fraction": predicted_locality(root, out_dir),  # the placement metric on this run's routing
        "plan_gpu_local_fraction": plan.get("predicted", {}).get("gpu_local_fraction"),  # ... and on the planning trace
        "bytes_per_token": summary["bytes_per_token"],
        "messages_per_token": summary["messages_per_token"],
        "total_bytes_per_token": summary["total_bytes_per_token"],
        "tokens_per_second": summary["tokens_per_second"],
        "per_layer": summary["per_layer"], "totals": summary["totals"],
        "weight_dtype": summary.get("weight_dtype", "float32"),  # what the ranks held (runtime/precision.py)
        "expert_weight_dtype": summary.get("expert_weight_dtype", summary.get("weight_dtype", "float32")),
    }
    from moeplan.passes.cost.run_check import measured_beside_predicted  # issue 12: the cost model, checked

    report.update(measured_beside_predicted(root, plan, out_dir, mode, summary, context))
    if plan["communication"].get("expert_cache"):  # issue 13: measured cache counters beside the simulator's
        from moeplan.passes.optimize.offload.run_check import cache_beside_simulation

        report.update(cache_beside_simulation(root, plan, out_dir, summary))
    if verify:
        from moeplan.planner.launch.torchrun_verify import VerifyError, compare

        try:
            report.update(compare(root, plan, out_dir, new_tokens, reference_cache))
        except VerifyError as exc:
            raise UserError(str(exc)) from None
        locality_ok = mode != "coherent" or abs(report["gpu_local_fraction"] - report["predicted_gpu_local_fraction"]) < 1e-9
        report["locality_matches_prediction"] = locality_ok
        cache = report.get("expert_cache", {"matches_simulation": True, "requests_match_routing": True})
        report["logit_tolerance"] = LOGIT_TOLERANCE[report["weight_dtype"]]
        report["verified"] = bool(report["tokens_match"] and report["max_abs_logit_diff"] <= report["logit_tolerance"] and locality_ok
                                  and cache["matches_simulation"] and cache["requests_match_routing"])
    return report
