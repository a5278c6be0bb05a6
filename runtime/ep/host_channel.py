"""Ranks on one host exchange rows through shared memory instead of gloo's sockets.

Why: on CPU, a gloo `all_to_all_single` between two processes of one host is a chain of thread and
process wake-ups (the caller, gloo's worker thread, its socket loop, the peer's). On the 2-core VM
this repository is measured on one call took 1.1-2.0 ms whatever its size (4 to 34 KB), a socket
round trip 160-420 us, and a 2-rank decode step makes ~15 of them. Here each rank owns an inbox
file in /dev/shm with a slot per source rank and per round parity; a sender copies its rows into
the receiver's slot and then writes the slot's sequence number; the receiver spins on that number
(yielding the core, then sleeping a twentieth of the time waited so far). No kernel call on the
common path, and the row counts ride in the slot's header, so the counts collective goes too.

Rounds alternate two parities. A rank writes round s + 2 into a peer's slot only after it has read
that peer's round s + 1, which the peer posts only after it read round s: a slot is never
overwritten before it is read. A round whose rows do not fit a slot (a long prefill) falls back to
gloo for every rank: each header says whether its sender overflowed anywhere, so all ranks agree.

Used only where every rank maps every other's inbox (one host, one /dev/shm: torchrun's ranks of one
machine or of one Kubernetes pod, not ranks on different nodes) and on x86-64, whose stores are seen in program order (the header's sequence
number after the rows); elsewhere `open_host_channel` returns None and the exchange stays gloo's.
MOEPLAN_EXCHANGE=gloo turns it off. Inbox files are unlinked once every rank has mapped them, so a
killed rank leaves nothing behind.
"""
from __future__ import annotations

import mmap
import os
import platform
import secrets
import time

import numpy as np
import torch
import torch.distributed as dist

SLOT_BYTES = 1 << 20   # per slot: a decode step's dispatch of 64 tokens at hidden 2048 (float32) fits; an inbox
                       # is 2 x world slots (4 MiB a rank at 2 ranks, 16 at 8), inside the pods' measured rank overhead
HEADER_WORDS = 8       # int64: sequence number, rows, any-overflow flag, (spare)
HEADER_BYTES = HEADER_WORDS * 8
SPIN_S, YIELD_S = 50e-6, 2e-3  # busy-wait, then yield the core, then sleep between looks:
LATE, MAX_SLEEP_S = 0.05, 0.02  # 5% of the time waited so far, at most 20 ms: a long wait (a peer's long prefill)
                                # looks a few dozen times a second, not thousands (each look costs ~0.1 ms here)
PEER_CHECK_S = 0.05            # a waiting rank looks this often whether its peer's process still lives
SHM_DIR = "/dev/shm"


def _slot_offset(source: int, parity: int) -> int:
    return (2 * source + parity) * (HEADER_BYTES + SLOT_BYTES)


