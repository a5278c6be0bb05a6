"""`moeplan run DIR [--verify]`: launch a bundle locally and report (the flags and the printing only).

torchrun bundles: `planner/pipeline/run.py` checks the bundle, launches its ranks
(`planner/launch/torchrun_launch.py`) and verifies them; Lambda bundles run their state machine locally
(`planner/launch/lambda_run.py`).
"""
from __future__ import annotations

import json
import sys

import click

from moeplan.core import cli_types as T
from moeplan.core import progress
from moeplan.core.engine_layout import ENGINE_TARGETS
from moeplan.core.errors import UserError
from moeplan.passes.cost.options import workload_words
from moeplan.planner.launch.open_bundle import open_bundle
from moeplan.planner.pipeline.run import run_modes

ENGINE_NAMES = {"sglang": "SGLang", "vllm": "vLLM", "trtllm": "TensorRT-LLM"}


@click.command("run", short_help="Launch a bundle locally and report; --verify checks it against the source model.")
@click.argument("bundle", type=click.Path())
@click.option("--verify", is_flag=True, help="compare logits and tokens with the source model")
@click.option("--nproc", type=T.POSITIVE_INT, default=None, help="ranks to launch (must equal the plan's world size)")
@click.option("--prompts", "prompts_path", default=None, help="text file, one prompt per line")
@click.option("--new-tokens", type=T.POSITIVE_INT, default=8, show_default=True)
@click.option("--mode", type=click.Choice(["coherent", "standard", "both"]), default=None,
              help="context-coherent EP, standard EP, or both in one launch (default: the mode the plan chose)")
@click.option("--results", default=None, type=click.Path(file_okay=False), help="keep the ranks' results here")
@click.option("--timeout", type=T.POSITIVE_FLOAT, default=600.0, show_default=True, help="seconds before the run is abandoned")
@click.option("--trusted-key", type=click.Path(dir_okay=False), default=None,
              help="ed25519 public key (PEM): run BUNDLE only if its manifest is signed by it (docs/security.md)")
@click.option("--json", "as_json", is_flag=True, help="print the report as one JSON object")
def run(bundle, verify, nproc, prompts_path, new_tokens, mode, results, timeout, trusted_key, as_json):
    """Launch BUNDLE locally (torchrun standalone, or a Lambda bundle's state machine) and report."""
    plan = open_bundle(bundle, trusted_key=trusted_key, check_files=False)  # the files: by the target's run below
    target = plan.get("target")
    if target == "lambda":
        return _run_lambda(bundle, verify, prompts_path, new_tokens, as_json)
    if target in ENGINE_TARGETS:
        raise UserError(f"'{bundle}' is a {target} bundle: engine bundles run in their engine (its launch.sh starts "
                        f"{ENGINE_NAMES.get(target, target)}; docs/interop.md), not under 'moeplan run'")
    if target == "offload":
        raise UserError(f"'{bundle}' holds an offload plan, which has no bundle yet; 'moeplan simulate' replays it")
    from moeplan.runtime.bundle_io import run_modes as plan_modes

    modes = ("coherent", "standard") if mode == "both" else tuple(plan_modes(plan, mode))
    with progress.silenced(as_json):
        reports = run_modes(bundle, nproc, prompts_path, new_tokens, modes, verify, results, timeout)
    keys = ("verified", "max_abs_logit_diff", "tokens_match", "gpu_local_fraction", "predicted_gpu_local_fraction",
            "bytes_per_token", "tokens_per_second", "messages_per_token", "total_bytes_per_token", "mode",
            "world_size", "locality_matches_prediction", "predicted_bytes_per_token", "predicted_total_bytes_per_token",
            "predicted_messages_per_token", "seconds_per_token", "predicted_seconds_per_token", "bytes_match_prediction",
            "predicted_hardware", "load_average", "calibration_load_average", "prompt_encoding", "expert_cache",
            "workload", "plan_workload", "plan_seconds_per_token", "plan_total_bytes_per_token", "plan_gpu_local_fraction",
            "plan_decode_steps",
            "weight_dtype", "expert_weight_dtype", "logit_tolerance")
    as_dicts = {m: {k: r[k] for k in keys if k in r} | {"per_layer": r["per_layer"]} for m, r in reports.items()}
    if as_json:
        click.echo(json.dumps(as_dicts[modes[0]] if mode != "both" else {"modes": as_dicts}, sort_keys=True))
    else:
        for report in reports.values():
            _print(report, verify)
    if verify and not all(r["verified"] for r in reports.values()):
        sys.exit(1)


