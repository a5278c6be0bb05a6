"""Serving benchmark: load against the running service (`moeplan serve`) with the asynchronous
`openai` client, beside the same bundle's static batch and other servers on the same checkpoint.

For each model (examples/tiny_moe, examples/qwen3_moe, and `qwen3_moe_hd32`, a head_dim-32 copy of
the latter for vLLM, whose CPU attention takes no head_dim below 32) and each rank count (1, 2, 4):
trace the training corpus, `moeplan compile` a torchrun bundle (1 node x R, default policy and mode),
`moeplan serve` it, and at each concurrency (1, 4, 16, 64) send `--requests-per-level` x concurrency
streamed requests (at least 8) of `--prompt-tokens` prompt tokens (held-out text cut to that many
tokens) and exactly `--new-tokens` output tokens (`ignore_eos`; greedy), at most `concurrency` in
flight. Figures: output tokens/s (all tokens over the level's wall time), time to first token and
inter-token latency p50/p99 (client-side, from each streamed chunk's arrival).

Beside it, in the same run, on the same machine (the client shares its cores):
* static: the same bundle's static batch (`moeplan run`, one launch per concurrency, batch =
  concurrency, its in-rank tokens/s: no start-up);
* transformers: `transformers serve --continuous-batching` (one process, fp32) on the same
  checkpoint, Hugging Face models only (it needs `fastapi` and `accelerate`: `pip install -e .[bench]`);
  `--peers transformers-nocb` adds it without continuous batching;
* vllm: vLLM's CPU build (`python -m vllm.entrypoints.openai.api_server`, VLLM_CPU_KVCACHE_SPACE=1,
  bf16 as it runs on CPU) from its own virtualenv, given by `--vllm-python` (see
  benchmarks/serving_vllm_setup.sh; never installed by the project, never run in tests or CI),
  on qwen3_moe_hd32 at 1 rank.
`--gloo-peer` serves each multi-rank bundle a second time with its exchanges over gloo (`MOEPLAN_EXCHANGE=gloo`:
runtime/ep/host_channel.py off) as the peer `moeplan-gloo`, at the same rank count. `--eager-peer` serves each
bundle of a Hugging Face model a second time with eager decode steps (`MOEPLAN_COMPILE=0` and
`MOEPLAN_CUDA_GRAPHS=0`: runtime/model/compiled_decode.py and, on a GPU, graph_decode.py off; several ranks then
exchange by dynamic gating, not gathered) as the peer
`moeplan-eager`, at the same rank count.
`--pair-peer` serves each model's 1-rank bundle twice side by side (two services of one rank each, a thread each,
no exchange at all) and splits each level's requests between them, as the peer `moeplan-2x1` at 2 ranks: what two
ranks of no communication serve on this machine's cores, a ceiling for the 2-rank service's ratio to 1 rank.
`--profile-at C` runs level C a second time with rank 0's own stack sampler on
(benchmarks/serving_profile.py) and prints where its time goes (exchange, attention, experts, sampling, other model compute, HTTP front, engine Python).
Ratios are ours / peer at the same concurrency. Peers are given the same prompts as text and told
to produce exactly `--new-tokens` (transformers: a generation_config with no EOS and
min_new_tokens; vLLM: ignore_eos).

    python benchmarks/serving.py [--models tiny_moe qwen3_moe qwen3_moe_hd32] [--ranks 1 2 4]
        [--concurrency 1 4 16 64] [--prompt-tokens 32] [--new-tokens 32] [--requests-per-level 2]
        [--peers static transformers] [--vllm-python PATH] [--gloo-peer] [--eager-peer] [--pair-peer]
        [--profile-at 16] [--json]
        [--keep DIR]
With --json the last line is {"rows": [...], "ratios": [...], "targets": {...}}. Where GPUs are
visible the ranks use them with nccl (benchmarks/gpu/serve_check.sh).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CORPUS = REPO / "examples" / "tiny_moe"
MODELS = ("tiny_moe", "qwen3_moe", "qwen3_moe_hd32")
HF_MODELS = ("qwen3_moe", "qwen3_moe_hd32")
EAGER_ENV = {"MOEPLAN_COMPILE": "0", "MOEPLAN_CUDA_GRAPHS": "0"}  # the eager peer: no compiled steps, no CUDA graphs
CLI = [sys.executable, "-m", "moeplan.planner.cli"]


# --- models and bundles ------------------------------------------------------------------------
def model_dir(name: str, scratch: Path) -> Path:
    if name == "tiny_moe":
        return REPO / "examples" / "tiny_moe"
    if name == "qwen3_moe":
        return REPO / "examples" / "qwen3_moe"
    out = scratch / "qwen3_moe_hd32"
    if not (out / "model.safetensors").is_file():
        build_head_dim_copy(REPO / "examples" / "qwen3_moe", out, head_dim=32)
    return out


def build_head_dim_copy(source: Path, out: Path, head_dim: int, seed: int = 0) -> None:
    """examples/qwen3_moe with attention heads of `head_dim`: every tensor whose shape is unchanged
    is the example's (embeddings, norms, routers, experts, head), the attention projections are
    seeded afresh. Throughput does not depend on the weights' quality; every server gets this one."""
    import torch
    import transformers

    config = transformers.AutoConfig.from_pretrained(source)
    config.head_dim = head_dim
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    donor = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).state_dict()
    state = model.state_dict()
    state.update({k: v for k, v in donor.items() if k in state and state[k].shape == v.shape})
    model.load_state_dict(state)
    model.save_pretrained(out)
    for name in ("tokenizer.json", "generation_config.json"):
        shutil.copy(source / name, out / name)


