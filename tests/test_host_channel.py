"""The shared-memory exchange of ranks on one host (runtime/ep/host_channel.py), over real processes
and a real gloo process group: every round gives what gloo's all_to_all_single gives, bit for bit,
including rounds that overflow a slot; ranks that cannot all map each other's inboxes keep gloo;
nothing is left in the shared-memory directory; a silent peer fails the wait with one clear line."""
from __future__ import annotations

import os
import random
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moeplan.runtime.ep import host_channel
from moeplan.runtime.ep.exchange import Exchanger

SMALL_SLOT = 4096  # bytes: rounds of a few rows already overflow, so the gloo fallback is exercised


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _join(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)


def _rows(src: int, dst: int, n: int, width: int) -> torch.Tensor:
    """[n, width] float32 rows that name their source, destination and index."""
    base = torch.arange(n * width, dtype=torch.float32).reshape(n, width)
    return base + src * 1e6 + dst * 1e4


def _rounds(rank: int, world: int, port: int, shm_dir: str, rounds: int) -> None:
    _join(rank, world, port)
    host_channel.SHM_DIR, host_channel.SLOT_BYTES = shm_dir, SMALL_SLOT
    channel = host_channel.open_host_channel(rank, world, torch.device("cpu"), 60.0)
    assert channel is not None
    dist.barrier()  # every rank has unlinked its inbox's name
    assert not [f for f in os.listdir(shm_dir) if f.startswith("moeplan-")]  # unlinked once mapped
    rng = random.Random(7)  # every rank draws the same rounds
    overflowed = 0
    for _ in range(rounds):
        width = rng.choice([1, 3, 66])
        counts = [[rng.choice([0, 0, 1, 2, 5, 17, 40]) for _ in range(world)] for _ in range(world)]
        overflowed += any(counts[s][d] * width * 4 > SMALL_SLOT for s in range(world) for d in range(world) if s != d)
        send = torch.cat([_rows(rank, d, counts[rank][d], width) for d in range(world)])
        got, got_counts = channel.all_to_all(send, counts[rank])
        expected = torch.empty(sum(counts[s][rank] for s in range(world)), width)
        dist.all_to_all_single(expected, send, [counts[s][rank] for s in range(world)], counts[rank])
        assert got_counts == [counts[s][rank] for s in range(world)]
        assert torch.equal(got, expected)
        assert torch.equal(got, torch.cat([_rows(s, rank, counts[s][rank], width) for s in range(world)]))
    assert overflowed > 10 and overflowed < rounds - 10  # both paths ran
    channel.close()
    dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3])
def test_every_round_equals_gloos_all_to_all_including_rounds_that_overflow_a_slot(tmp_path, world):
    mp.spawn(_rounds, args=(world, _free_port(), str(tmp_path), 150), nprocs=world)


def _in_dev_shm(rank: int, world: int, port: int, out: str) -> None:
    """The default directory (/dev/shm) through the Exchanger, as the runtime opens it."""
    _join(rank, world, port)
    before = {f for f in os.listdir(host_channel.SHM_DIR) if f.startswith("moeplan-")}

    class Counted:
        def add(self, *args, **kwargs):
            pass

    ex = Exchanger.for_process_group(rank, world, Counted(), torch.device("cpu"), 60.0)
    dist.barrier()
    after = {f for f in os.listdir(host_channel.SHM_DIR) if f.startswith("moeplan-")}
    send = torch.cat([_rows(rank, d, 3, 5) for d in range(world)])
    got, counts = ex.exchange_sorted(send, [3] * world, 5, 0, "dispatch")
    ok = ex.channel is not None and after <= before and counts == [3] * world and torch.equal(
        got, torch.cat([_rows(s, rank, 3, 5) for s in range(world)]))
    ex.close()
    with open(os.path.join(out, f"rank{rank}"), "w") as f:
        f.write("ok" if ok else "fail")
    dist.destroy_process_group()


def test_the_runtimes_exchanger_takes_the_channel_in_dev_shm_and_leaves_no_file(tmp_path):
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm on this machine")
    mp.spawn(_in_dev_shm, args=(2, _free_port(), str(tmp_path)), nprocs=2)
    assert [(tmp_path / f"rank{r}").read_text() for r in range(2)] == ["ok", "ok"]


def _refused(rank: int, world: int, port: int, shm_dirs: list, gloo_rank: int) -> None:
    _join(rank, world, port)
    host_channel.SHM_DIR = shm_dirs[rank]
    if rank == gloo_rank:
        os.environ["MOEPLAN_EXCHANGE"] = "gloo"
    channel = host_channel.open_host_channel(rank, world, torch.device("cpu"), 60.0)
    assert channel is None  # every rank, not only the one that could not or would not
    dist.barrier()
    assert not [f for f in os.listdir(shm_dirs[rank]) if f.startswith("moeplan-")]
    dist.destroy_process_group()


def test_ranks_that_do_not_share_a_directory_keep_gloo_and_leave_nothing(tmp_path):
    dirs = [str(tmp_path / "a"), str(tmp_path / "b")]
    for d in dirs:
        os.makedirs(d)
    mp.spawn(_refused, args=(2, _free_port(), dirs, -1), nprocs=2)


def test_one_rank_asking_for_gloo_keeps_every_rank_on_gloo(tmp_path):
    mp.spawn(_refused, args=(2, _free_port(), [str(tmp_path)] * 2, 1), nprocs=2)


def _silent_peer(rank: int, world: int, port: int, shm_dir: str) -> None:
    _join(rank, world, port)
    host_channel.SHM_DIR = shm_dir
    channel = host_channel.open_host_channel(rank, world, torch.device("cpu"), 0.3)
    if rank == 0:
        with pytest.raises(RuntimeError, match="rank 0: no rows from rank 1 in 0.3 s"):
            channel.all_to_all(torch.zeros(2, 4), [1, 1])
    dist.barrier()
    channel.close()
    dist.destroy_process_group()


def test_a_peer_that_never_posts_fails_the_wait_with_one_line(tmp_path):
    mp.spawn(_silent_peer, args=(2, _free_port(), str(tmp_path)), nprocs=2)


def _dying_peer(rank: int, world: int, port: int, shm_dir: str) -> None:
    _join(rank, world, port)
    host_channel.SHM_DIR = shm_dir
    channel = host_channel.open_host_channel(rank, world, torch.device("cpu"), 600.0)
    if rank == 1:
        os._exit(0)  # gone without a word (a zombie until its parent reaps it)
    with pytest.raises(RuntimeError, match=r"rank 0: rank 1's process \(pid \d+\) exited during an exchange"):
        channel.all_to_all(torch.zeros(2, 4), [1, 1])
    # (the 600 s timeout would raise another message)
    channel.close()


def test_a_peer_that_dies_fails_the_wait_at_once_not_at_the_timeout(tmp_path):
    mp.spawn(_dying_peer, args=(2, _free_port(), str(tmp_path)), nprocs=2)


def test_gpu_ranks_get_no_channel_and_make_no_collective_for_it():
    """nccl's group takes no CPU tensor: GPU ranks must not even agree (no process group here: a
    collective would raise)."""
    assert not dist.is_initialized()
    assert host_channel.open_host_channel(0, 2, torch.device("cuda", 0), 60.0) is None
