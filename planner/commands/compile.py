"""`moeplan compile MODEL --trace T --target torchrun|kubernetes|lambda --out DIR`.

The target's pass list (`planner/pipeline/targets.py`) runs through the PassManager; the bundle
appears at --out only when every pass succeeded. `--json` prints a summary object as the last line.
"""
from __future__ import annotations

import json
from pathlib import Path

import click

from moeplan.planner.commands.options import (PLACEMENT_FLAGS, SERVERLESS_FLAGS, auto_placement_options, cost_options,
                                               kubernetes_options, output_options, pop,
                                               weights_options, serverless_options,
                                               topology_options)
from moeplan.planner.commands.plan_offload import OFFLOAD_FLAGS, offload_options, offload_request
from moeplan.planner.errors import UserError
from moeplan.planner.pipeline.cost import default_cost_options, describe_choice


def pipeline_inputs(model, trace_path, target, nodes, gpus_per_node, mode, image, storage_class, placement, serverless,
                    out, say, cost=None, offload=None) -> dict:
    """The facts a target's pass list starts from, with the flags that do not apply to it refused."""
    if target != "kubernetes" and (image is not None or storage_class is not None):
        raise UserError("--image and --storage-class apply to --target kubernetes only")
    if target != "lambda" and serverless["slo"] is not None:
        raise UserError("--slo applies to --target lambda only")
    if nodes < 1 or gpus_per_node < 1:
        raise UserError(f"--nodes and --gpus-per-node must be at least 1, got {nodes} and {gpus_per_node}")
    spec = {"name": target}
    if target == "kubernetes":
        from moeplan.backends.kubernetes.codegen import DEFAULT_IMAGE

        spec.update(image=image or DEFAULT_IMAGE, storage_class=storage_class)
    serverless = dict(serverless, time_limit=placement["time_limit"], solver=placement["solver"])
    if target == "lambda" and placement["policy"] == "auto":  # lambda sizes expert functions, no placement policy
        placement = dict(placement, policy="ilp")
    if target == "lambda":  # flag mistakes stop before any pass runs
        from moeplan.planner.pipeline.lambda_ import check_options

        check_options({"serverless_options": serverless})
    return {"model_spec": str(model), "trace_path": str(trace_path), "out": str(out) if out is not None else None,
            "topology": {"nodes": nodes, "gpus_per_node": gpus_per_node}, "placement_options": placement,
            "mode": mode, "target": spec, "serverless_options": serverless, "progress": say,
            "cost_options": default_cost_options(cost, nodes if target in ("torchrun", "kubernetes") else None),
            "offload_options": offload}


def summary_of(plan, out, timings, manifest=None) -> dict:
    """The --json summary of a plan (and its bundle): target, scale, headline predictions, pass timings."""
    doc = plan.to_dict()
    summary = {"out": str(out), "target": plan.target, "passes": timings}
    if manifest is not None:
        summary["files"] = len(manifest["files"])
    if plan.target == "lambda":
        summary.update(functions=doc["topology"]["functions"], dense_slices=len(doc["placement"]["dense_slices"]),
                       methods=doc["communication"]["methods"], cost_per_request_usd=doc["predicted"]["cost_per_request_usd"],
                       moe_cost_per_batch_usd=doc["predicted"]["moe_cost_per_batch_usd"],
                       latency_s=doc["predicted"]["latency_s"],
                       throughput_tokens_per_s=doc["predicted"]["throughput_tokens_per_s"],
                       algorithm=doc["predicted"]["algorithm"], predictor_error=doc["predicted"]["predictor_error"])
    else:
        summary.update(world_size=plan.world_size, policy=doc["placement"].get("policy"), mode=doc["communication"]["mode"],
                       predicted={k: doc["predicted"][k] for k in ("gpu_local_fraction", "node_local_fraction",
                                                                     "max_over_mean_load")})
        cache = doc["communication"].get("expert_cache")
        if cache:  # issue 13: per-rank expert caches
            summary["expert_cache"] = {"capacity": cache["capacity"], "eviction": cache["eviction"], "prefetch": cache["prefetch"],
                                       "predicted_hit_ratio": doc["predicted"]["expert_cache"]["hit_ratio"]}
        cost = doc["predicted"].get("cost")
        if cost:  # issue 12: the cost model's figures for the chosen mode, and the profile they are for
            chosen = cost["modes"][cost["mode"]]
            summary.update(hardware=cost["hardware"], choice=describe_choice(doc))
            summary["predicted"].update(seconds_per_token=chosen["seconds_per_token"],
                                        total_bytes_per_token=chosen["total_bytes_per_token"])
    return summary


def describe(summary: dict) -> str:
    """One human line for a written plan or bundle."""
    what = f"wrote {summary['out']}" + (f" ({summary['files']} files)" if "files" in summary else "")
    if summary["target"] == "lambda":
        return (f"{what}: {summary['functions']} functions ({summary['dense_slices']} dense slices), methods "
                f"{', '.join(summary['methods'])}; predicted ${summary['cost_per_request_usd']:.8f} per request")
    p = summary["predicted"]
    return (f"{what}: {summary['world_size']} ranks; predicted gpu_local_fraction {p['gpu_local_fraction']:.3f}, "
            f"node_local_fraction {p['node_local_fraction']:.3f}, max/mean load {p['max_over_mean_load']:.3f}"
            + (f"\n{summary['choice']}" if "choice" in summary else "")
            + (f"\nexpert caches: {summary['expert_cache']['capacity']} entries per rank, eviction "
               f"{summary['expert_cache']['eviction']}, prefetch {summary['expert_cache']['prefetch']}, predicted hit ratio {summary['expert_cache']['predicted_hit_ratio']:.3f}"
               if "expert_cache" in summary else ""))


