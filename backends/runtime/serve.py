"""Entry point of a bundle's ranks: `torchrun ... -m runtime.serve --prompts FILE --out DIR`.

Each rank loads its shard, joins the process group (nccl on GPUs, gloo on CPU), generates
greedily with the chosen expert-parallel mode(s) and writes `rank-<r>.pt` (its logits, routing
and counters) to <out>/<mode>/; rank 0 then merges them into `result.json` and prints the text.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

from . import results
from .bundle_io import BundleError, build_rank_model, bundle_root, read_json, world_size_of
from .counters import Counters
from .engine import Engine
from .exchange import Exchanger
from .expert_table import ExpertTable


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="runtime.serve", description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", required=True,
                    help="text file, one prompt per line; a line 'ids: 1 2 3' gives token ids instead of text")
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--mode", default=None,
                    help="coherent, standard, or both comma-separated (one launch, results per mode); "
                         "default: the plan's communication mode")
    ap.add_argument("--out", required=True, help="directory; each mode writes <out>/<mode>/result.json")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    bad = [m for m in (args.mode or "coherent").split(",") if m not in ("coherent", "standard")]
    if bad:
        print(f"error: --mode takes coherent and/or standard, got {bad}", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    root = bundle_root()
    try:
        plan = read_json(root, "plan.json")
        placement = read_json(root, "placement.json")
        if world != world_size_of(plan):
            raise BundleError(f"launched with {world} ranks but the plan is for {world_size_of(plan)} "
                              f"({plan['topology']['nodes']} nodes x {plan['topology']['gpus_per_node']})")
        modes = (args.mode or plan.get("communication", {}).get("mode", "coherent")).split(",")
        use_cuda = torch.cuda.is_available()
        device = torch.device(f"cuda:{local_rank}") if use_cuda else torch.device("cpu")
        table = ExpertTable.from_placement(placement)
        model, codec = build_rank_model(root, plan, rank, table, device)
    except BundleError as exc:
        print(f"error: rank {rank}: {exc}", file=sys.stderr)
        return 2
    if use_cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if use_cuda else "gloo")
    try:
        try:
            with open(args.prompts, encoding="utf-8") as fh:
                prompts = [codec.encode(line.rstrip("\n")) for line in fh if line.strip()]
        except (ValueError, OSError) as exc:
            print(f"error: rank {rank}: {exc}", file=sys.stderr)
            return 2
        if rank == 0:
            print(f"prompts: {codec.source}")
        for mode in modes:
            counters = Counters(model.num_layers)  # per block; MoE-only counts stay zero on dense blocks
            engine = Engine(model, table, Exchanger(rank, world, counters, device), counters, rank, world, mode, device,
                            model.top_k)
            dist.barrier()
            out = engine.generate(prompts, args.new_tokens)
            out_dir = os.path.join(args.out, mode)
            os.makedirs(out_dir, exist_ok=True)
            results.write_rank(out_dir, rank, engine, out, mode)
            dist.barrier()
            if rank == 0:
                summary = results.merge(out_dir, world, prompts, codec.decode)
                for i, text in enumerate(summary["texts"]):
                    print(f"[{i}] {text!r}")
                print(f"{summary['generated_tokens']} tokens in {summary['elapsed_s']:.3f} s "
                      f"({summary['tokens_per_second']:.1f} tokens/s), mode {mode}")
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
