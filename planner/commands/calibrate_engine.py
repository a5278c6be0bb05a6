"""The runtime engine measured as `moeplan run` measures it, for `moeplan calibrate`.

The engine model (a seeded Qwen3-MoE at the example model's size, or `--model`'s) is compiled into
torchrun bundles at 1, 2 and 4 ranks (contiguous experts, standard mode); each is launched `runs`
times by the launcher `moeplan run` uses (`planner/launch/torchrun_launch.py`) on 8 prompts of 32 token
ids and 8 new tokens. `op_overhead_s` (one framework call) is fitted on the 1-rank runs and the
latency of one exchange call on the 2- and 4-rank runs, each as the least-squares value (relative
errors, both modes) at which `run`'s own prediction (`predict_run`, the cost model on the routing
the run recorded) meets `run`'s own measurement (the median run's seconds per generated token).
The cost model is linear in both.

Why bundles under torchrun: the figure a user checks is `moeplan run`'s, and what the fit absorbs
(ranks out of step, 4 ranks on 2 cores) depends on how the ranks were started and built. Fitted
on an engine calibrate built itself, in processes it spawned, the demo's runs were predicted
26-47 % slow on a quiet 2-core machine (docs/cost_model.md); fitted on bundles, the fit and the
check measure the same thing.
"""
from __future__ import annotations

import json
from pathlib import Path

from moeplan.core.errors import UserError

WORLDS = (1, 2, 4)
MODES = ("coherent", "standard")  # `moeplan run --mode both`'s order
WORKLOAD = (8, 32, 8)  # requests, prompt tokens, new tokens
SMALL_REQUESTS = 2  # a second 1-rank workload of few rows a step: parts an op's fixed cost from its cost per row
QWEN3 = {"vocab_size": 256, "hidden_size": 128, "num_hidden_layers": 6, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 32, "num_experts": 16, "num_experts_per_tok": 2,
         "moe_intermediate_size": 64, "intermediate_size": 128, "max_position_embeddings": 256,
         "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True, "tie_word_embeddings": False}
LAUNCH_TIMEOUT_S = 600


def engine_model(scratch: Path, model_dir=None) -> Path:
    """MODEL's directory, or the seeded Qwen3-MoE written to `scratch` (random weights: timing depends
    on the architecture and sizes, routing is recorded by the run itself)."""
    if model_dir is not None:
        directory = Path(model_dir)
        if not (directory / "config.json").is_file():
            raise UserError(f"--model '{model_dir}' is not a model directory with a config.json")
        return directory
    try:
        import transformers
    except ImportError:
        raise UserError("calibrate runs the runtime on a small Qwen3-MoE built by transformers; "
                        "pip install 'moeplan[hf]' (or give --model with a moeplan model directory)") from None
    import torch

    torch.manual_seed(0)
    directory = scratch / "qwen3_moe"
    bars = transformers.utils.logging.is_progress_bar_enabled()
    transformers.utils.logging.disable_progress_bar()  # calibrate prints its own one line
    try:
        transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**QWEN3)).save_pretrained(directory)
    finally:
        if bars:
            transformers.utils.logging.enable_progress_bar()
    return directory


def engine_label(model_dir=None) -> str:
    """How a calibration names its engine model (recorded in its `calibration` block and sources)."""
    if model_dir is not None:
        return str(model_dir)
    q = QWEN3
    return (f"a seeded Qwen3-MoE (hidden {q['hidden_size']}, {q['num_hidden_layers']} layers, {q['num_experts']} experts, "
            f"top-{q['num_experts_per_tok']})")


def prompt_file(directory: Path, scratch: Path, requests: int = WORKLOAD[0]) -> Path:
    """The workload's prompts (`requests` of them) as `ids:` lines (any model reads them, tokenizer or not)."""
    vocab = int(json.loads((directory / "config.json").read_text()).get("vocab_size", 256))
    _, length, _ = WORKLOAD
    path = scratch / f"prompts-{requests}.txt"
    path.write_text("".join("ids: " + " ".join(str((7 * i + 3 * j) % vocab) for j in range(length)) + "\n"
                            for i in range(requests)))
    return path


def _trace(directory: Path, scratch: Path) -> Path:
    """A routing trace for compile (uniform, seeded): contiguous placement does not read it, and the
    fit prices each run on the routing the run itself recorded."""
    import numpy as np

    from moeplan.passes.analysis.trace.format import make_trace, save_trace
    from moeplan.passes.importers import load_model

    moe = load_model(str(directory)).ir.moe_stages
    E, k = int(moe[0].num_experts), int(moe[0].top_k)
    rng = np.random.default_rng(0)
    experts = np.stack([[rng.permutation(E)[:k] for _ in moe] for _ in range(256)])
    path = scratch / "trace.npz"
    save_trace(make_trace(experts, np.full(experts.shape, 1.0 / k, dtype=np.float32), num_experts=E), path)
    return path


def compile_bundle(directory: Path, trace: Path, world: int, scratch: Path) -> Path:
    """The engine model's torchrun bundle at `world` ranks on one node, experts contiguous, standard mode."""
    from moeplan.planner.pipeline import flags, targets

    out = scratch / f"bundle-{world}"
    options = {"nodes": 1, "gpus_per_node": world, "policy": "contiguous", "mode": "standard"}
    targets.compile_target("torchrun", str(directory), str(trace), str(out), flags.resolve(options), set(options),
                           quiet=True)
    return out


