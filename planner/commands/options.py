"""Option groups shared by the commands, declared once so that flags and defaults cannot drift.

`placement_options` (place, compile, plan), `topology_options` (place, compile, plan),
`serverless_options` (compile, plan), `output_options` (--json, --quiet). Each decorator adds
its click options; `placement_request_options(kwargs)` and `serverless_request(kwargs)` pop the
values back out of a command's keyword arguments as the dicts the pipeline reads.
"""
from __future__ import annotations

import click

from moeplan.planner import cli_types as T
from moeplan.planner.hardware import hardware_names

PLACEMENT_FLAGS = ("policy", "redundant", "balance", "balance_base", "held_out_balance", "expert_groups", "solver", "effort",
                   "time_limit")
# on/off flags added after plans recorded their options: left out while off, so older plans keep their bytes
RECORDED_ONLY_WHEN_ON = ("held_out_balance",)
SERVERLESS_FLAGS = ("slo", "platform_file", "batch_tokens", "methods", "validation_fraction", "size_for", "bo_iterations",
                    "bo_q", "bo_storage", "profile_budget", "cache_dir", "no_cache", "seed", "requests_per_second")


def _apply(options, f):
    for option in reversed(options):
        f = option(f)
    return f


def topology_options(required: bool):
    """--nodes / --gpus-per-node: required where a placement is scored elsewhere, 1 x 1 by default otherwise."""
    default = None if required else 1
    return lambda f: _apply([
        click.option("--nodes", type=T.POSITIVE_INT, default=default, show_default=not required, help="server nodes"),
        click.option("--gpus-per-node", type=T.POSITIVE_INT, default=default, show_default=not required, help="GPUs per node"),
    ], f)


def placement_option_group(policies=("ilp", "eplb", "contiguous"), default="ilp"):
    """The placement flags; commands that know the model (compile) also offer --policy auto."""
    return lambda f: _placement_options(f, policies, default)


def _placement_options(f, policies, default):
    return _apply([
        click.option("--policy", type=click.Choice(list(policies)), default=default, show_default=True,
                     help="placement policy" + ("; auto: the fastest by the cost model's predicted time" if "auto" in policies else "")),
        click.option("--redundant", type=T.NON_NEGATIVE_INT, default=0, show_default=True,
                     help="redundant expert slots per layer (replicas); eplb gives them to the highest load per replica, "
                          "ilp may move them between experts"),
        click.option("--balance", type=T.NON_NEGATIVE_FLOAT, default=0.1, show_default=True,
                     help="ilp: per layer, every GPU's load <= (1 + B) x the reference load"),
        click.option("--balance-base", type=click.Choice(["mean", "eplb"]), default="mean", show_default=True,
                     help="ilp: reference load per layer: the mean GPU load, or EPLB's max GPU load with the same replicas"),
        click.option("--held-out-balance", is_flag=True, default=False,
                     help="ilp: --balance bounds the expected max load on traffic the trace has not seen (planning caps "
                          "lowered by the rise EPLB's packing shows across blocks of the trace), not on the trace itself"),
        click.option("--expert-groups", type=T.NON_NEGATIVE_INT, default=0, show_default=True,
                     help="eplb: expert groups for the hierarchical policy (e.g. 8 for DeepSeek-V3); 0 = global policy"),
        click.option("--solver", type=click.Choice(["highs", "gurobi"]), default="highs", show_default=True,
                     help="MILP solver"),
        click.option("--effort", type=T.POSITIVE_FLOAT, default=1.0, show_default=True,
                     help="ilp: work multiplier (sweeps, exchange moves, branch-and-bound nodes, LP sizes); results depend "
                          "only on it, not on machine speed. 2 = about twice the work"),
        click.option("--time-limit", type=T.POSITIVE_FLOAT, default=300.0, show_default=True,
                     help="safety net per solve, seconds; an ilp solve it stops is marked stopped_by=time_limit "
                          "(not reproducible)"),
    ], f)


placement_options = placement_option_group()
auto_placement_options = placement_option_group(("auto", "ilp", "eplb", "contiguous"), "auto")


