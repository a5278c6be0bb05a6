"""Serving-engine benchmark: continuous batching at the EngineClient, no HTTP, beside the same
bundle's static batch, in one process at 1 rank (what the engine itself costs per token).

The model's training corpus is traced, `moeplan compile` writes a 1-rank torchrun bundle (default
policy, `--mode`), and the bundle's engine serves in this process (`serving.ranks.serve_bundle`,
world of one: no process group) with a closed-loop client at each concurrency: C clients, each
sending `--requests-per-client` requests one after another of `--prompt-tokens` held-out prompt
bytes and exactly `--new-tokens` greedy tokens (`ignore_eos`). Figures per level: output tokens/s
(wall), the engine thread's CPU seconds per output token (robust to a shared machine: read
`engine_cpu_ms_per_token`), time to first token and inter-token latency p50 (rank 0's event times).

Baselines, measured in the same run:
* the same engine at concurrency 1 (ratio `over_c1`: what continuous batching buys);
* the static batch: the bundle's `static_batch.run_batch` on C prompts at once (`moeplan run`'s
  loop, in-process: ratio `over_static`, output tokens/s).

    python benchmarks/serving_engine.py [--model DIR] [--mode standard|coherent] [--concurrency 1 4 16]
        [--prompt-tokens 32] [--new-tokens 32] [--requests-per-client 3] [--json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent


def compile_bundle(model: Path, mode: str, scratch: Path) -> Path:
    corpus = model / "corpus_train.txt"
    cli = [sys.executable, "-m", "moeplan.planner.cli"]
    subprocess.run(cli + ["trace", str(model), "--data", str(corpus), "--out", str(scratch / "t.npz"), "--seq-len", "64",
                          "--max-tokens", "4096", "--quiet"], check=True)
    subprocess.run(cli + ["compile", str(model), "--trace", str(scratch / "t.npz"), "--mode", mode, "--out",
                          str(scratch / "bundle"), "--quiet"], check=True)
    return scratch / "bundle"


def prompts_of(model: Path, count: int, length: int) -> list:
    text = " ".join((model / "corpus_heldout.txt").read_text(encoding="utf-8").split()).encode("utf-8")
    step = max(1, (len(text) - length) // max(count, 1))
    return [tuple(text[i * step: i * step + length]) for i in range(count)]


def engine_cpu_s() -> float:
    thread = next(t for t in threading.enumerate() if t.name == "engine-loop")
    return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))


def closed_loop(client, prompts: list, concurrency: int, per_client: int, new_tokens: int) -> dict:
    from runtime.serving.contract import GenerationRequest, SamplingParams

    ttft, itl, tokens = [], [], [0]
    lock = threading.Lock()

    def one_client(c):
        for k in range(per_client):
            done, times = threading.Event(), []

            def sink(event):
                if event.token_id >= 0:
                    times.append(event.time_s)  # noqa: B023 (called within this iteration)
                if event.finish_reason:
                    done.set()  # noqa: B023 (called within this iteration)
            start = time.monotonic()
            client.submit(GenerationRequest(f"c{concurrency}-{c}-{k}", prompts[(c * per_client + k) % len(prompts)],
                                            new_tokens, SamplingParams(temperature=0.0), (), True), sink)
            done.wait()
            with lock:
                tokens[0] += len(times)
                ttft.append(times[0] - start)
                itl.extend(b - a for a, b in zip(times, times[1:]))

    threads = [threading.Thread(target=one_client, args=(c,)) for c in range(concurrency)]
    cpu0, wall0 = engine_cpu_s(), time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall, cpu = time.perf_counter() - wall0, engine_cpu_s() - cpu0
    return {"tokens_per_s": tokens[0] / wall, "engine_cpu_ms_per_token": 1e3 * cpu / tokens[0],
            "ttft_p50_ms": 1e3 * statistics.median(ttft), "itl_p50_ms": 1e3 * statistics.median(itl)}


def static_batch(bundle: Path, mode: str, prompts: list, new_tokens: int) -> float:
    """Output tokens/s of `moeplan run`'s static batch (the same worker) on `prompts` as one batch (after a warm-up)."""
    from runtime.counters import Counters
    from runtime.ep.engine import Engine
    from runtime.ep.exchange import Exchanger
    from runtime.bundle_io import load_bundle
    from runtime.serving.static_batch import run_batch
    from runtime.serving.worker import BatchWorker

    _, table, _, model, _ = load_bundle(bundle, 0, 1, torch.device("cpu"), mode)
    best = 0.0
    for _ in range(2):
        counters = Counters(model.num_layers)
        engine = Engine(model, table, Exchanger(0, 1, counters, torch.device("cpu")), counters, 0, 1, mode,
                        torch.device("cpu"), model.top_k)
        worker = BatchWorker(engine, model.kind, tokens_to_rank0=False)
        try:
            elapsed = run_batch(worker, [list(p) for p in prompts], new_tokens)["elapsed_s"]
        finally:
            worker.close()
        best = max(best, len(prompts) * new_tokens / elapsed)
    return best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(REPO / "examples" / "tiny_moe"))
    ap.add_argument("--mode", default="standard", choices=("standard", "coherent"))
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--requests-per-client", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    model = Path(args.model).resolve()
    with tempfile.TemporaryDirectory(prefix="moeplan-serving-engine-") as scratch:
        bundle = compile_bundle(model, args.mode, Path(scratch))
        sys.path.insert(0, str(bundle))  # the bundle's own runtime
        from runtime.serving.ranks import serve_bundle

        prompts = prompts_of(model, 64, args.prompt_tokens)
        rows = []

        def front(client, plan, codec):
            closed_loop(client, prompts, 1, 2, args.new_tokens)  # warm-up
            for c in args.concurrency:
                row = {"concurrency": c, **closed_loop(client, prompts, c, args.requests_per_client, args.new_tokens)}
                row["static_tokens_per_s"] = static_batch(bundle, args.mode, prompts[:c], args.new_tokens)
                rows.append(row)
            return 0

        serve_bundle(bundle, front, mode=args.mode)
    base = next((r for r in rows if r["concurrency"] == 1), rows[0])
    for r in rows:
        r["over_c1"] = r["tokens_per_s"] / base["tokens_per_s"]
        r["cpu_over_c1"] = base["engine_cpu_ms_per_token"] / r["engine_cpu_ms_per_token"]
        r["over_static"] = r["tokens_per_s"] / r["static_tokens_per_s"]
        print(f"c={r['concurrency']:3d}: {r['tokens_per_s']:7.1f} tok/s ({r['over_c1']:.2f}x c=1, "
              f"{r['over_static']:.2f}x static batch {r['static_tokens_per_s']:.1f} tok/s); engine "
              f"{r['engine_cpu_ms_per_token']:.2f} ms CPU/token ({r['cpu_over_c1']:.2f}x less than c=1); "
              f"ttft p50 {r['ttft_p50_ms']:.1f} ms, itl p50 {r['itl_p50_ms']:.1f} ms")
    if args.json:
        print(json.dumps({"model": model.name, "mode": args.mode, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
