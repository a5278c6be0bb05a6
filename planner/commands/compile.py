"""`moeplan compile MODEL --trace T --target torchrun --nodes N --gpus-per-node G --out DIR`.

Import -> affinity -> placement -> plan -> codegen through the PassManager; the bundle appears at
--out only when every pass succeeded. `--json` prints a summary object as the last line.
"""
from __future__ import annotations

import json

import click

from moeplan.planner.compile_pipeline import compile_bundle
from moeplan.planner.errors import UserError


@click.command("compile")
@click.argument("model")
@click.option("--trace", "trace_path", required=True, help="routing trace (.npz) recorded from MODEL")
@click.option("--target", type=click.Choice(["torchrun", "kubernetes", "lambda", "sglang", "trtllm"]), default="torchrun",
              show_default=True, help="torchrun bundle, the same bundle plus kubernetes/ manifests, an AWS Lambda (SAM) "
              "bundle, or the placement files SGLang / TensorRT-LLM load (MODEL: a config is enough; docs/interop.md)")
@click.option("--nodes", type=int, default=1, show_default=True)
@click.option("--gpus-per-node", type=int, default=1, show_default=True)
@click.option("--policy", default=None, help="placement policy (see 'moeplan place --help'); default ilp, "
              "eplb for --target sglang/trtllm")
@click.option("--redundant", type=int, default=0, show_default=True, help="extra expert replicas per layer")
@click.option("--balance", type=float, default=None, help="max device load over mean allowed by placement")
@click.option("--time-limit", type=float, default=30.0, show_default=True,
              help="solver time limit, seconds (a safety net for ilp placement, whose work is set by --effort)")
@click.option("--effort", type=float, default=1.0, show_default=True,
              help="ilp placement: work budget multiplier (deterministic; see 'moeplan place --help')")
@click.option("--mode", type=click.Choice(["coherent", "standard"]), default="coherent", show_default=True,
              help="expert-parallel mode the bundle runs by default")
@click.option("--image", default=None, help="kubernetes: container image of the rank pods")
@click.option("--storage-class", default=None, help="kubernetes: storage class of the weights volume")
@click.option("--slo", type=float, default=None, help="lambda: end-to-end latency limit per batch, seconds")
@click.option("--methods", default="pipelined_s3,s3,direct", show_default=True, help="lambda: allowed scatter-gather methods")
@click.option("--batch-tokens", type=int, default=10240, show_default=True, help="lambda: tokens per request (batch)")
@click.option("--platform", "platform_file", default=None, help="lambda: YAML file overriding platform constants")
@click.option("--requests-per-second", type=float, default=1.0, show_default=True,
              help="lambda: request rate the README's monthly cost is stated for")
@click.option("--cache-dir", default="build/cache", show_default=True, help="lambda: profile cache directory")
@click.option("--kubernetes", "with_kubernetes", is_flag=True, help="sglang: also write kubernetes/ manifests")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="bundle directory to write")
@click.option("--json", "as_json", is_flag=True, help="print a JSON summary as the last line")
@click.option("--quiet", is_flag=True, help="no progress output")
def compile_cmd(model, trace_path, target, nodes, gpus_per_node, policy, redundant, balance, time_limit, effort, mode, image,
                storage_class, slo, methods, batch_tokens, platform_file, requests_per_second, cache_dir, with_kubernetes,
                out, as_json, quiet):
    """Compile MODEL with its routing trace into a runnable expert-parallel bundle."""
    if target in ("sglang", "trtllm"):
        _compile_engine(model, trace_path, target, nodes, gpus_per_node, policy, redundant, balance, time_limit, effort,
                        with_kubernetes, image, storage_class, slo, out, as_json, quiet)
        return
    if with_kubernetes:
        raise UserError("--kubernetes applies to --target sglang; for the torchrun bundle use --target kubernetes")
    policy = policy or "ilp"
    if target == "lambda":
        if slo is None:
            raise UserError("--target lambda needs --slo SECONDS (end-to-end latency limit per batch)")
        if image is not None or storage_class is not None:
            raise UserError("--image and --storage-class apply to --target kubernetes only")
        from moeplan.planner.lambda_compile import compile_lambda

        summary = compile_lambda(model, trace_path, out, slo_s=slo, batch_tokens=batch_tokens, methods=methods,
                                 platform_file=platform_file, cache_dir=cache_dir, time_limit=time_limit,
                                 requests_per_second=requests_per_second)
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


def _compile_engine(model, trace_path, target, nodes, gpus_per_node, policy, redundant, balance, time_limit, effort,
                    with_kubernetes, image, storage_class, slo, out, as_json, quiet):
    """--target sglang|trtllm: planner/engine_compile.py writes the engine's placement files."""
    from moeplan.planner.engine_compile import compile_engine

    if slo is not None or storage_class is not None:
        raise UserError("--slo and --storage-class do not apply to --target sglang/trtllm")
    if image is not None and not with_kubernetes:
        raise UserError("--image applies to --target sglang with --kubernetes")
    summary = compile_engine(model, trace_path, target, nodes, gpus_per_node, out, policy=policy, redundant=redundant,
                             balance=balance, time_limit=time_limit, effort=effort, kubernetes=with_kubernetes,
                             image=image)
    if as_json:
        click.echo(json.dumps(summary, sort_keys=True))
    elif not quiet:
        click.echo(f"wrote {out}: {target} placement for {summary['world_size']} EP ranks ({summary['policy']}, "
                   f"{summary['redundant']} redundant slots); predicted max/mean rank load "
                   f"{summary['predicted']['max_over_mean_load']:.3f}")
