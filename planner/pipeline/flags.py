"""Every option of `moeplan plan` and `moeplan compile`, once: its default, type, help and the targets it
applies to.

The click options are built from this table (`planner/commands/options.py`), the Python API fills
its defaults and checks its values with it (`moeplan.compile`, `moeplan.plan`), and a flag given
for a target it does not apply to is refused in one way (`refuse_inapplicable`). `compile --help`
prints the table's groups as sections.
"""
from __future__ import annotations

from dataclasses import dataclass

import click

from moeplan.core import cli_types as T
from moeplan.core import kubernetes_syntax as K
from moeplan.core.engine_layout import ENGINE_TARGETS
from moeplan.core.errors import UserError
from moeplan.core.hardware import DEFAULT_HARDWARE, DEFAULT_OFFLOAD_HARDWARE, hardware_names
from moeplan.core.slo import SloType

TORCHRUN = ("torchrun", "kubernetes")
ENGINES = ENGINE_TARGETS
PLACING = TORCHRUN + ENGINES
EXPERT_CACHES = TORCHRUN + ("offload",)
HELD_OUT = ("lambda",) + EXPERT_CACHES
# the API call a Lambda plan's cost is stated for unless --prompt-tokens / --new-tokens name another:
# the request of the torchrun targets' default --workload (8x32+8), so both targets price one shape
DEFAULT_PROMPT_TOKENS, DEFAULT_NEW_TOKENS = 32, 8


@dataclass(frozen=True)
class Flag:
    """One option: `name` is the Python keyword (and click's parameter name), `option` the flag."""

    name: str
    option: str
    targets: tuple
    group: str
    help: str
    type: object = None
    default: object = None
    is_flag: bool = False
    show_default: bool = True
    compile_only: bool = False

    def convert(self, value):
        """The value as the command line would parse it (same checks, same errors as one line)."""
        if self.is_flag:
            if not isinstance(value, bool):
                raise UserError(f"{self.option} takes True or False, got {value!r}")
            return value
        if value is None or self.type is None:
            return value
        kind = self.type if isinstance(self.type, click.ParamType) else click.types.convert_type(self.type)
        try:
            return kind.convert(value, None, None)
        except click.BadParameter as exc:
            raise UserError(f"{self.option} {exc.message}") from None


GROUPS = (  # (title, what the section is for), in the order `compile --help` prints them
    ("Topology and placement", "torchrun, kubernetes, sglang, vllm, trtllm"),
    ("Engine deployment", "sglang, vllm, trtllm: the layout the engine is launched with; --max-gpus with --slo"),
    ("Cost model", "torchrun, kubernetes; --hardware also offload; --hardware and --workload also sglang, vllm, trtllm"),
    ("Expert caches", "torchrun and kubernetes with --gpu-memory/--expert-cache; offload; --prompt-tokens also lambda"),
    ("Bundle", "torchrun, kubernetes; --sign-key also lambda"),
    ("Kubernetes", "kubernetes; sglang with --kubernetes"),
    ("Lambda", "lambda; --slo also sglang, vllm, trtllm (the SLO search); --validation-fraction and --seed also offload and "
               "expert caches"),
)
PLACEMENT, ENGINE, COST, CACHES, BUNDLE, KUBERNETES, LAMBDA = (g for g, _ in GROUPS)