def measure_bundle(root: Path, world: int, prompts: Path, scratch: Path, runs: int) -> dict:
    """`runs` launches of the bundle in both modes (one launch runs both, as `moeplan run --mode both`
    does): {mode: {"seconds_per_token": the median run's (1 / tokens_per_second of its result.json),
    "results": that run's results directory}}."""
    from moeplan.planner.launch.torchrun_launch import failure_reason, launch

    done = {mode: [] for mode in MODES}
    for i in range(runs):
        out = scratch / f"run-{world}-{prompts.stem}-{i}"
        proc = launch(root, world, prompts, WORKLOAD[2], ",".join(MODES), out, LAUNCH_TIMEOUT_S)
        if proc.returncode != 0:
            reason = failure_reason(proc.stderr + "\n" + proc.stdout)
            raise UserError(f"the engine run at {world} rank(s) failed: {reason}")
        for mode in MODES:
            result = json.loads((out / mode / "result.json").read_text())
            done[mode].append((1.0 / result["tokens_per_second"], out / mode))
    return {mode: dict(zip(("seconds_per_token", "results"), sorted(d)[len(d) // 2])) for mode, d in done.items()}


def relative_design(root: Path, runs: list, profile_at, zero: tuple, units: list) -> tuple:
    """The least squares on relative errors of `moeplan run`'s predictions of `runs` (`measure_bundle`'s, every
    mode of each) against their measurements y, when the profile is `profile_at(*x)` and each prediction is linear
    in the parameters x (a + sum_j c_j x_j): (target [m] 1 - a / y, design [m, p] c_j / y), a priced at `zero` and
    c_j at `units[j]` less a (parameters of a profile must be positive: `zero` stands in for 0 where they must)."""
    import numpy as np

    from moeplan.core.hardware import profile_from_dict
    from moeplan.passes.cost.run_check import predict_run

    def predicted(mode: str, results, x: tuple) -> float:
        return predict_run(root, results, mode, profile_from_dict(profile_at(*x), "calibration"))["seconds_per_token"]

    target, design = [], []
    for run in runs:
        for mode, measured in run.items():
            y, results = measured["seconds_per_token"], measured["results"]
            a = predicted(mode, results, zero)
            target.append(1 - a / y)
            design.append([(predicted(mode, results, unit) - a) / y for unit in units])
    return np.array(target), np.array(design)


def fit(root: Path, runs: dict, profile_at) -> float:
    """The value v that best predicts both modes' runs when the profile is `profile_at(v)` (a profile
    dict): least squares on the relative errors. Each prediction is linear in v (a_m + b_m v), so
    v = sum (b_m / y_m)(1 - a_m / y_m) / sum (b_m / y_m)^2, y_m the measured seconds per token."""
    target, design = relative_design(root, [runs], profile_at, (1e-12,), [(1.0,)])
    b = design[:, 0]
    return float(b @ target / (b @ b))


def op_cost(seconds: float, per_row: float) -> dict:
    """A profile's cost of one op of the runtime: `runtime_op_overhead_s` + `runtime_op_row_s` x the step's rows on
    the rank, at which the cost model prices the runtime's counted ops (passes/cost/runtime_op_counts.json), and
    `op_overhead_s`, the fixed part, for what it still prices with fitted counts (exchange calls' fitted ops, the
    offload timing)."""
    return {"op_overhead_s": seconds, "runtime_op_overhead_s": seconds, "runtime_op_row_s": per_row}


def fit_op(root: Path, runs: list, profile_at) -> tuple:
    """(seconds, per_row) that best predict every run of `runs` (`measure_bundle`'s, of several workloads) in both
    modes when the profile is `profile_at(seconds, per_row)`: least squares on the relative errors
    (`relative_design`). A per-row part below zero is refused: then per_row = 0 and the fixed part alone is fitted."""
    import numpy as np

    target, design = relative_design(root, runs, profile_at, (1e-12, 0.0), [(1.0, 0.0), (1e-12, 1.0)])
    (seconds, row), *_ = np.linalg.lstsq(design, target, rcond=None)
    if row < 0:
        fixed = design[:, 0]
        seconds, row = float(fixed @ target / (fixed @ fixed)), 0.0
    return max(float(seconds), 1e-9), float(row)


def fit_engine(partial: dict, scratch: Path, model_dir=None, runs: int = 5) -> dict:
    """{"op_overhead_s", "op_row_s", "latency": {world: one exchange call's latency}}: the 1-rank runs of the
    workload and of SMALL_REQUESTS prompts fix the cost of one op and its part per row (`op_cost`), then each
    multi-rank world's runs fix its exchange-call latency."""
    directory = engine_model(scratch, model_dir)
    prompts, trace = prompt_file(directory, scratch), _trace(directory, scratch)
    roots = {w: compile_bundle(directory, trace, w, scratch) for w in WORLDS}
    one = [measure_bundle(roots[1], 1, p, scratch, runs)
           for p in (prompts, prompt_file(directory, scratch, SMALL_REQUESTS))]
    op, row = fit_op(roots[1], one, lambda v, r: dict(partial, **op_cost(v, r)))
    latency = {}
    for w in WORLDS[1:]:
        run = measure_bundle(roots[w], w, prompts, scratch, runs)
        latency[w] = max(fit(roots[w], run, lambda v: dict(partial, **op_cost(op, row), collective_latency_base_s=max(v, 1e-12),
                                                           collective_latency_per_peer_s=1e-12)), 1e-7)
    return {"op_overhead_s": op, "op_row_s": row, "latency": latency}