def prompts_for(model: Path, count: int, tokens: int) -> list:
    """`count` held-out text windows, each cut to `tokens` tokens of the model's tokenizer (bytes
    for TinyMoE) and decoded back: text every server reads, `tokens` tokens long in ours."""
    text = " ".join((CORPUS / "corpus_heldout.txt").read_text(encoding="utf-8").split())
    tokenizer_file = model / "tokenizer.json"
    if tokenizer_file.is_file():
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(tokenizer_file))
        ids = tok.encode(text).ids
        step = max(1, (len(ids) - tokens) // max(count, 1))
        return [tok.decode(ids[i * step: i * step + tokens]) for i in range(count)]
    step = max(1, (len(text) - tokens) // max(count, 1))
    return [text.encode()[i * step: i * step + tokens].decode("ascii", errors="replace") for i in range(count)]


def compile_bundle(model: Path, ranks: int, scratch: Path, trace_tokens: int, time_limit: float) -> Path:
    trace = scratch / f"trace-{model.name}.npz"
    if not trace.is_file():
        _run(CLI + ["trace", str(model), "--data", str(CORPUS / "corpus_train.txt"), "--out", str(trace),
                    "--max-tokens", str(trace_tokens)])
    out = scratch / f"bundle-{model.name}-{ranks}"
    if not out.is_dir():
        _run(CLI + ["compile", str(model), "--trace", str(trace), "--target", "torchrun", "--nodes", "1",
                    "--gpus-per-node", str(ranks), "--time-limit", str(time_limit), "--out", str(out)])
    return out


def _run(cmd: list, timeout: float = 1800) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:6])} ... failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return proc.stdout


