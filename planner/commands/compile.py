"""`moeplan compile MODEL --trace T --target torchrun --nodes N --gpus-per-node G --out DIR`.

Import -> affinity -> placement -> plan -> codegen through the PassManager; the bundle appears at
--out only when every pass succeeded. `--json` prints a summary object as the last line.
"""
from __future__ import annotations

import json

import click

from moeplan.planner import cli_types as T
from moeplan.planner.compile_pipeline import compile_bundle
from moeplan.planner.errors import UserError


@click.command("compile")
@click.argument("model")
@click.option("--trace", "trace_path", required=True, help="routing trace (.npz) recorded from MODEL")
@click.option("--target", type=click.Choice(["torchrun", "kubernetes", "lambda"]), default="torchrun", show_default=True,
              help="torchrun bundle, the same bundle plus kubernetes/ manifests, or an AWS Lambda (SAM) bundle")
@click.option("--nodes", type=T.POSITIVE_INT, default=1, show_default=True)
@click.option("--gpus-per-node", type=T.POSITIVE_INT, default=1, show_default=True)
@click.option("--policy", default="ilp", show_default=True, help="placement policy (see 'moeplan place --help')")
@click.option("--redundant", type=T.NON_NEGATIVE_INT, default=0, show_default=True, help="extra expert replicas per layer")
@click.option("--balance", type=T.NON_NEGATIVE_FLOAT, default=None, help="max device load over mean allowed by placement")
@click.option("--time-limit", type=T.POSITIVE_FLOAT, default=30.0, show_default=True,
              help="solver time limit, seconds (a safety net for ilp placement, whose work is set by --effort)")
@click.option("--effort", type=T.POSITIVE_FLOAT, default=1.0, show_default=True,
              help="ilp placement: work budget multiplier (deterministic; see 'moeplan place --help')")
@click.option("--mode", type=click.Choice(["coherent", "standard"]), default="coherent", show_default=True,
              help="expert-parallel mode the bundle runs by default")
@click.option("--image", type=T.NON_EMPTY_TEXT, default=None, help="kubernetes: container image of the rank pods")
@click.option("--storage-class", type=T.NON_EMPTY_TEXT, default=None, help="kubernetes: storage class of the weights volume")
@click.option("--slo", type=T.POSITIVE_FLOAT, default=None, help="lambda: end-to-end latency limit per batch, seconds")
@click.option("--methods", default="pipelined_s3,s3,direct", show_default=True, help="lambda: allowed scatter-gather methods")
@click.option("--batch-tokens", type=T.POSITIVE_INT, default=10240, show_default=True, help="lambda: tokens per request (batch)")
@click.option("--platform", "platform_file", default=None, help="lambda: YAML file overriding platform constants")
@click.option("--requests-per-second", type=T.POSITIVE_FLOAT, default=1.0, show_default=True,
              help="lambda: request rate the README's monthly cost is stated for")
@click.option("--cache-dir", default=None,
              help="lambda: profile cache directory (default $MOEPLAN_CACHE_DIR, else ~/.cache/moeplan/profiles)")
@click.option("--profile-from", type=click.Path(exists=True), default=None,
              help="lambda: reuse the profile recorded in this plan.json or bundle instead of measuring (reproduces it)")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="bundle directory to write")
@click.option("--sign-key", type=click.Path(dir_okay=False), default=None,
              help="ed25519 private key (PEM) to sign the bundle's manifest with (docs/security.md)")
@click.option("--json", "as_json", is_flag=True, help="print a JSON summary as the last line")
@click.option("--quiet", is_flag=True, help="no progress output")
def compile_cmd(model, trace_path, target, nodes, gpus_per_node, policy, redundant, balance, time_limit, effort, mode, image,
                storage_class, slo, methods, batch_tokens, platform_file, requests_per_second, cache_dir, profile_from, out, sign_key,
                as_json, quiet):
    """Compile MODEL with its routing trace into a runnable expert-parallel bundle."""
    signer = _signer(sign_key)
    if target == "lambda":
        if slo is None:
            raise UserError("--target lambda needs --slo SECONDS (end-to-end latency limit per batch)")
        if image is not None or storage_class is not None:
            raise UserError("--image and --storage-class apply to --target kubernetes only")
        from moeplan.planner.lambda_compile import compile_lambda

        summary = compile_lambda(model, trace_path, out, slo_s=slo, batch_tokens=batch_tokens, methods=methods,
                                 platform_file=platform_file, cache_dir=cache_dir, time_limit=time_limit,
                                 requests_per_second=requests_per_second, profile_from=profile_from)
        signer(out)
        if as_json:
            click.echo(json.dumps(summary, sort_keys=True))
        elif not quiet:
            click.echo(f"wrote {out}: {summary['functions']} functions ({summary['dense_slices']} dense slices), "
                       f"methods {', '.join(summary['methods'])}; predicted ${summary['cost_per_request_usd']:.8f} per request")
        return
    if slo is not None:
        raise UserError("--slo applies to --target lambda only")
    options = {"policy": policy, "redundant": redundant, "time_limit": time_limit, "effort": effort}
    if balance is not None:
        options["balance"] = balance
    target_spec = {"name": target}
    if target == "kubernetes":
        from moeplan.backends.kubernetes.codegen import DEFAULT_IMAGE

        target_spec.update(image=image or DEFAULT_IMAGE, storage_class=storage_class)
    elif image is not None or storage_class is not None:
        raise UserError("--image and --storage-class apply to --target kubernetes only")
    facts, timings = compile_bundle(model, trace_path, nodes, gpus_per_node, out, options, mode=mode,
                                    quiet=quiet or as_json, target=target_spec)
    signer(out)
    plan = facts["plan"].to_dict()
    summary = {
        "out": str(out), "target": target, "world_size": nodes * gpus_per_node,
        "policy": plan["placement"].get("policy", policy), "mode": mode,
        "predicted": {k: plan["predicted"][k] for k in ("gpu_local_fraction", "node_local_fraction", "max_over_mean_load")},
        "files": len(facts["manifest"]["files"]), "passes": timings,
    }
    if as_json:
        click.echo(json.dumps(summary, sort_keys=True))
    elif not quiet:
        p = summary["predicted"]
        click.echo(f"wrote {out}: {summary['world_size']} ranks, {summary['files']} files; predicted gpu_local_fraction "
                   f"{p['gpu_local_fraction']:.3f}, node_local_fraction {p['node_local_fraction']:.3f}, "
                   f"max/mean load {p['max_over_mean_load']:.3f}")


def _signer(sign_key):
    """Load --sign-key before any work (a bad key fails fast); returns bundle -> None that signs."""
    if sign_key is None:
        return lambda out: None
    from moeplan.backends.common.signing import SigningError, load_private_key, sign_bundle

    try:
        key = load_private_key(sign_key)
    except SigningError as exc:
        raise UserError(f"--sign-key: {exc}") from None
    return lambda out: sign_bundle(out, key)
