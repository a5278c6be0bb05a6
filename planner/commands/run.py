"""`moeplan run DIR --verify`: launch a bundle locally with torchrun and check it.

The bundle is validated first (manifest hashes, shards, world size) so a tampered bundle stops
with one line before any rank starts. The ranks run as `torchrun --standalone` on this machine
(gloo on CPU, nccl if GPUs are visible), from the bundle's own `runtime/`. With --verify the
outputs are compared with the source model shipped in the bundle (max |logit diff| <= 1e-4,
identical greedy tokens), and in coherent mode the measured gpu_local_fraction must equal the
planner's metric on the routing of the same tokens.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import click

from moeplan.planner import cli_types as T
from moeplan.planner.errors import UserError

DEFAULT_PROMPTS = ("The quick brown fox", "Once upon a time", "import torch\n", "Mixture of experts")
LOGIT_TOLERANCE = 1e-4


def launch(root: Path, nproc: int, prompts_file: Path, new_tokens: int, mode: str, out_dir: Path,
           timeout: float) -> subprocess.CompletedProcess:
    """torchrun --standalone with the bundle's runtime; returns the finished process."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1")
    env.pop("PYTHONPATH", None)  # the bundle must run from its own runtime/
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           "-m", "runtime.serve", "--prompts", str(prompts_file.resolve()), "--new-tokens", str(new_tokens),
           "--mode", mode, "--out", str(out_dir.resolve())]
    try:
        return subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise UserError(f"the bundle did not finish within {timeout:.0f} s; raise --timeout or lower --new-tokens")


def read_prompts(path: Path) -> list:
    """The non-empty lines of a UTF-8 text file; one-line UserErrors for anything else."""
    if not path.is_file():
        raise UserError(f"prompts file '{path}' does not exist; give a text file with one prompt per line")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise UserError(f"prompts file '{path}' is not UTF-8 text; give a text file with one prompt per line") from None
    except OSError as exc:
        raise UserError(f"cannot read prompts file '{path}' ({exc.strerror or exc})") from None
    if "\0" in text:
        raise UserError(f"prompts file '{path}' is binary; give a text file with one prompt per line")
    prompts = [line for line in text.splitlines() if line.strip()]
    if not prompts:
        raise UserError(f"prompts file '{path}' holds no prompt; write one prompt per line")
    return prompts


def failure_reason(output: str) -> str:
    """The line that says why the ranks stopped: the runtime's own `error:` line, else a rank's exception."""
    lines = output.splitlines()
    own = [l for l in lines if l.startswith("error:")]
    if own:
        return own[0]
    raised = [l for l in lines if re.match(r"^\[rank\d+\]: [\w.]*(Error|Exception)\b", l)]
    if raised:
        return raised[0]
    return next((l for l in reversed(lines) if l.strip()), "no output")


def predicted_locality(root: Path, out_dir: Path) -> float:
    """The planner's gpu_local_fraction for the tokens this run routed, under the bundle's placement."""
    import torch

    from moeplan.passes.analysis.trace.format import make_trace
    from moeplan.passes.optimize.placement.metrics import score_placement
    from moeplan.passes.optimize.placement.decision import placement_from_dict

    placement = placement_from_dict(json.loads((root / "placement.json").read_text()))
    routing = torch.load(out_dir / "routing.pt", weights_only=True)
    trace = make_trace(routing["experts"].numpy(), routing["weights"].numpy(), num_experts=placement.num_experts)
    return score_placement(trace, placement.hosts(), placement.topology).gpu_local_fraction


def run_bundle(bundle: str, nproc: int | None, prompts_path: str | None, new_tokens: int, mode: str, verify: bool,
               results: str | None, timeout: float) -> dict:
    """Launch, check and report one mode (see `run_modes`)."""
    return run_modes(bundle, nproc, prompts_path, new_tokens, (mode,), verify, results, timeout)[mode]