# --- servers -----------------------------------------------------------------------------------
class Server:
    """A server process and its base URL; `ready` is a line prefix or a URL to poll."""

    def __init__(self, cmd: list, env: dict | None = None, cwd=None, url: str | None = None, timeout_s: float = 600):
        self.log = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE if url is None else self.log, stderr=self.log,
                                     text=True, env=dict(os.environ, **(env or {})), cwd=cwd, start_new_session=True)
        self.url = url or self._ready_line(timeout_s)
        if url is not None:
            self._poll(url + "/v1/models", timeout_s)

    def _ready_line(self, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        for line in self.proc.stdout:
            if line.startswith("serving on "):
                return line.split()[-1]
            if time.monotonic() > deadline:
                break
        raise RuntimeError(f"server did not start:\n{self.tail()}")

    def _poll(self, url: str, timeout_s: float) -> None:
        import urllib.request

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited ({self.proc.returncode}):\n{self.tail()}")
            try:
                urllib.request.urlopen(url, timeout=2).read()
                return
            except OSError:
                time.sleep(0.5)
        raise RuntimeError(f"server did not answer within {timeout_s} s:\n{self.tail()}")

    def tail(self) -> str:
        self.log.seek(0)
        return self.log.read()[-4000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


OURS_EXTRA = {"ignore_eos": True, "return_token_ids": True, "stream_options": {"include_usage": True}}  # our requests' body


def start_ours(bundle: Path, threads: int | None = None, stacks: Path | None = None, env: dict | None = None) -> Server:
    cmd = CLI + ["serve", str(bundle), "--port", "0"] + (["--threads", str(threads)] if threads else [])
    # rank 0 runs benchmarks/stack_sampler.py through the runtime's profiler hook (bundles ship no profiler)
    hook = {"MOEPLAN_PROFILE": str(stacks), "MOEPLAN_PROFILER": str(Path(__file__).with_name("stack_sampler.py"))}
    return Server(cmd, env={**(hook if stacks else {}), **(env or {})})


def start_transformers(model: Path, continuous: bool) -> Server:
    port = free_port()
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    cmd = [sys.executable, "-m", "transformers.cli.transformers", "serve", str(model), "--port", str(port),
           "--host", "127.0.0.1", "--device", device, "--dtype", "float32"] + (["--continuous-batching"] if continuous else [])
    return Server(cmd, env={"OMP_NUM_THREADS": str(os.cpu_count() or 1)}, url=f"http://127.0.0.1:{port}")


def start_vllm(python: str, model: Path, tensor_parallel: int = 1) -> Server:
    """vLLM-CPU; at 2 ranks its TP=2 without expert parallelism (its CPU EP crashes: TP=2 + EP segfaults
    in cpu_fused_moe, DP + EP has no CPU all-gatherv)."""
    port = free_port()
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--port", str(port),
           "--host", "127.0.0.1", "--max-model-len", "256", "--tensor-parallel-size", str(tensor_parallel)]
    return Server(cmd, env={"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_TARGET_DEVICE": "cpu"}, url=f"http://127.0.0.1:{port}")


# --- load --------------------------------------------------------------------------------------
async def _one(client, model: str, prompt: str, new_tokens: int, extra: dict, record: list) -> None:
    sent = time.perf_counter()
    arrivals, tokens = [], None
    stream = await client.completions.create(model=model, prompt=prompt, max_tokens=new_tokens, temperature=0,
                                             stream=True, extra_body=extra)
    async for chunk in stream:
        now = time.perf_counter()
        if chunk.choices and (chunk.choices[0].text or (chunk.choices[0].model_extra or {}).get("token_ids")):
            ids = (chunk.choices[0].model_extra or {}).get("token_ids")
            arrivals += [now] * (len(ids) if ids else 1)
        if getattr(chunk, "usage", None) is not None:
            tokens = chunk.usage.completion_tokens
    record.append({"sent": sent, "arrivals": arrivals, "tokens": tokens if tokens is not None else len(arrivals)})


async def _load(url: str, model: str, prompts: list, concurrency: int, total: int, new_tokens: int, extra: dict) -> dict:
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
    gate = asyncio.Semaphore(concurrency)
    record: list = []

    async def guarded(i):
        async with gate:
            await _one(client, model, prompts[i % len(prompts)], new_tokens, extra, record)

    start = time.perf_counter()
    await asyncio.gather(*(guarded(i) for i in range(total)))
    wall = time.perf_counter() - start
    await client.close()
    ttft = [r["arrivals"][0] - r["sent"] for r in record if r["arrivals"]]
    itl = [b - a for r in record for a, b in zip(r["arrivals"], r["arrivals"][1:])]
    tokens = sum(r["tokens"] for r in record)
    return {"requests": total, "output_tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
            "ttft_p50_s": _pct(ttft, 50), "ttft_p99_s": _pct(ttft, 99), "itl_p50_s": _pct(itl, 50),
            "itl_p99_s": _pct(itl, 99), "load_average": os.getloadavg()[0]}


def _pct(values: list, q: float):
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, max(0, int(round(q / 100 * (len(values) - 1)))))]


