"""Entry point of a bundle's ranks: `torchrun ... -m runtime.serve --prompts FILE --out DIR`, or
`--serve [--host H] [--port P] [--api-key K]` for the inference service (`serving/ranks.py`: rank 0
serves HTTP, every rank runs the continuous-batching engine until SIGTERM or SIGINT).

Each rank loads its shard, joins the process group (nccl on GPUs, gloo on CPU), generates
greedily with the chosen expert-parallel mode(s), the prompts as one batch through the service's
batch worker (`serving/static_batch.py`), and writes `rank-<r>.pt` (its logits, routing and
counters) to <out>/<mode>/; rank 0 then merges them into `result.json` and prints the text.
`--bundle DIR` (repeatable) serves other bundles of the same world size in the same launch, one
after another, each into <out>/<bundle name>/<mode>/ (one process start for many models).
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from . import results
from .bundle_io import BundleError, bundle_root, load_bundle
from .counters import Counters
from .process_exit import leave
from .ep.engine import Engine
from .ep.exchange import Exchanger
from .serving.static_batch import check_fits, run_batch
from .serving.worker import BatchWorker
from .text_codec import prompt_lines


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="runtime.serve", description=__doc__.splitlines()[0])
    ap.add_argument("--serve", action="store_true",
                    help="run the inference service (OpenAI-compatible HTTP on rank 0) instead of one static batch")
    ap.add_argument("--host", default="127.0.0.1", help="--serve: address rank 0 listens on")
    ap.add_argument("--port", type=int, default=8000, help="--serve: port rank 0 listens on")
    ap.add_argument("--api-key", default=None, help="--serve: requests must carry 'Authorization: Bearer KEY' (or set MOEPLAN_API_KEY, "
                         "which keeps the key off the command line)")
    ap.add_argument("--max-sequences", type=int, default=None,
                    help="--serve: sequences running at once (default and upper bound: the plan's capacity)")
    ap.add_argument("--max-waiting", type=int, default=None,
                    help="--serve: requests queued beyond the running ones before 429 (default 4 x max sequences)")
    ap.add_argument("--prompts", default=None,
                    help="text file, one prompt per line; a line 'ids: 1 2 3' gives token ids instead of text")
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--mode", default=None,
                    help="coherent, standard, or both comma-separated (one launch, results per mode); "
                         "default: the plan's communication mode")
    ap.add_argument("--out", default=None, help="directory; each mode writes <out>/<mode>/result.json")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--context", default="auto", choices=("auto", "hidden", "kv"),
                    help="coherent mode's context exchange: auto (per block the smaller of the hidden state and "
                         "the cache's K/V), hidden (always the hidden state) or kv (the cache's K/V wherever it can)")
    ap.add_argument("--bundle", action="append", default=None,
                    help="bundle directory to serve (repeatable); default: the bundle holding this runtime")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    bad = [m for m in (args.mode or "coherent").split(",") if m not in ("coherent", "standard")]
    if bad:
        print(f"error: --mode takes coherent and/or standard, got {bad}", file=sys.stderr)
        return 2
    if args.serve:
        from .serving.ranks import serve_main  # the service's modules load only for --serve

        return serve_main(args)
    missing = [f"--{n}" for n in ("prompts", "out") if getattr(args, n) is None]
    if missing:
        print(f"error: give {' and '.join(missing)} (or --serve to run the inference service)", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    roots = [Path(b).resolve() for b in args.bundle] if args.bundle else [bundle_root()]
    use_cuda = torch.cuda.is_available()
    device = torch.device(f"cuda:{local_rank}") if use_cuda else torch.device("cpu")
    loaded = []
    try:
        for root in roots:  # every bundle loads before any rank joins the group: launch errors stay one line
            plan, table, modes, model, codec = load_bundle(root, rank, world, device, args.mode)
            prompts = [codec.encode(line) for line in prompt_lines(Path(args.prompts).read_text(encoding="utf-8"))]
            check_fits(prompts, args.new_tokens, model.max_positions)
            out = Path(args.out) / root.name if len(roots) > 1 else Path(args.out)
            loaded.append((model, codec, table, modes, prompts, out))
    except (BundleError, ValueError, OSError) as exc:
        print(f"error: rank {rank}: {exc}", file=sys.stderr)
        return 2
    if use_cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if use_cuda else "gloo")
    try:
        for model, codec, table, modes, prompts, out in loaded:
            if rank == 0:
                print(f"prompts: {codec.source}")
            for mode in modes:
                serve_mode(model, codec, table, prompts, mode, args.new_tokens, out / mode, rank, world, device,
                           args.context)
    finally:
        dist.destroy_process_group()
    return 0


def serve_mode(model, codec, table, prompts, mode, new_tokens, out_dir: Path, rank, world, device,
               context: str = "auto") -> None:
    """Generate for every prompt in one mode; rank 0 merges the ranks' results and prints them."""
    counters = Counters(model.num_layers)  # per block; MoE-only counts stay zero on dense blocks
    if getattr(model, "expert_cache", None) is not None:  # offloading: each mode starts from the planned residents
        model.expert_cache.restart()
    exchanger = Exchanger.for_process_group(rank, world, counters, device, dist.default_pg_timeout.total_seconds())
    engine = Engine(model, table, exchanger, counters, rank, world, mode, device,
                    model.top_k, context)  # recording: logits and routing for results
    worker = BatchWorker(engine, model.kind, tokens_to_rank0=False)
    dist.barrier()
    try:
        generated = run_batch(worker, prompts, new_tokens)
    finally:
        worker.close()
        exchanger.close()
    os.makedirs(out_dir, exist_ok=True)
    results.write_rank(out_dir, rank, engine, generated, mode)
    dist.barrier()
    if rank == 0:
        summary = results.merge(out_dir, world, prompts, codec.decode)
        for i, text in enumerate(summary["texts"]):
            print(f"[{i}] {text!r}")
        print(f"{summary['generated_tokens']} tokens in {summary['elapsed_s']:.3f} s "
              f"({summary['tokens_per_second']:.1f} tokens/s), mode {mode}")


if __name__ == "__main__":
    leave(main())