FLAGS = (
    Flag("nodes", "--nodes", PLACING, PLACEMENT, "server nodes", T.POSITIVE_INT, 1),
    Flag("gpus_per_node", "--gpus-per-node", PLACING, PLACEMENT, "GPUs per node", T.POSITIVE_INT, 1),
    Flag("policy", "--policy", PLACING, PLACEMENT,
         "placement policy; auto: the fastest by the cost model's predicted time (sglang, trtllm: eplb unless given; "
         "vllm: eplb = vLLM's EPLB on, contiguous = off; docs/interop.md)", click.Choice(["auto", "ilp", "eplb", "contiguous"]),
         "auto"),
    Flag("redundant", "--redundant", PLACING, PLACEMENT,
         "redundant expert slots per layer (replicas); eplb gives them to the highest load per replica, ilp may move "
         "them between experts", T.NON_NEGATIVE_INT, 0),
    Flag("balance", "--balance", PLACING, PLACEMENT, "ilp: per layer, every GPU's load <= (1 + B) x the reference load",
         T.NON_NEGATIVE_FLOAT, 0.1),
    Flag("balance_base", "--balance-base", PLACING, PLACEMENT,
         "ilp: reference load per layer: the mean GPU load, or EPLB's max GPU load with the same replicas",
         click.Choice(["mean", "eplb"]), "mean"),
    Flag("held_out_balance", "--held-out-balance", PLACING, PLACEMENT,
         "ilp: --balance bounds the expected max load on traffic the trace has not seen (planning caps lowered by the "
         "rise EPLB's packing shows across blocks of the trace), not on the trace itself", default=False, is_flag=True,
         show_default=False),
    Flag("expert_groups", "--expert-groups", PLACING, PLACEMENT,
         "eplb: expert groups for the hierarchical policy (e.g. 8 for DeepSeek-V3); 0 = global policy (sglang, trtllm: "
         "the config's n_group unless given)", T.NON_NEGATIVE_INT, 0),
    Flag("solver", "--solver", PLACING + ("lambda",), PLACEMENT, "MILP solver (lambda: of the sizing)",
         click.Choice(["highs", "gurobi"]), "highs"),
    Flag("effort", "--effort", PLACING, PLACEMENT,
         "ilp: work multiplier (sweeps, exchange moves, branch-and-bound nodes, LP sizes); results depend only on it, "
         "not on machine speed. 2 = about twice the work", T.POSITIVE_FLOAT, 1.0),
    Flag("time_limit", "--time-limit", PLACING + ("lambda",), PLACEMENT,
         "safety net per solve, seconds; an ilp solve it stops is marked stopped_by=time_limit (not reproducible)",
         T.POSITIVE_FLOAT, 300.0),
    Flag("attention", "--attention", ENGINES, ENGINE,
         "attention tensor parallel over all GPUs (tp) or data parallel, one replica per GPU (dp); auto: tp inside one "
         "node, dp across nodes", click.Choice(["auto", "tp", "dp"]), "auto"),
    Flag("max_running_requests", "--max-running-requests", ENGINES, ENGINE,
         "requests decoding at once over the whole deployment (sglang --max-running-requests; vllm --max-num-seqs and "
         "trtllm max_batch_size per attention replica); default: --workload's requests where given, else the engine's "
         "own", T.POSITIVE_INT, show_default=False),
    Flag("mode", "--mode", TORCHRUN, COST,
         "expert-parallel mode the bundle runs by default; auto: the faster by the cost model's predicted time",
         click.Choice(["auto", "coherent", "standard"]), "auto"),
    Flag("hardware", "--hardware", TORCHRUN + ("offload",) + ENGINES, COST,
         f"hardware profile every prediction of the plan is priced with (cost model, expert caches, serving capacity, "
         f"offloading; sglang, vllm, trtllm: the GPU the engine runs on, for the serving prediction, from measured kernels on "
         f"h100-sxm and h200-sxm with moeplan[gpu], the roofline elsewhere), the same names on every target: "
         f"{hardware_names()}, or a YAML file (e.g. written by 'moeplan calibrate --out FILE'); default "
         f"{DEFAULT_HARDWARE}, offload: {DEFAULT_OFFLOAD_HARDWARE}, engine targets: no serving prediction",
         show_default=False),
    Flag("workload", "--workload", TORCHRUN + ENGINES, COST,
         "requests the cost model prices, REQUESTSxPROMPT+NEW: R concurrent requests of P prompt tokens generating N "
         "each (default 8x32+8; sglang, vllm, trtllm: over the whole deployment, default 64x1024+128 with --hardware)",
         show_default=False),
    Flag("gpu_memory", "--gpu-memory", EXPERT_CACHES, CACHES, "GPU memory for the model, bytes or e.g. 24GiB",
         show_default=False),
    Flag("expert_cache", "--expert-cache", EXPERT_CACHES, CACHES,
         "expert cache entries ((layer, expert) pairs) instead of --gpu-memory", int, show_default=False),
    Flag("host_memory", "--host-memory", EXPERT_CACHES, CACHES,
         "host memory for the experts' host tier, bytes or e.g. 48GiB, per machine (shared by its ranks); the rest are "
         "read from disk on every load (default: the hardware profile's host memory less 8 GiB)", show_default=False),
    Flag("batch", "--batch", EXPERT_CACHES, CACHES, "sequences served at once (KV cache sizing)", int, 1),
    Flag("max_length", "--max-length", EXPERT_CACHES, CACHES, "tokens per sequence (KV cache sizing)", int, 4096),
    Flag("prompt_tokens", "--prompt-tokens", EXPERT_CACHES + ("lambda",), CACHES,
         "expert caches: the first P tokens of a sequence are one prefill step (default 0); lambda: the prompt of the "
         f"API call whose cost compile, the README and the report state (default {DEFAULT_PROMPT_TOKENS})", int,
         show_default=False),
    Flag("eviction", "--eviction", TORCHRUN, CACHES,
         "the ranks' eviction policy (default: the best on held-out sequences; --target offload compares them all)",
         click.Choice(["moeplan", "lru", "lfu", "lifo", "moe-infinity"]), show_default=False),
    Flag("prefetch", "--prefetch", TORCHRUN, CACHES,
         "the ranks' prefetcher (none: demand paging only; speculative: needs a trace recorded with --speculate; "
         "default: the fastest on held-out sequences; docs/offload.md)",
         click.Choice(["none", "moeplan", "moe-infinity", "speculative"]), show_default=False),
    Flag("host_compute", "--host-compute", EXPERT_CACHES, CACHES,
         "a missed expert's rows computed on the host where its weights are when that is sooner than copying them "
         "(cheaper), never, or whichever the held-out sequences predict faster (auto)",
         click.Choice(["auto", "cheaper", "never"]), "auto"),
    Flag("weights", "--weights", TORCHRUN, BUNDLE,
         "copy each rank's tensors into the bundle, or write per-rank indexes into the original safetensors "
         "checkpoint (README: Weights)", click.Choice(["copy", "reference"]), "copy"),
    Flag("sign_key", "--sign-key", TORCHRUN + ("lambda",), BUNDLE,
         "ed25519 private key (PEM) to sign the bundle's manifest with (docs/security.md)",
         click.Path(dir_okay=False), show_default=False, compile_only=True),
    Flag("image", "--image", ("kubernetes", "sglang"), KUBERNETES,
         "container image of the rank pods, REGISTRY/NAME:TAG (kubernetes: required; its README's docker build line "
         "builds it from kubernetes/Dockerfile and you push it there; sglang: with --kubernetes)", K.IMAGE,
         show_default=False),
    Flag("cpu_only", "--cpu-only", ("kubernetes",), KUBERNETES,
         "pods without GPUs (the plan priced on a CPU profile, cpu-gloo unless --hardware names another); without it "
         "--hardware must name the GPU the pods run on", default=False, is_flag=True, show_default=False),
    Flag("weights_from", "--weights-from", ("kubernetes",), KUBERNETES,
         "how the bundle reaches the pods: 'image' (built into the image), an http(s) URL of the bundle's tar (each "
         "pod's init container downloads it once onto its own volume; a presigned S3 or GCS URL works), or 'volume' "
         "(one shared claim you fill; needs --storage-class)", K.WEIGHTS_SOURCE, "image"),
    Flag("storage_class", "--storage-class", ("kubernetes",), KUBERNETES,
         "storage class of the weights volumes (--weights-from URL: the cluster's default unless given; volume: "
         "required)", K.STORAGE_CLASS, show_default=False),
    Flag("access_mode", "--access-mode", ("kubernetes",), KUBERNETES,
         "access mode of the weights volumes (default: ReadWriteOnce per pod for a URL, ReadWriteMany for the shared "
         "volume)", click.Choice(["ReadWriteOnce", "ReadWriteMany", "ReadOnlyMany"]), show_default=False),
    Flag("node_selector", "--node-selector", ("kubernetes",), KUBERNETES,
         "labels the pods' nodes must have, KEY=VALUE[,KEY=VALUE...] (e.g. nvidia.com/gpu.product=NVIDIA-H100-80GB-HBM3)",
         K.NODE_SELECTOR, show_default=False),
    Flag("tolerations", "--toleration", ("kubernetes",), KUBERNETES,
         "taints the pods tolerate, KEY[=VALUE][:EFFECT][,...] as kubectl taint spells them (GPU pods always tolerate "
         "nvidia.com/gpu:NoSchedule)", K.TOLERATIONS, show_default=False),
    Flag("image_pull_secrets", "--image-pull-secret", ("kubernetes",), KUBERNETES,
         "Secrets (docker-registry) the kubelet pulls the image with, NAME[,NAME...]", K.OBJECT_NAMES, show_default=False),
    Flag("batch_job", "--batch-job", ("kubernetes",), KUBERNETES,
         "write an indexed batch Job that generates for the prompts of a ConfigMap you create (README) and exits, "
         "instead of the long-running service (StatefulSets serving the OpenAI API; docs/serving.md)", default=False,
         is_flag=True, show_default=False),
    Flag("kubernetes", "--kubernetes", ("sglang",), KUBERNETES,
         "sglang: also write kubernetes/ manifests (the torchrun bundle with manifests is --target kubernetes)",
         default=False, is_flag=True, show_default=False),
    Flag("slo", "--slo", ("lambda",) + ENGINES, LAMBDA,
         "latency objective (core/slo.py): lambda: the end-to-end latency limit per batch, SECONDS or latency=5s "
         "(required); sglang, vllm, trtllm: tpot=35ms[,ttft=2s] with --hardware and without --nodes searches the GPU "
         "count and layout for --workload (docs/slo_search.md)", SloType(), show_default=False),
    Flag("max_gpus", "--max-gpus", ENGINES, ENGINE, "with --slo: the most GPUs the SLO search tries", T.POSITIVE_INT,
         64),
    Flag("platform", "--platform", ("lambda",), LAMBDA, "YAML file overriding platform constants", show_default=False),
    Flag("batch_tokens", "--batch-tokens", ("lambda",), LAMBDA, "tokens per served batch", T.POSITIVE_INT, 10240),
    Flag("methods", "--methods", ("lambda",), LAMBDA, "allowed scatter-gather methods", default="pipelined_s3,s3,direct"),
    Flag("validation_fraction", "--validation-fraction", HELD_OUT, LAMBDA,
         "share of the trace held out for validation / BO (offload, expert caches: to choose the policy)", T.FRACTION, 0.2),
    Flag("size_for", "--size-for", ("lambda",), LAMBDA,
         "size for the mean predicted load per batch, or per expert the busiest batch's", click.Choice(["mean", "max"]),
         "mean"),
    Flag("bo_iterations", "--bo-iterations", ("lambda",), LAMBDA, "BO refinement iterations (0 = off)",
         T.NON_NEGATIVE_INT, 0),
    Flag("bo_q", "--bo-q", ("lambda",), LAMBDA, "key-value pairs adjusted per BO trial", T.POSITIVE_INT, 64),
    Flag("bo_storage", "--bo-storage", ("lambda",), LAMBDA, "Optuna storage URL (e.g. sqlite:///bo.db) to share the study",
         show_default=False),
    Flag("profile_budget", "--profile-budget", ("lambda",), LAMBDA, "seconds of optional profiling",
         T.NON_NEGATIVE_FLOAT, 5.0),
    Flag("cache_dir", "--cache-dir", ("lambda",), LAMBDA,
         "profile cache directory (default $MOEPLAN_CACHE_DIR, else ~/.cache/moeplan/profiles)", show_default=False),
    Flag("no_cache", "--no-cache", ("lambda",), LAMBDA, "profile again and do not write the cache", default=False,
         is_flag=True, show_default=False),
    Flag("seed", "--seed", HELD_OUT, LAMBDA, "random seed (of the held-out split, profiling and BO)", T.SEED, 0),
    Flag("new_tokens", "--new-tokens", ("lambda",), LAMBDA,
         "tokens generated by the API call whose cost compile, the README and the report state (its prompt: "
         f"--prompt-tokens, default {DEFAULT_PROMPT_TOKENS}); the monthly cost is for such calls", T.POSITIVE_INT,
         DEFAULT_NEW_TOKENS),
    Flag("requests_per_second", "--requests-per-second", ("lambda",), LAMBDA,
         "rate of those API calls the README's monthly cost is stated for", T.POSITIVE_FLOAT, 1.0),
    Flag("http_entry", "--http-entry", ("lambda",), LAMBDA,
         "what serves the OpenAI API: a Lambda Function URL or an API Gateway HTTP API (30 s limit) in front of the "
         "front function", click.Choice(["function-url", "http-api"]), "function-url"),
)
BY_NAME = {f.name: f for f in FLAGS}

