"""A rank's real resident memory beside what the Kubernetes manifests request for it (issue 29 item 5).

For each model and rank count (1 node x R ranks, as one Kubernetes pod holds them): compile
`--target kubernetes`, then
* `moeplan serve` the bundle: every process of the pod (torchrun's agent and each rank) read from
  /proc/PID/status once the service is ready (idle) and again after `--requests` streamed requests
  at concurrency `--concurrency` of `--prompt-tokens` + `--new-tokens` tokens (`ignore_eos`);
* `moeplan run` it (one static batch of `--concurrency` prompts): each process's peak, polled.
Per rank: its shard bytes S (as stored) and held bytes F (what the runtime holds: float32 on CPU, runtime/precision.py), the measured
peak resident set (VmHWM; serving rank 0 is two processes, the front's torchrun started and the engine's it
starts, runtime/serving/engine_process.py: the sum of their peaks), and VmHWM - (S + F): what a rank holds beyond loading its weights
(Python, torch, the process group, the library, the HTTP front on rank 0), which the manifests add
per rank (`backends/kubernetes/pod_memory.py`: RANK_OVERHEAD_MIB, FRONT_OVERHEAD_MIB, AGENT_MIB).
Per pod: the memory the manifest requests beside the sum of the pod's measured peaks, as a ratio
(>= 1: the request covers what the pod really holds; on CPU the weights stay resident in host memory,
on a GPU node they move to the device after loading, so a CPU run is the harder case for the weights
term; CUDA's own host memory is not measured here: benchmarks/gpu/serve_check.sh runs this script
on a GPU).

It ends with three lines, `measured rank overhead`, `measured front overhead` and `measured agent
overhead` (MiB), which docs/serving.md records and tests/test_kubernetes_serving.py checks the
constants against, and the requested / measured range per pod.

Models: examples/tiny_moe and examples/qwen3_moe (float32 checkpoints), and `qwen3_moe_wide`, a
random-weight Qwen3-MoE of ~80M parameters stored in bfloat16 (built here; its tokenizer is the
example's), held out from choosing the constants: it checks the weights term (S + F, read buffer and
float32 copy) at a size where the weights, not the interpreter, dominate.

    python benchmarks/rank_memory.py [--models tiny_moe qwen3_moe qwen3_moe_wide] [--ranks 1 2]
        [--concurrency 16] [--requests 32] [--prompt-tokens 64] [--new-tokens 64] [--json] [--keep DIR]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import serving as bench  # benchmarks/serving.py: prompts, the service, the load
from moeplan.planner.launch.torchrun_serve import worker_pids as children  # a process's children, from /proc

REPO = bench.REPO
CLI = bench.CLI
MODELS = ("tiny_moe", "qwen3_moe", "qwen3_moe_wide")
MIB = 1 << 20


# --- models and bundles ------------------------------------------------------------------------
def model_dir(name: str, scratch: Path) -> Path:
    if name != "qwen3_moe_wide":
        return REPO / "examples" / name
    out = scratch / name
    if not (out / "model.safetensors").is_file():
        build_wide(REPO / "examples" / "qwen3_moe", out)
    return out


def build_wide(source: Path, out: Path, seed: int = 0) -> None:
    """A Qwen3-MoE with the example's tokenizer and ~80M random parameters stored in bfloat16."""
    import torch
    import transformers

    config = transformers.Qwen3MoeConfig(
        vocab_size=384, hidden_size=512, intermediate_size=1024, moe_intermediate_size=512, num_hidden_layers=6,
        num_attention_heads=8, num_key_value_heads=4, head_dim=64, num_experts=16, num_experts_per_tok=2,
        norm_topk_prob=True, max_position_embeddings=512, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0,
        pad_token_id=0)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).to(torch.bfloat16)
    model.save_pretrained(out)
    shutil.copy(source / "tokenizer.json", out / "tokenizer.json")


def compile_bundle(model: Path, ranks: int, scratch: Path) -> Path:
    trace = scratch / f"trace-{model.name}.npz"
    if not trace.is_file():
        bench._run(CLI + ["trace", str(model), "--data", str(REPO / "examples/tiny_moe/corpus_train.txt"), "--out",
                          str(trace), "--max-tokens", "2048"])
    out = scratch / f"bundle-{model.name}-{ranks}"
    if not out.is_dir():
        bench._run(CLI + ["compile", str(model), "--trace", str(trace), "--target", "kubernetes", "--nodes", "1",
                          "--gpus-per-node", str(ranks), "--policy", "contiguous", "--cpu-only", "--image",
                          "registry.example/moe:1", "--out", str(out)])
    return out


def rank_weight_bytes(bundle: Path, rank: int) -> tuple:
    """(S, F): rank's tensor bytes as stored and as the runtime holds them (the codegen's own reading of the shard)."""
    from moeplan.backends.kubernetes.pod_memory import rank_weight_bytes as read

    plan = json.loads((bundle / "plan.json").read_text())
    return read(bundle / plan["shards"][rank], plan["communication"]["capacity"]["weight_dtypes"])[:2]


