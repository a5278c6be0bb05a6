"""One exchange round between CPU ranks of this host: gloo's `all_to_all_single` (the counts' collective
and the rows', as `runtime/ep/exchange.py` makes them without a channel) against the shared-memory channel
(`runtime/ep/host_channel.py`, counts in the slot headers), in the same run, as a ratio.

Each world size runs in spawned processes joined over gloo on loopback, one torch thread each; per size
(rows of 66 float32 per peer: a 64-wide hidden state and its packed metadata) every rank makes `--calls`
rounds back to back after warm-ups and rank 0 reports the median of 5 blocks' mean. Back to back is the
best case for both: in a decode step the ranks compute between rounds and meet out of step.

    python benchmarks/exchange_latency.py [--worlds 2 4] [--rows 0 64 512] [--calls 300]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from serving import free_port  # the script's own folder is on the path

WIDTH = 66


def _rank(rank: int, world: int, port: int, rows: list, calls: int, queue) -> None:
    import torch
    import torch.distributed as dist

    from moeplan.runtime.ep.host_channel import open_host_channel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    channel = open_host_channel(rank, world, torch.device("cpu"), 60.0)
    out = {}
    for n in rows:
        send, counts = torch.randn(n * world, WIDTH), [n] * world
        out[("gloo", n)] = _time(lambda s=send, c=counts: _gloo_round(s, c), calls)
        if channel is not None:
            out[("shm", n)] = _time(lambda s=send, c=counts: channel.all_to_all(s, c), calls)
    if rank == 0:
        queue.put(out)
    if channel is not None:
        channel.close()
    dist.destroy_process_group()


def _gloo_round(send, counts: list) -> None:
    """The exchange without a channel: the counts' collective, then the rows'."""
    import torch
    import torch.distributed as dist

    counts_in = torch.empty(len(counts), dtype=torch.int64)
    dist.all_to_all_single(counts_in, torch.tensor(counts))
    recv = torch.empty(int(counts_in.sum()), send.shape[1])
    dist.all_to_all_single(recv, send, counts_in.tolist(), counts)


def _time(round_, calls: int) -> float:
    """Median over 5 blocks of the mean seconds per round, the ranks lined up by a barrier per block."""
    import torch.distributed as dist

    for _ in range(20):
        round_()
    blocks = []
    for _ in range(5):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(calls // 5):
            round_()
        blocks.append((time.perf_counter() - start) / (calls // 5))
    return statistics.median(blocks)


def measure(world: int, rows: list, calls: int) -> dict:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.start_processes(_rank, args=(world, free_port(), rows, calls, queue), nprocs=world, start_method="spawn")
    return queue.get()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", nargs="+", type=int, default=[2, 4])
    ap.add_argument("--rows", nargs="+", type=int, default=[0, 64, 512], help="rows per peer")
    ap.add_argument("--calls", type=int, default=300)
    args = ap.parse_args(argv)
    print(f"{'ranks':>5} {'rows/peer':>9} {'gloo us':>9} {'shm us':>8} {'gloo/shm':>8}  load")
    for world in args.worlds:
        got = measure(world, args.rows, args.calls)
        for n in args.rows:
            g, s = got[("gloo", n)], got.get(("shm", n))
            ratio = f"{g / s:7.1f}x" if s else "  (none)"
            shm = f"{s * 1e6:8.0f}" if s else "       -"
            print(f"{world:>5} {n:>9} {g * 1e6:>9.0f} {shm} {ratio}  {os.getloadavg()[0]:.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