def cost_options(f):
    """--mode (auto by default), --hardware, --workload: what the cost model prices a plan for (issue 12)."""
    return _apply([
        click.option("--mode", type=click.Choice(["auto", "coherent", "standard"]), default="auto", show_default=True,
                     help="torchrun/kubernetes: expert-parallel mode the bundle runs by default; auto: the faster by the "
                          "cost model's predicted time"),
        click.option("--hardware", default=None,
                     help=f"hardware profile every prediction of the plan is priced with (cost model, expert caches, "
                          f"offloading): {hardware_names()}, or a YAML file (e.g. written by 'moeplan calibrate "
                          f"--out FILE'); default cpu-gloo, offload: rtx4090-pcie4"),
        click.option("--workload", default=None, help="requests the cost model prices, REQUESTSxPROMPT+NEW (default 8x32+8)"),
    ], f)


def serverless_options(f):
    return _apply([
        click.option("--slo", type=T.POSITIVE_FLOAT, default=None, help="lambda: end-to-end latency limit per batch, seconds"),
        click.option("--platform", "platform_file", default=None, help="lambda: YAML file overriding platform constants"),
        click.option("--batch-tokens", type=T.POSITIVE_INT, default=10240, show_default=True, help="lambda: tokens per served batch"),
        click.option("--methods", default="pipelined_s3,s3,direct", show_default=True,
                     help="lambda: allowed scatter-gather methods"),
        click.option("--validation-fraction", type=T.FRACTION, default=0.2, show_default=True,
                     help="lambda: share of the trace held out for validation / BO"),
        click.option("--size-for", type=click.Choice(["mean", "max"]), default="mean", show_default=True,
                     help="lambda: size for the mean predicted load per batch, or per expert the busiest batch's"),
        click.option("--bo-iterations", type=T.NON_NEGATIVE_INT, default=0, show_default=True, help="lambda: BO refinement iterations (0 = off)"),
        click.option("--bo-q", type=T.POSITIVE_INT, default=64, show_default=True, help="lambda: key-value pairs adjusted per BO trial"),
        click.option("--bo-storage", default=None, help="lambda: Optuna storage URL (e.g. sqlite:///bo.db) to share the study"),
        click.option("--profile-budget", type=T.NON_NEGATIVE_FLOAT, default=5.0, show_default=True,
                     help="lambda: seconds of optional profiling"),
        click.option("--cache-dir", default=None,
                     help="lambda: profile cache directory (default $MOEPLAN_CACHE_DIR, else ~/.cache/moeplan/profiles)"),
        click.option("--no-cache", is_flag=True, help="lambda: profile again and do not write the cache"),
        click.option("--seed", type=T.SEED, default=0, show_default=True, help="lambda: random seed"),
        click.option("--requests-per-second", type=T.POSITIVE_FLOAT, default=1.0, show_default=True,
                     help="lambda: request rate the README's monthly cost is stated for"),
    ], f)


def kubernetes_options(f):
    return _apply([
        click.option("--image", type=T.NON_EMPTY_TEXT, default=None, help="kubernetes: container image of the rank pods"),
        click.option("--storage-class", type=T.NON_EMPTY_TEXT, default=None, help="kubernetes: storage class of the weights volume"),
    ], f)


def weights_options(f):
    return _apply([
        click.option("--weights", type=click.Choice(["copy", "reference"]), default="copy", show_default=True,
                     help="torchrun/kubernetes: copy each rank's tensors into the bundle, or write per-rank indexes "
                     "into the original safetensors checkpoint (README: Weights)"),
    ], f)


def output_options(f):
    return _apply([
        click.option("--json", "as_json", is_flag=True, help="print a JSON summary as the last line"),
        click.option("--quiet", is_flag=True, help="no progress output"),
    ], f)


def pop(kwargs: dict, names) -> dict:
    """The named flags out of `kwargs`, less those of RECORDED_ONLY_WHEN_ON that are off."""
    out = {n: kwargs.pop(n) for n in names}
    return {n: v for n, v in out.items() if not (n in RECORDED_ONLY_WHEN_ON and v is False)}