def run_modes(bundle: str, nproc: int | None, prompts_path: str | None, new_tokens: int, modes: tuple, verify: bool,
              results: str | None, timeout: float) -> dict:
    """One torchrun launch running every mode in turn on the same prompts; {mode: report}."""
    from moeplan.backends.common.manifest import BundleCheckError, check_bundle

    root = Path(bundle)
    try:
        plan = check_bundle(root, nproc)
    except BundleCheckError as exc:
        raise UserError(str(exc)) from None
    world = int(plan["topology"]["nodes"]) * int(plan["topology"]["gpus_per_node"])
    if new_tokens < 1:
        raise UserError(f"--new-tokens must be at least 1, got {new_tokens}")
    with tempfile.TemporaryDirectory(prefix="moeplan-run-") as scratch:
        scratch = Path(scratch)
        if prompts_path is None:
            prompts_file = scratch / "prompts.txt"
            prompts_file.write_text("\n".join(p.replace("\n", " ") for p in DEFAULT_PROMPTS) + "\n")
        else:
            prompts_file = Path(prompts_path)
            read_prompts(prompts_file)
        out_dir = Path(results) if results else scratch / "results"
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UserError(f"cannot create --results '{out_dir}' ({exc.strerror or exc}); choose a writable directory") from None
        proc = launch(root, world, prompts_file, new_tokens, ",".join(modes), out_dir, timeout)
        if proc.returncode != 0:
            reason = failure_reason(proc.stderr + "\n" + proc.stdout)
            raise UserError(f"the bundle's ranks failed (exit {proc.returncode}): {reason}")
        reference_cache = {}
        reports = {mode: _report(root, plan, world, mode, out_dir / mode, new_tokens, verify, reference_cache)
                   for mode in modes}
    return reports


def _report(root: Path, plan: dict, world: int, mode: str, out_dir: Path, new_tokens: int, verify: bool,
            reference_cache: dict) -> dict:
    summary = json.loads((out_dir / "result.json").read_text())
    report = {
        "mode": mode, "world_size": world, "texts": summary["texts"],
        "gpu_local_fraction": summary["gpu_local_fraction"],
        "predicted_gpu_local_fraction": predicted_locality(root, out_dir),
        "bytes_per_token": summary["bytes_per_token"],
        "messages_per_token": summary["messages_per_token"],
        "total_bytes_per_token": summary["total_bytes_per_token"],
        "tokens_per_second": summary["tokens_per_second"],
        "per_layer": summary["per_layer"], "totals": summary["totals"],
    }
    if verify:
        from moeplan.backends.torchrun.verify import VerifyError, compare

        try:
            report.update(compare(root, plan, out_dir, new_tokens, reference_cache))
        except VerifyError as exc:
            raise UserError(str(exc)) from None
        locality_ok = mode != "coherent" or abs(report["gpu_local_fraction"] - report["predicted_gpu_local_fraction"]) < 1e-9
        report["locality_matches_prediction"] = locality_ok
        report["verified"] = bool(report["tokens_match"] and report["max_abs_logit_diff"] <= LOGIT_TOLERANCE and locality_ok)
    return report


@click.command("run")
@click.argument("bundle", type=click.Path())
@click.option("--verify", is_flag=True, help="compare logits and tokens with the source model")
@click.option("--nproc", type=T.POSITIVE_INT, default=None, help="ranks to launch (must equal the plan's world size)")
@click.option("--prompts", "prompts_path", default=None, help="text file, one prompt per line")
@click.option("--new-tokens", type=T.POSITIVE_INT, default=8, show_default=True)
@click.option("--mode", type=click.Choice(["coherent", "standard", "both"]), default="coherent", show_default=True,
              help="context-coherent EP, standard EP, or both in one launch")
@click.option("--results", default=None, type=click.Path(file_okay=False), help="keep the ranks' results here")
@click.option("--timeout", type=T.POSITIVE_FLOAT, default=600.0, show_default=True, help="seconds before the run is abandoned")
@click.option("--trusted-key", type=click.Path(dir_okay=False), default=None,
              help="ed25519 public key (PEM): run BUNDLE only if its manifest is signed by it (docs/security.md)")
@click.option("--json", "as_json", is_flag=True, help="print the report as one JSON object")
def run(bundle, verify, nproc, prompts_path, new_tokens, mode, results, timeout, trusted_key, as_json):
    """Launch BUNDLE locally (torchrun standalone, or a Lambda bundle's state machine) and report."""
    if trusted_key is not None:
        from moeplan.backends.common.signing import SigningError, verify_bundle_signature

        try:
            verify_bundle_signature(bundle, trusted_key)
        except SigningError as exc:
            raise UserError(str(exc)) from None
    if _target(bundle) == "lambda":
        return _run_lambda(bundle, verify, prompts_path, new_tokens, as_json)
    modes = ("coherent", "standard") if mode == "both" else (mode,)
    reports = run_modes(bundle, nproc, prompts_path, new_tokens, modes, verify, results, timeout)
    keys = ("verified", "max_abs_logit_diff", "tokens_match", "gpu_local_fraction", "predicted_gpu_local_fraction",
            "bytes_per_token", "tokens_per_second", "messages_per_token", "total_bytes_per_token", "mode",
            "world_size", "locality_matches_prediction")
    as_dicts = {m: {k: r[k] for k in keys if k in r} | {"per_layer": r["per_layer"]} for m, r in reports.items()}
    if as_json:
        click.echo(json.dumps(as_dicts[mode] if mode != "both" else {"modes": as_dicts}, sort_keys=True))
    else:
        for report in reports.values():
            _print(report, verify)
    if verify and not all(r["verified"] for r in reports.values()):
        sys.exit(1)