PLACEMENT_FLAGS = ("policy", "redundant", "balance", "balance_base", "held_out_balance", "expert_groups", "solver", "effort",
                   "time_limit")
# on/off flags added after plans recorded their options: left out while off, so older plans keep their bytes
RECORDED_ONLY_WHEN_ON = ("held_out_balance",)
SERVERLESS_FLAGS = ("slo", "platform", "batch_tokens", "methods", "validation_fraction", "size_for", "bo_iterations",
                    "bo_q", "bo_storage", "profile_budget", "cache_dir", "no_cache", "seed", "prompt_tokens", "new_tokens",
                    "requests_per_second", "http_entry")
OFFLOAD_FLAGS = ("gpu_memory", "expert_cache", "host_memory", "batch", "max_length", "prompt_tokens", "eviction",
                 "prefetch", "host_compute")


def flags_of(target: str) -> tuple:
    """The names of the flags that apply to `target`."""
    return tuple(f.name for f in FLAGS if target in f.targets)


def defaults(compile_only: bool = True) -> dict:
    """Every flag at its default (without the compile-only ones when `compile_only` is False)."""
    return {f.name: f.default for f in FLAGS if compile_only or not f.compile_only}


def resolve(given: dict, compile_only: bool = True) -> dict:
    """Every flag's value: the defaults, overridden by `given` ({name: value}, checked as the CLI checks them)."""
    values = defaults(compile_only)
    for name, value in given.items():
        if name not in values:
            known = ", ".join(sorted(values))
            raise UserError(f"unknown option '{name}'; the options are {known}")
        values[name] = BY_NAME[name].convert(value)
    return values


def refuse_inapplicable(target: str, given, keywords: bool = False) -> None:
    """One line naming the first given flag that does not apply to `target`, and the targets it applies to
    (`keywords`: as the Python API names them, `slo=` and `target=`)."""
    for f in FLAGS:
        if f.name in given and target not in f.targets:
            if keywords:
                raise UserError(f"{f.name}= does not apply to target={target!r}; it applies to target "
                                f"{', '.join(map(repr, f.targets))}: drop it or choose one of those targets")
            raise UserError(f"{f.option} does not apply to --target {target}; it applies to --target "
                            f"{', '.join(f.targets)}: drop it or choose one of those targets")


def pick(values: dict, names) -> dict:
    """The named flags' values, less those of RECORDED_ONLY_WHEN_ON that are off."""
    out = {n: values[n] for n in names}
    return {n: v for n, v in out.items() if not (n in RECORDED_ONLY_WHEN_ON and v is False)}