def requested_pod_mib(bundle: Path) -> int:
    """The memory node 0's pod requests (the service's head StatefulSet, or with --batch-job the Job's)."""
    import yaml

    for name in ("statefulset.yaml", "job.yaml"):
        path = bundle / "kubernetes" / name
        if path.is_file():
            spec = yaml.safe_load(path.read_text())["spec"]["template"]["spec"]
            return int(spec["containers"][0]["resources"]["requests"]["memory"].removesuffix("Mi"))
    raise RuntimeError(f"{bundle}/kubernetes holds no statefulset.yaml or job.yaml")


# --- reading processes -------------------------------------------------------------------------
def status_kib(pid: int) -> dict:
    """VmRSS and VmHWM of `pid`, KiB ({} once it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            return {k: int(v.split()[0]) for k, v in (l.split(":", 1) for l in fh) if k in ("VmRSS", "VmHWM")}
    except OSError:
        return {}


def rank_of(pid: int):
    try:
        with open(f"/proc/{pid}/environ", "rb") as fh:
            env = dict(kv.split(b"=", 1) for kv in fh.read().split(b"\0") if b"=" in kv)
        return int(env[b"RANK"]) if b"RANK" in env else None
    except (OSError, ValueError):
        return None


def pod_processes(root_pid: int) -> dict:
    """{"agent": torchrun's pid, rank: pid, (rank, "engine"): pid} under `root_pid` (moeplan serve / run, or
    torchrun itself): a serving rank 0 is two processes, torchrun's (the HTTP front and the scheduler) and the
    engine's it starts (runtime/serving/engine_process.py, same RANK: it joins the process group as rank 0)."""
    found = {}
    stack = [root_pid]
    while stack:
        pid = stack.pop()
        for child in children(pid):
            rank = rank_of(child)
            if rank is None:
                found.setdefault("agent", child)
            elif rank_of(pid) == rank:
                found[(rank, "engine")] = child
            else:
                found[rank] = child
            stack.append(child)
    return found


def rank_total(kib: dict, rank: int) -> int:
    """KiB of rank `rank`'s processes together (torchrun's and, serving rank 0, its engine's)."""
    return kib.get(rank, 0) + kib.get((rank, "engine"), 0)


class PeakWatcher:
    """Polls a process tree's VmHWM (which only grows) until stopped; keeps each process's last value."""

    def __init__(self, root_pid: int, period_s: float = 0.1):
        self.root, self.period, self.peak, self._stop = root_pid, period_s, {}, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            for who, pid in pod_processes(self.root).items():
                hwm = status_kib(pid).get("VmHWM")
                if hwm:
                    self.peak[who] = max(self.peak.get(who, 0), hwm)
            time.sleep(self.period)

    def stop(self) -> dict:
        self._stop.set()
        self.thread.join()
        return dict(self.peak)


# --- the run -----------------------------------------------------------------------------------
def measure_serve(bundle: Path, prompts: list, concurrency: int, requests: int, new_tokens: int) -> dict:
    server = bench.start_ours(bundle)
    watcher = PeakWatcher(server.proc.pid)
    try:
        time.sleep(1.0)
        idle = {who: status_kib(pid) for who, pid in pod_processes(server.proc.pid).items()}
        extra = {"ignore_eos": True, "stream_options": {"include_usage": True}}
        asyncio.run(bench._load(server.url, bench.served_name(bundle), prompts, concurrency, requests, new_tokens, extra))
        loaded = {who: status_kib(pid) for who, pid in pod_processes(server.proc.pid).items()}
    finally:
        peak = watcher.stop()
        server.stop()
    return {"idle": idle, "loaded": loaded, "peak": peak}