def measure(url: str, model: str, prompts: list, concurrency: int, per_level: int, new_tokens: int, extra: dict) -> dict:
    asyncio.run(_load(url, model, prompts, 2, 2, new_tokens, extra))  # warm-up
    total = max(8, per_level * concurrency)
    return asyncio.run(_load(url, model, prompts, concurrency, total, new_tokens, extra))


def profile(stacks: Path, load) -> dict:
    """Share of rank 0's samples per category (serving_profile.py) while `load` runs again."""
    import serving_profile

    def snapshot() -> dict:  # the front's process and rank 0's engine process (FILE.engine)
        front, engine = serving_profile.snapshot(stacks), serving_profile.snapshot(f"{stacks}.engine")
        return {k: front.get(k, 0) + engine.get(k, 0) for k in set(front) | set(engine)}

    time.sleep(1.2)  # the sampler writes its counts every second
    before = snapshot()
    load()
    time.sleep(1.2)
    return serving_profile.shares(before, snapshot())


def static_tokens_per_s(bundle: Path, prompts: list, new_tokens: int, scratch: Path) -> float:
    """Today's `moeplan run`: one static batch of len(prompts), tokens/s measured in the ranks."""
    path = scratch / f"static-{len(prompts)}.txt"
    path.write_text("\n".join(p.replace("\n", " ") for p in prompts) + "\n")
    plan = json.loads((bundle / "plan.json").read_text())
    report = json.loads(_run(CLI + ["run", str(bundle), "--prompts", str(path), "--new-tokens", str(new_tokens),
                                    "--mode", plan["communication"]["mode"], "--json"]).strip().splitlines()[-1])
    return report["tokens_per_second"]