class HostChannel:
    """All-to-all of float32 rows among the ranks of one host (module docstring)."""

    def __init__(self, rank: int, world: int, maps: list, timeout_s: float, group=None, pids: list | None = None):
        """maps[r]: rank r's inbox (mmap of world x 2 slots); pids[r]: rank r's process (a wait for a
        dead peer fails at once, as gloo's closed socket would, not after the timeout)."""
        self.rank, self.world, self.maps, self.timeout_s, self.group = rank, world, maps, timeout_s, group
        self.pids = pids or [None] * world
        self.round = 0
        # headers[p][q][parity]: the header of rank p's inbox slot from source q
        self.headers = [[[np.frombuffer(m, dtype=np.int64, count=HEADER_WORDS, offset=_slot_offset(q, par))
                          for par in (0, 1)] for q in range(world)] for m in maps]
        self.slots = [[[torch.frombuffer(m, dtype=torch.float32, count=SLOT_BYTES // 4,
                                         offset=_slot_offset(q, par) + HEADER_BYTES)
                        for par in (0, 1)] for q in range(world)] for m in maps]

    def all_to_all(self, send: torch.Tensor, send_counts: list) -> tuple:
        """send [N, W] float32, grouped by destination (send_counts[d] rows for rank d, rank order)
        -> (received [M, W] float32 grouped by source, the counts received from each rank)."""
        self.round += 1
        s, parity, width = self.round, self.round & 1, int(send.shape[1])
        starts = np.concatenate([[0], np.cumsum(send_counts)]).astype(int)
        overflow = any(send_counts[d] * width * 4 > SLOT_BYTES for d in range(self.world) if d != self.rank)
        flat = send.reshape(-1)
        for d in range(self.world):
            if d == self.rank:
                continue
            n = send_counts[d] * width
            if not overflow and n:
                self.slots[d][self.rank][parity][:n].copy_(flat[starts[d] * width:starts[d + 1] * width])
            header = self.headers[d][self.rank][parity]
            header[1], header[2] = send_counts[d], overflow
            header[0] = s  # last: the rows are in place before the receiver sees the round
        recv_counts, any_overflow = [0] * self.world, overflow
        for q in range(self.world):
            if q == self.rank:
                recv_counts[q] = int(send_counts[q])
                continue
            header = self.headers[self.rank][q][parity]
            self._wait(header, s, q)
            recv_counts[q], any_overflow = int(header[1]), any_overflow or bool(header[2])
        if any_overflow:
            recv = torch.empty(sum(recv_counts), width, dtype=torch.float32)
            dist.all_to_all_single(recv, send.contiguous(), output_split_sizes=recv_counts,
                                   input_split_sizes=[int(c) for c in send_counts], group=self.group)
            return recv, recv_counts
        pieces = []
        for q in range(self.world):
            if q == self.rank:
                pieces.append(send[starts[q]:starts[q + 1]])
            elif recv_counts[q]:
                pieces.append(self.slots[self.rank][q][parity][:recv_counts[q] * width].view(-1, width))
        recv = torch.cat(pieces) if pieces else torch.empty(0, width, dtype=torch.float32)  # cat copies out of the slots
        return recv.reshape(-1, width), recv_counts

    def _wait(self, header: np.ndarray, s: int, source: int) -> None:
        """Until the source posts round s: spin, then yield the core, then sleep."""
        if header[0] == s:
            return
        start = time.perf_counter()
        checked = start
        while header[0] != s:
            now = time.perf_counter()
            waited = now - start
            if waited < SPIN_S:
                continue
            if waited < YIELD_S:
                os.sched_yield()
                continue
            if waited >= self.timeout_s:
                raise RuntimeError(f"rank {self.rank}: no rows from rank {source} in {self.timeout_s:g} s "
                                   f"(a peer hung or left the exchange)")
            if now - checked > PEER_CHECK_S:
                checked = now
                if not _alive(self.pids[source]):
                    raise RuntimeError(f"rank {self.rank}: rank {source}'s process (pid {self.pids[source]}) "
                                       f"exited during an exchange")
            time.sleep(min(MAX_SLEEP_S, max(100e-6, LATE * waited)))

    def close(self) -> None:
        """Drop the views, then unmap."""
        self.headers = self.slots = None
        for m in self.maps:
            m.close()
        self.maps = []


def _alive(pid: int | None) -> bool:
    """Whether process `pid` (of this host) still runs: not gone, not a zombie (None: not known)."""
    if pid is None:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _pid_namespace() -> str | None:
    """The PID namespace: peers' pids mean something here only if it is the same."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def _inbox_path(token: str, rank: int) -> str:
    return os.path.join(SHM_DIR, f"moeplan-{token}-{rank}")


def _create_inbox(path: str, size: int) -> mmap.mmap:
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.posix_fallocate(fd, 0, size)  # the pages exist now: a full /dev/shm fails here, not with SIGBUS later
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


def _map_inbox(path: str, size: int) -> mmap.mmap:
    fd = os.open(path, os.O_RDWR)
    try:
        if os.fstat(fd).st_size != size:
            raise OSError(f"{path} is not a moeplan inbox of {size} bytes")
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


def _all_agree(ok: bool, group) -> bool:
    flag = torch.tensor([1 if ok else 0], dtype=torch.int64)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def open_host_channel(rank: int, world: int, device: torch.device, timeout_s: float, group=None):
    """A HostChannel when every rank of the (CPU, gloo) process group can map every other's inbox,
    else None; collective for CPU ranks: every rank calls it, and every rank gets the same answer."""
    if world == 1 or device.type != "cpu":  # GPU ranks: nccl's group, no CPU collective to agree with
        return None
    wanted = (platform.machine() in ("x86_64", "AMD64")
              and os.environ.get("MOEPLAN_EXCHANGE", "shm") != "gloo" and os.path.isdir(SHM_DIR))
    if not _all_agree(wanted, group):
        return None
    token = [secrets.token_hex(8) if rank == 0 else None]
    dist.broadcast_object_list(token, src=0, group=group)
    pids = [None] * world
    dist.all_gather_object(pids, (os.getpid(), _pid_namespace()), group=group)
    pids = [p for p, _ in pids] if len({ns for _, ns in pids} - {None}) == 1 and all(ns for _, ns in pids) else None
    size = 2 * world * (HEADER_BYTES + SLOT_BYTES)
    own, maps = _inbox_path(token[0], rank), [None] * world
    try:
        maps[rank] = _create_inbox(own, size)
    except OSError:
        pass
    created = maps[rank] is not None
    if _all_agree(created, group):
        try:
            for r in range(world):
                if r != rank:
                    maps[r] = _map_inbox(_inbox_path(token[0], r), size)
        except OSError:  # another host's rank, or another /dev/shm
            pass
        mapped = _all_agree(all(m is not None for m in maps), group)  # every rank has opened what it could
    else:
        mapped = False
    if created:
        os.unlink(own)  # mapped where it will be: the name can go
    if mapped:
        return HostChannel(rank, world, maps, timeout_s, group, pids)
    for m in maps:
        if m is not None:
            m.close()
    return None