def measure_run(bundle: Path, prompts: list, new_tokens: int, scratch: Path) -> dict:
    path = scratch / "static-prompts.txt"
    path.write_text("\n".join(p.replace("\n", " ") for p in prompts) + "\n")
    proc = subprocess.Popen(CLI + ["run", str(bundle), "--prompts", str(path), "--new-tokens", str(new_tokens), "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    watcher = PeakWatcher(proc.pid, 0.05)
    out, err = proc.communicate(timeout=1800)
    peak = watcher.stop()
    if proc.returncode != 0:
        raise RuntimeError(f"moeplan run failed ({proc.returncode}):\n{err[-3000:]}")
    return {"peak": peak}


def rows_for(name: str, ranks: int, bundle: Path, serve: dict, run: dict) -> dict:
    per_rank = []
    def rss(moment: str, r: int) -> int:
        return rank_total({who: kib.get("VmRSS", 0) for who, kib in serve[moment].items()}, r) * 1024

    for r in range(ranks):
        s, f = rank_weight_bytes(bundle, r)
        serve_peak, run_peak = rank_total(serve["peak"], r) * 1024, rank_total(run["peak"], r) * 1024
        hwm = max(serve_peak, run_peak)
        per_rank.append({"rank": r, "shard_bytes": s, "float32_bytes": f, "peak_bytes": hwm,
                         "serve_peak_bytes": serve_peak, "run_peak_bytes": run_peak,
                         "serve_engine_peak_bytes": serve["peak"].get((r, "engine"), 0) * 1024,
                         "idle_rss_bytes": rss("idle", r), "loaded_rss_bytes": rss("loaded", r),
                         "beyond_weights_bytes": hwm - (s + f)})
    agent = max(serve["peak"].get("agent", 0), run["peak"].get("agent", 0)) * 1024
    measured = agent + sum(p["peak_bytes"] for p in per_rank)
    requested = requested_pod_mib(bundle) * MIB
    return {"model": name, "ranks": ranks, "per_rank": per_rank, "agent_peak_bytes": agent,
            "pod_measured_bytes": measured, "pod_requested_bytes": requested, "ratio": requested / measured}


def measured_overheads(rows: list) -> dict:
    """Bytes: a rank beyond S + F without the front (every rank of `run`, ranks 1.. of `serve`), the
    front (rank 0 serving, beyond the largest front-less rank of the same bundle), torchrun's agent."""
    rank = front = 0
    for row in rows:
        plain = [p["run_peak_bytes"] - p["shard_bytes"] - p["float32_bytes"] for p in row["per_rank"]]
        plain += [p["serve_peak_bytes"] - p["shard_bytes"] - p["float32_bytes"] for p in row["per_rank"] if p["rank"]]
        head = row["per_rank"][0]
        rank = max(rank, max(plain))
        front = max(front, head["serve_peak_bytes"] - head["shard_bytes"] - head["float32_bytes"] - max(plain))
    return {"rank": rank, "front": front, "agent": max(r["agent_peak_bytes"] for r in rows)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    ap.add_argument("--ranks", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--keep", default=None, help="keep models, traces and bundles here (reused when present)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    scratch = (Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="moeplan-rank-memory-"))).resolve()
    scratch.mkdir(parents=True, exist_ok=True)
    rows = []
    try:
        for name in args.models:
            model = model_dir(name, scratch)
            prompts = bench.prompts_for(model, args.concurrency, args.prompt_tokens)
            for ranks in args.ranks:
                bundle = compile_bundle(model, ranks, scratch)
                serve = measure_serve(bundle, prompts, args.concurrency, args.requests, args.new_tokens)
                run = measure_run(bundle, prompts, args.new_tokens, scratch)
                rows.append(rows_for(name, ranks, bundle, serve, run))
                _print(rows[-1])
    finally:
        if not args.keep:
            shutil.rmtree(scratch, ignore_errors=True)
    overheads = measured_overheads(rows)
    print(f"\nmeasured rank overhead: {overheads['rank'] / MIB:.1f} MiB (a rank beyond S + F, without the HTTP front)")
    print(f"measured front overhead: {overheads['front'] / MIB:.1f} MiB (rank 0 serving beyond the same run's other ranks)")
    print(f"measured agent overhead: {overheads['agent'] / MIB:.1f} MiB (torchrun's agent)")
    print(f"requested / measured per pod: min {min(r['ratio'] for r in rows):.2f}x, max {max(r['ratio'] for r in rows):.2f}x")
    if args.json:
        print(json.dumps({"rows": rows, "overheads": overheads}))
    return 0


def _print(row: dict) -> None:
    for p in row["per_rank"]:
        print(f"{row['model']:>15} ranks {row['ranks']} rank {p['rank']}: S {p['shard_bytes'] / MIB:7.1f} MiB  "
              f"F {p['float32_bytes'] / MIB:7.1f} MiB  peak {p['peak_bytes'] / MIB:7.1f} MiB (serve "
              f"{p['serve_peak_bytes'] / MIB:.1f}{_engine_part(p)}, run {p['run_peak_bytes'] / MIB:.1f}; idle RSS {p['idle_rss_bytes'] / MIB:.1f}, "
              f"loaded RSS {p['loaded_rss_bytes'] / MIB:.1f})  beyond S+F {p['beyond_weights_bytes'] / MIB:7.1f} MiB",
              flush=True)
    print(f"{row['model']:>15} ranks {row['ranks']} pod: agent {row['agent_peak_bytes'] / MIB:.1f} MiB, measured "
          f"{row['pod_measured_bytes'] / MIB:.1f} MiB, requested {row['pod_requested_bytes'] / MIB:.0f} MiB "
          f"({row['ratio']:.2f}x)", flush=True)


def _engine_part(p: dict) -> str:
    engine = p["serve_engine_peak_bytes"]
    if not engine:
        return ""
    return f" = front {(p['serve_peak_bytes'] - engine) / MIB:.1f} + engine {engine / MIB:.1f}"


if __name__ == "__main__":
    sys.exit(main())