# --- the run -----------------------------------------------------------------------------------
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["tiny_moe", "qwen3_moe"], choices=MODELS)
    ap.add_argument("--ranks", nargs="+", type=int, default=[1, 2, 4])
    ap.add_argument("--concurrency", nargs="+", type=int, default=[1, 4, 16, 64])
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--requests-per-level", type=int, default=2, help="requests per level = this x concurrency (>= 8)")
    ap.add_argument("--peers", nargs="*", default=["static", "transformers"],
                    choices=["static", "transformers", "transformers-nocb"])
    ap.add_argument("--vllm-python", default=None, help="python of a virtualenv with vllm-cpu (serving_vllm_setup.sh)")
    ap.add_argument("--eager-peer", action="store_true",
                    help="serve every bundle of a Hugging Face model again with MOEPLAN_COMPILE=0 and MOEPLAN_CUDA_GRAPHS=0 (eager decode steps, "
                         "dynamic gating between ranks) as the peer `moeplan-eager`")
    ap.add_argument("--gloo-peer", action="store_true",
                    help="serve every multi-rank bundle again with MOEPLAN_EXCHANGE=gloo (the process group's collectives "
                         "in place of the shared-memory channel of ranks on one host) as the peer `moeplan-gloo`")
    ap.add_argument("--pair-peer", action="store_true",
                    help="serve each model's 1-rank bundle twice side by side, each level's requests split between "
                         "them, as the peer `moeplan-2x1` (two ranks with no exchange: the 2-rank service's ceiling here)")
    ap.add_argument("--trace-tokens", type=int, default=4096)
    ap.add_argument("--time-limit", type=float, default=30.0, help="compile's ILP time limit")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads per rank (moeplan serve --threads); default: the cores but one over the "
                         "ranks (at least 1): rank 0's HTTP front is a process of its own beside its engine's, and the "
                         "load client runs here too (measured on 2 cores, 1 rank: 2 threads gave 129 / 795 / 791 "
                         "tok/s at c=1/16/64, 1 thread 125 / 1,145 / 1,896)")
    ap.add_argument("--profile-at", type=int, default=None,
                    help="at this concurrency, run the level again and report where rank 0's time goes "
                         "(benchmarks/serving_profile.py)")
    ap.add_argument("--keep", default=None, help="keep bundles and traces here (reused when present)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    scratch = (Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="moeplan-serving-bench-"))).resolve()
    scratch.mkdir(parents=True, exist_ok=True)
    rows = []
    try:
        for name in args.models:
            model = model_dir(name, scratch)
            prompts = prompts_for(model, max(args.concurrency), args.prompt_tokens)
            for ranks in args.ranks:
                bundle = compile_bundle(model, ranks, scratch, args.trace_tokens, args.time_limit)
                stacks = scratch / f"stacks-{name}-{ranks}.txt"
                server = start_ours(bundle, _threads(args, ranks), stacks if args.profile_at else None)
                try:
                    extra = OURS_EXTRA
                    for c in args.concurrency:
                        load = lambda: measure(server.url, served_name(bundle), prompts, c, args.requests_per_level,  # noqa: B023 (called within this iteration)
                                               args.new_tokens, extra)  # noqa: B023 (called within this iteration)
                        row = {"model": name, "server": "moeplan", "ranks": ranks, "concurrency": c, **load()}
                        if c == args.profile_at:  # a second pass under py-spy, so the figures above are unperturbed
                            row["profile_rank0"] = profile(stacks, load)
                        rows.append(row)
                        _print(row, args.json)
                finally:
                    server.stop()
                if "static" in args.peers:
                    for c in args.concurrency:
                        rows.append({"model": name, "server": "static", "ranks": ranks, "concurrency": c,
                                     "tokens_per_s": static_tokens_per_s(bundle, prompts[:c], args.new_tokens, scratch)})
                        _print(rows[-1], args.json)
            peers = [p for p in args.peers if p.startswith("transformers")] if name in HF_MODELS else []
            for peer in peers:
                rows += _peer_rows(name, peer, lambda: start_transformers(model, peer == "transformers"), str(model),  # noqa: B023 (called within this iteration)
                                   prompts, args, {"generation_config": json.dumps({
                                       "max_new_tokens": args.new_tokens, "min_new_tokens": args.new_tokens,
                                       "do_sample": False})})
            if args.gloo_peer:  # the same bundles with the ranks' exchanges over gloo (runtime/ep/host_channel.py off)
                for ranks in [r for r in args.ranks if r > 1]:
                    bundle = compile_bundle(model, ranks, scratch, args.trace_tokens, args.time_limit)
                    rows += _peer_rows(name, "moeplan-gloo", lambda: start_ours(bundle, _threads(args, ranks), env={"MOEPLAN_EXCHANGE": "gloo"}),  # noqa: B023 (called within this iteration)
                                       served_name(bundle), prompts, args, OURS_EXTRA, ranks=ranks)
            if args.eager_peer and name in HF_MODELS:  # the same bundles with eager decode steps (compiled_decode.py off)
                for ranks in args.ranks:
                    bundle = compile_bundle(model, ranks, scratch, args.trace_tokens, args.time_limit)
                    rows += _peer_rows(name, "moeplan-eager", lambda: start_ours(bundle, _threads(args, ranks), env=EAGER_ENV),  # noqa: B023 (called within this iteration)
                                       served_name(bundle), prompts, args, OURS_EXTRA, ranks=ranks)
            if args.pair_peer:
                rows += _pair_rows(name, compile_bundle(model, 1, scratch, args.trace_tokens, args.time_limit), prompts, args)
            if args.vllm_python and name == "qwen3_moe_hd32":
                for tp in [r for r in args.ranks if r in (1, 2)]:
                    rows += _peer_rows(name, "vllm", lambda: start_vllm(args.vllm_python, model, tp), str(model),  # noqa: B023 (called within this iteration)
                                       prompts, args, {"ignore_eos": True, "stream_options": {"include_usage": True}},
                                       ranks=tp)
    finally:
        if not args.keep:
            shutil.rmtree(scratch, ignore_errors=True)
    report = {"rows": rows, "ratios": ratios(rows), "targets": targets(rows)}
    _summary(report)
    if args.json:
        print(json.dumps(report))
    return 0


def _threads(args, ranks: int) -> int:
    """Torch threads per rank: `--threads`, else the cores but one over the ranks (at least 1)."""
    return args.threads or max(1, ((os.cpu_count() or 1) - 1) // ranks)


def served_name(bundle: Path) -> str:
    return json.loads((bundle / "plan.json").read_text())["model"]["name"]


def _peer_rows(name, peer, start, served_name, prompts, args, extra, ranks: int = 1) -> list:
    rows = []
    try:
        server = start()
    except (RuntimeError, OSError) as exc:
        print(f"note: {peer} did not start on {name}: {str(exc).splitlines()[0] if str(exc) else exc}", file=sys.stderr)
        return rows
    try:
        for c in args.concurrency:
            row = {"model": name, "server": peer, "ranks": ranks, "concurrency": c,
                   **measure(server.url, served_name, prompts, c, args.requests_per_level, args.new_tokens, extra)}
            rows.append(row)
            _print(row, args.json)
    finally:
        server.stop()
    return rows


def _pair_rows(name: str, bundle: Path, prompts: list, args) -> list:
    """Two 1-rank services of `bundle` side by side, a thread each; at every level half the requests (and half
    the concurrency, at least one) go to each, at once: tokens of both over the longer wall time."""
    servers = []
    try:
        for _ in range(2):
            servers.append(start_ours(bundle, _threads(args, 2)))
        rows = []
        for c in args.concurrency:
            half = max(1, c // 2)
            asyncio.run(_pair_load(servers, served_name(bundle), prompts, 1, 2, args.new_tokens))  # warm-up
            row = {"model": name, "server": "moeplan-2x1", "ranks": 2, "concurrency": c,
                   **asyncio.run(_pair_load(servers, served_name(bundle), prompts, half,
                                            max(4, args.requests_per_level * half), args.new_tokens))}
            rows.append(row)
            _print(row, args.json)
        return rows
    finally:
        for server in servers:
            server.stop()


async def _pair_load(servers: list, model: str, prompts: list, concurrency: int, total: int, new_tokens: int) -> dict:
    halves = await asyncio.gather(*(_load(s.url, model, prompts[i::2] or prompts, concurrency, total, new_tokens,
                                          OURS_EXTRA) for i, s in enumerate(servers)))
    wall = max(h["wall_s"] for h in halves)
    tokens = sum(h["output_tokens"] for h in halves)
    return {"requests": sum(h["requests"] for h in halves), "output_tokens": tokens, "wall_s": wall,
            "tokens_per_s": tokens / wall, "load_average": os.getloadavg()[0],
            **{k: max(h[k] for h in halves) for k in ("ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s")}}


def ratios(rows: list) -> list:
    """ours / peer tokens/s at the same model and concurrency; the static batch and vLLM at the same rank
    count, transformers (one process) against every rank count."""
    out = []
    for r in rows:
        if r["server"] != "moeplan":
            continue
        for p in rows:
            same_ranks = p["ranks"] == r["ranks"] or p["server"].startswith("transformers")  # one process: all ranks
            if p["model"] == r["model"] and p["concurrency"] == r["concurrency"] and p["server"] != "moeplan" and same_ranks:
                out.append({"model": r["model"], "ranks": r["ranks"], "concurrency": r["concurrency"], "peer": p["server"],
                            "ratio": r["tokens_per_s"] / p["tokens_per_s"]})
    return out


def targets(rows: list) -> dict:
    def tps(model, server, ranks, c):
        return next((r["tokens_per_s"] for r in rows if (r["model"], r["server"], r["ranks"], r["concurrency"]) ==
                     (model, server, ranks, c)), None)

    out = {}
    c1, c16 = tps("tiny_moe", "moeplan", 1, 1), tps("tiny_moe", "moeplan", 1, 16)
    if c1 and c16:
        out["tiny_moe_1rank_c16_over_c1"] = {"value": c16 / c1, "target": 4.0}
    for model in HF_MODELS:
        ours, theirs = tps(model, "moeplan", 1, 16), tps(model, "transformers", 1, 16)
        if ours and theirs:
            out[f"{model}_1rank_c16_over_transformers"] = {"value": ours / theirs, "target": 1.0}
        for c, goal in ((1, 0.8), (16, 1.2), (64, 1.2)):  # issue 39's targets against vLLM-CPU at one rank
            ours, theirs = tps(model, "moeplan", 1, c), tps(model, "vllm", 1, c)
            if ours and theirs:
                out[f"{model}_1rank_c{c}_over_vllm"] = {"value": ours / theirs, "target": goal}
        one, two = tps(model, "moeplan", 1, 64), tps(model, "moeplan", 2, 64)
        if one and two:
            out[f"{model}_2ranks_over_1rank_c64"] = {"value": two / one, "target": 0.8}
        pair = tps(model, "moeplan-2x1", 2, 64)
        if one and pair:  # not a target: what two ranks with no exchange at all reach on these cores
            out[f"{model}_2x1_no_exchange_over_1rank_c64"] = {"value": pair / one, "target": None}
    return out


def _fmt(v, scale=1.0, digits=1):
    return "-" if v is None else f"{v * scale:.{digits}f}"


def _print(row: dict, quiet: bool) -> None:
    print(f"{row['model']:>15} {row['server']:>17} ranks {row['ranks']} c={row['concurrency']:>3}: "
          f"{row['tokens_per_s']:8.1f} tok/s  ttft p50/p99 {_fmt(row.get('ttft_p50_s'), 1e3)}/"
          f"{_fmt(row.get('ttft_p99_s'), 1e3)} ms  itl p50/p99 {_fmt(row.get('itl_p50_s'), 1e3, 2)}/"
          f"{_fmt(row.get('itl_p99_s'), 1e3, 2)} ms  load {_fmt(row.get('load_average'), 1.0, 2)}", file=sys.stderr if quiet else sys.stdout, flush=True)


def _summary(report: dict) -> None:
    print("\nratios (ours / peer, output tokens/s):")
    for r in report["ratios"]:
        print(f"  {r['model']:>15} ranks {r['ranks']} c={r['concurrency']:>3} vs {r['peer']:>17}: {r['ratio']:.2f}x")
    profiled = [r for r in report["rows"] if r.get("profile_rank0")]
    if profiled:
        print("where rank 0's time goes (its threads' stack samples, idle waits left out):")
    for r in profiled:
        shares = ", ".join(f"{k} {v:.0%}" for k, v in sorted(r["profile_rank0"].items(), key=lambda i: -i[1]) if v >= 0.005)
        print(f"  {r['model']:>15} ranks {r['ranks']} c={r['concurrency']:>3}: {shares}")
    print("targets:")
    for key, t in report["targets"].items():
        if t["target"] is None:
            print(f"  {key}: {t['value']:.2f}x (a ceiling, no target)")
            continue
        print(f"  {key}: {t['value']:.2f}x (target {t['target']:.1f}x) {'met' if t['value'] >= t['target'] else 'NOT met'}")


if __name__ == "__main__":
    sys.exit(main())