def _target(bundle: str):
    try:
        return json.loads((Path(bundle) / "plan.json").read_text()).get("target")
    except (OSError, ValueError, AttributeError):
        return None


def _run_lambda(bundle, verify, prompts_path, new_tokens, as_json):
    """Lambda bundles: the state machine runs locally (backends/lambda_/local_run.py)."""
    from moeplan.backends.lambda_.local_run import run_lambda_bundle

    if new_tokens < 1:
        raise UserError(f"--new-tokens must be at least 1, got {new_tokens}")
    if prompts_path is None:
        prompts = [p.replace("\n", " ") for p in DEFAULT_PROMPTS]
    else:
        prompts = read_prompts(Path(prompts_path))
    report = run_lambda_bundle(bundle, prompts, new_tokens, verify)
    if as_json:
        click.echo(json.dumps(report, sort_keys=True))
    else:
        for i, text in enumerate(report["texts"]):
            click.echo(f"  [{i}] {text!r}")
        sb = report["storage_bytes"]
        click.echo(f"{report['requests']} request(s): {report['invocations']} invocations {report['invocations_by_kind']}, "
                   f"{report['state_transitions']} state transitions; storage {sb['total']} bytes "
                   f"(functions get {sb['functions_get']} / put {sb['functions_put']}), payloads {report['payload_bytes']} bytes "
                   f"(largest {report['max_payload_bytes']} <= {report['payload_limit_bytes']})")
        click.echo(f"billed {report['billed_gb_s']:.3f} GB-s at the planned memory (${report['billed_usd']:.8f}) "
                   f"from {report['measured_seconds']:.2f} s measured in the handlers")
        if verify:
            click.echo(f"verify {'PASS' if report['verified'] else 'FAIL'}: max |logit diff| {report['max_abs_logit_diff']:.2e} "
                       f"(<= {LOGIT_TOLERANCE:g}), tokens {'identical' if report['tokens_match'] else 'DIFFER'}")
    if verify and not report["verified"]:
        sys.exit(1)


def _print(report: dict, verify: bool) -> None:
    click.echo(f"{report['world_size']} ranks, mode {report['mode']}: {report['tokens_per_second']:.1f} tokens/s")
    for i, text in enumerate(report["texts"]):
        click.echo(f"  [{i}] {text!r}")
    click.echo("  layer  all-to-all bytes  messages  context bytes  local slots")
    for layer in report["per_layer"]:
        local = f"{layer['local_slots']}/{layer['slots']}" if layer["slots"] else "-"
        click.echo(f"  {layer['layer']:>5}  {layer['all_to_all_bytes']:>16}  {layer['all_to_all_messages']:>8}"
                   f"  {layer['context_bytes']:>13}  {local:>11}")
    click.echo(f"  all-to-all bytes per generated token {report['bytes_per_token']:.0f} "
               f"({report['messages_per_token']:.2f} messages); all traffic {report['total_bytes_per_token']:.0f}")
    if report["mode"] == "coherent":
        click.echo(f"  gpu_local_fraction measured {report['gpu_local_fraction']:.4f}, "
                   f"predicted {report['predicted_gpu_local_fraction']:.4f}")
    else:
        click.echo(f"  gpu_local_fraction measured {report['gpu_local_fraction']:.4f} (slots on the home rank; "
                   f"the planner's {report['predicted_gpu_local_fraction']:.4f} is for coherent mode)")
    if verify:
        verdict = "PASS" if report["verified"] else "FAIL"
        click.echo(f"verify {verdict}: max |logit diff| {report['max_abs_logit_diff']:.2e} (<= {LOGIT_TOLERANCE:g}), "
                   f"tokens {'identical' if report['tokens_match'] else 'DIFFER'}"
                   + ("" if report["locality_matches_prediction"] else ", gpu_local_fraction differs from the prediction"))