def _run_lambda(bundle, verify, prompts_path, new_tokens, as_json):
    """Lambda bundles: the state machine runs locally (planner/launch/lambda_run.py)."""
    from moeplan.planner.launch.lambda_run import run_lambda_bundle
    from moeplan.planner.launch.torchrun_launch import read_prompts

    if new_tokens < 1:
        raise UserError(f"--new-tokens must be at least 1, got {new_tokens}")
    prompts = read_prompts(prompts_path)
    with progress.silenced(as_json), progress.step("running the state machine's functions locally"):
        report = run_lambda_bundle(bundle, prompts, new_tokens, verify)
    if as_json:
        click.echo(json.dumps(report, sort_keys=True))
    else:
        for i, text in enumerate(report["texts"]):
            click.echo(f"  [{i}] {text!r}")
        sb = report["storage_bytes"]
        click.echo(f"{report['new_tokens']} token(s) per prompt in {report['executions']} execution(s): "
                   f"{report['invocations']} invocations {report['invocations_by_kind']}, "
                   f"{report['state_transitions']} state transitions; storage {sb['total']} bytes "
                   f"(functions get {sb['functions_get']} / put {sb['functions_put']}), payloads {report['payload_bytes']} bytes "
                   f"(largest {report['max_payload_bytes']} <= {report['payload_limit_bytes']})")
        usd, req = report["billed_usd_by_charge"], report["storage_requests"]
        click.echo(f"billed {report['billed_gb_s']:.3f} GB-s at the planned memory from {report['measured_seconds']:.2f} s "
                   f"measured in the handlers: ${usd['total']:.8f} with the request fees, the functions' "
                   f"{req['functions_put']} S3 PUTs and {req['functions_get']} GETs (${usd['s3_requests']:.8f}) and the "
                   f"EXPRESS execution(s) (${usd['express']:.8f})")
        if verify:
            from moeplan.planner.launch.lambda_run import LOGIT_TOLERANCE as LAMBDA_LOGIT_TOLERANCE

            click.echo(f"verify {'PASS' if report['verified'] else 'FAIL'}: max |logit diff| {report['max_abs_logit_diff']:.2e} "
                       f"(<= {LAMBDA_LOGIT_TOLERANCE:g}), tokens {'identical' if report['tokens_match'] else 'DIFFER'}")
    if verify and not report["verified"]:
        sys.exit(1)


def plan_figure_basis(report: dict) -> str:
    """What the plan's own figure was priced for, beside this run's: another workload, and on GPU profiles a
    service whose decode steps replay CUDA graphs (plan.json `predicted.cost.decode_steps`), which a static run's
    eager steps are not."""
    if report.get("plan_decode_steps") == "cuda graphs":
        return "for another workload and for a service (its decode steps replayed as CUDA graphs; this run's are eager)"
    return "for another workload"


def _loads(report: dict) -> str:
    """', load average L; calibrated at load C' where known: a CPU's measured time follows its load."""
    text = "" if report.get("load_average") is None else f", load average {report['load_average']:.1f}"
    if report.get("calibration_load_average") is not None:
        text += f"; calibrated at load {report['calibration_load_average']:.1f}"
    return text