@click.command("compile")
@click.argument("model")
@click.option("--trace", "trace_path", required=True, help="routing trace (.npz) recorded from MODEL")
@click.option("--target", type=click.Choice(["torchrun", "kubernetes", "lambda", "sglang", "trtllm"]), default="torchrun",
              show_default=True, help="torchrun bundle, the same bundle plus kubernetes/ manifests, an AWS Lambda (SAM) "
              "bundle, or the placement files SGLang / TensorRT-LLM load (a config is enough; their default policy is eplb; "
              "docs/interop.md)")
@topology_options(required=False)
@auto_placement_options
@cost_options
@kubernetes_options
@serverless_options
@click.option("--kubernetes", "with_kubernetes", is_flag=True, help="sglang: also write kubernetes/ manifests")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="bundle directory to write")
@click.option("--sign-key", type=click.Path(dir_okay=False), default=None,
              help="ed25519 private key (PEM) to sign the bundle's manifest with (docs/security.md)")
@click.option("--report", "with_report", is_flag=True,
              help="also write report.html into the bundle (moeplan report; the manifest lists it)")
@offload_options
@weights_options
@output_options
def compile_cmd(model, trace_path, target, nodes, gpus_per_node, mode, image, storage_class, with_kubernetes, out, sign_key,
                as_json, quiet, hardware, workload, weights, with_report=False, **flags):
    """Compile MODEL with its routing trace into a deployable bundle."""
    signer = _signer(sign_key, target)
    offload = pop(flags, OFFLOAD_FLAGS)  # issue 13: per-rank expert caches (--gpu-memory / --expert-cache)
    if target in ("torchrun", "kubernetes"):
        offload = offload_request(offload, flags["validation_fraction"], flags["seed"], target=target)
    elif offload["gpu_memory"] is not None or offload["expert_cache"] is not None:
        raise UserError("--gpu-memory / --expert-cache apply to --target torchrun or kubernetes ('moeplan plan --target offload' plans one GPU)")
    else:
        offload = None
    if target in ("sglang", "trtllm"):  # serving-engine placement files: planner/commands/engine_compile.py
        from moeplan.planner.commands.engine_compile import compile_engine

        compile_engine(model, trace_path, target, nodes, gpus_per_node, pop(flags, PLACEMENT_FLAGS), with_kubernetes,
                       image, out, as_json, quiet, ignored={"mode": mode, "storage_class": storage_class, "hardware": hardware,
                                                             "workload": workload, **flags})
        if with_report:  # issue 31: the bundle's own report.html
            from moeplan.planner.commands.report import write_bundle_report

            write_bundle_report(Path(out), [trace_path])
        return
    if with_kubernetes:
        raise UserError("--kubernetes applies to --target sglang; the torchrun bundle has --target kubernetes")
    if weights != "copy" and target not in ("torchrun", "kubernetes"):
        raise UserError(f"--weights {weights} applies to --target torchrun and kubernetes only")
    say = (lambda msg: None) if quiet or as_json else (lambda msg: click.echo(msg, err=True))
    facts = pipeline_inputs(model, trace_path, target, nodes, gpus_per_node, mode, image, storage_class,
                            pop(flags, PLACEMENT_FLAGS), pop(flags, SERVERLESS_FLAGS), out, say,
                            {"hardware": hardware, "workload": workload}, offload)
    if weights == "reference":  # recorded in the plan's deployment; codegen writes checkpoint indexes
        facts["target"]["weights"] = "reference"
    from moeplan.planner.pipeline.targets import run_target

    facts, timings = run_target(target, facts, quiet=quiet or as_json)
    if with_report:  # issue 31: the bundle's own report.html, listed in its manifest before any signature
        from moeplan.planner.commands.report import write_bundle_report

        facts["manifest"] = write_bundle_report(Path(out), [trace_path])
    signer(out)
    summary = summary_of(facts["plan"], out, timings, facts["manifest"])
    if as_json:
        click.echo(json.dumps(summary, sort_keys=True))
    elif not quiet:
        click.echo(describe(summary))


def _signer(sign_key, target):
    """Load --sign-key before any work (a bad key fails fast); returns bundle -> None that signs."""
    if sign_key is None:
        return lambda out: None
    if target in ("sglang", "trtllm"):
        raise UserError("--sign-key signs moeplan bundles (torchrun, kubernetes, lambda); engine placement files "
                        "are not run by moeplan")
    from moeplan.backends.common.signing import SigningError, load_private_key, sign_bundle

    try:
        key = load_private_key(sign_key)
    except SigningError as exc:
        raise UserError(f"--sign-key: {exc}") from None
    return lambda out: sign_bundle(out, key)