def _print(report: dict, verify: bool) -> None:
    click.echo(f"{report['world_size']} ranks, mode {report['mode']}: {report['tokens_per_second']:.1f} tokens/s")
    click.echo(f"  prompts read as: {report.get('prompt_encoding', 'unknown')}")
    for i, text in enumerate(report["texts"]):
        click.echo(f"  [{i}] {text!r}")
    click.echo("  layer  all-to-all bytes  messages  context bytes  local slots")
    for layer in report["per_layer"]:
        local = f"{layer['local_slots']}/{layer['slots']}" if layer["slots"] else "-"
        click.echo(f"  {layer['layer']:>5}  {layer['all_to_all_bytes']:>16}  {layer['all_to_all_messages']:>8}"
                   f"  {layer['context_bytes']:>13}  {local:>11}")
    click.echo(f"  all-to-all bytes per generated token {report['bytes_per_token']:.0f} "
               f"({report['messages_per_token']:.2f} messages); all traffic {report['total_bytes_per_token']:.0f}")
    if "predicted_total_bytes_per_token" in report:
        click.echo(f"  predicted for this run ({report['workload']}: its own prompts, routed as this run routed them): "
                   f"all traffic {report['predicted_total_bytes_per_token']:.0f} B/token, "
                   f"{report['predicted_seconds_per_token'] * 1e3:.2f} ms/token on {report['predicted_hardware']} "
                   f"(measured {report['seconds_per_token'] * 1e3:.2f}{_loads(report)})")
        if report.get("plan_seconds_per_token") is not None:
            click.echo(f"  the plan's figure, {plan_figure_basis(report)}: {report['plan_seconds_per_token'] * 1e3:.2f} ms/token, "
                       f"{report['plan_total_bytes_per_token']:.0f} B/token in {report['mode']} mode for "
                       f"{report['plan_workload']} ({workload_words(report['plan_workload'])}) on the planning trace's routing")
    plan_text = ("" if report.get("plan_gpu_local_fraction") is None else
                 f"; the plan's {report['plan_gpu_local_fraction']:.4f} is on the planning trace")
    if report["mode"] == "coherent":
        click.echo(f"  gpu_local_fraction measured {report['gpu_local_fraction']:.4f}, predicted for this run's routing "
                   f"{report['predicted_gpu_local_fraction']:.4f}{plan_text}")
    else:
        click.echo(f"  gpu_local_fraction measured {report['gpu_local_fraction']:.4f} (slots on the home rank; "
                   f"the placement metric on this run's routing, {report['predicted_gpu_local_fraction']:.4f}, is for coherent "
                   f"mode{plan_text})")
    if "expert_cache" in report:  # issue 13: offloaded experts
        c = report["expert_cache"]
        m, p = c["measured"], c["simulated"]
        click.echo(f"  expert cache ({c['eviction']}, prefetch {c['prefetch']}, {c['capacity']} per rank): hit ratio "
                   f"{m['hit_ratio']:.4f} ({m['hits']}/{m['requests']}), {m['loads']} loads ({m['prefetches']} prefetched, "
                   f"{m['prefetch_hits']} of them hit), {m['bytes_moved']} bytes moved; simulated {p['hit_ratio']:.4f}, "
                   f"{p['loads']} loads ({p['prefetches']} prefetched, {p['prefetch_hits']} hit), {p['bytes_moved']} bytes; "
                   f"disk {m.get('disk_loads', 0)} loads {m.get('disk_bytes', 0)} bytes, host {m.get('host_loads', 0)} loads "
                   f"{m.get('host_bytes', 0)} bytes (simulated disk {p.get('disk_bytes', 0)}, host {p.get('host_bytes', 0)})"
                   + ("" if c["matches_simulation"] else " - DIFFERS")
                   + ("" if c["requests_match_routing"] else "; requests differ from the routing"))
        t = c["seconds_per_token"]
        click.echo(f"  expert cache time: measured {t['measured_wall'] * 1e3:.2f} ms/token (wall, this machine)"
                   + (f"; modelled {t['modelled_for_these_tokens'] * 1e3:.3f} ms/token for these tokens"
                      if t["modelled_for_these_tokens"] is not None else "")
                   + (f", planned {t['planned'] * 1e3:.3f} ms/token on held-out tokens" if t["planned"] is not None else ""))
    if verify:
        verdict = "PASS" if report["verified"] else "FAIL"
        click.echo(f"verify {verdict}: max |logit diff| {report['max_abs_logit_diff']:.2e} (<= {report['logit_tolerance']:g} "
                   f"at {report['weight_dtype']}"
                   + (f", experts {report['expert_weight_dtype']}"
                      if report.get("expert_weight_dtype", report["weight_dtype"]) != report["weight_dtype"] else "")
                   + "), "
                   f"tokens {'identical' if report['tokens_match'] else 'DIFFER'}"
                   + ("" if report["locality_matches_prediction"] else ", gpu_local_fraction differs from the prediction"))
