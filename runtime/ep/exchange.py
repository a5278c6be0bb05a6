"""Dynamic-gating exchange: send each rank exactly its rows, no capacity padding, no drops.

First every rank tells every other how many rows it will send (an all-to-all of counts), then one
variable-size `all_to_all_single` moves the rows. Rows are packed as one float32 tensor: the
hidden payload followed by int64 metadata reinterpreted bit-for-bit as float32 pairs, so a token
and its routing travel in one message. Metadata is kept small: a token is one int64 key
(sequence x max length + position); its k expert ids and destination ranks travel as int16s
packed four to an int64 word (`pack_small`). gloo implements `all_to_all_single` with split sizes in
torch >= 2.x (checked on 2.13), as does nccl, so the same code runs on CPU and GPU. CPU ranks of one
host exchange through shared memory instead (`host_channel.py`: the counts ride in the rows' slot
headers, one round instead of two).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .host_channel import open_host_channel


def pack(payload: torch.Tensor, meta: torch.Tensor) -> torch.Tensor:
    """[n, W] float32 payload and [n, M] int64 metadata -> [n, W + 2M] float32 rows."""
    meta = meta.to(torch.int64).contiguous()
    as_float = meta.view(torch.float32).reshape(meta.shape[0], 2 * meta.shape[1])
    return torch.cat([payload.to(torch.float32), as_float.to(payload.device)], dim=1)


def unpack(rows: torch.Tensor, width: int) -> tuple:
    """Inverse of `pack`: ([n, width] float32, [n, M] int64)."""
    payload = rows[:, :width]
    columns = (rows.shape[1] - width) // 2
    if rows.shape[0] == 0 or columns == 0:
        return payload, torch.zeros(rows.shape[0], columns, dtype=torch.int64, device=rows.device)
    # fresh storage with standard strides (a 1-row slice keeps its parent's row stride), reinterpretable
    meta = torch.empty(rows.shape[0], rows.shape[1] - width, dtype=rows.dtype, device=rows.device)
    meta = meta.copy_(rows[:, width:]).view(torch.int64)
    return payload, meta


def pack_small(values: torch.Tensor) -> torch.Tensor:
    """[n, c] small non-negative ints (expert ids, ranks < 32768) -> [n, ceil(c / 4)] int64 words."""
    n, c = values.shape
    words = -(-c // 4)
    padded = torch.zeros(n, words * 4, dtype=torch.int16)
    padded[:, :c] = values.to(torch.int16)
    return padded.view(torch.int64)


def unpack_small(words: torch.Tensor, count: int) -> torch.Tensor:
    """Inverse of `pack_small`: [n, count] int64."""
    return words.contiguous().view(torch.int16)[:, :count].to(torch.int64)


class Exchanger:
    """Variable-size all-to-all over the default process group, counting what leaves the rank."""

    def __init__(self, rank: int, world_size: int, counters, device: torch.device, channel=None):
        """`channel`: a `host_channel.HostChannel` (ranks of one host), else gloo's or nccl's collectives."""
        self.rank = rank
        self.world = world_size
        self.counters = counters
        self.device = device
        self.channel = channel

    @classmethod
    def for_process_group(cls, rank: int, world_size: int, counters, device: torch.device, timeout_s: float):
        """An exchanger over the default process group, through shared memory where every rank is on
        this host (collective: every rank calls it)."""
        return cls(rank, world_size, counters, device, open_host_channel(rank, world_size, device, timeout_s))

    def close(self) -> None:
        if self.channel is not None:
            self.channel.close()
            self.channel = None

    def exchange(self, rows_by_dest: list, row_width: int, layer, phase: str) -> list:
        """Send rows_by_dest[d] ([n_d, row_width] float32) to rank d; return the rows from each source."""
        counts = [int(r.shape[0]) for r in rows_by_dest]
        if self.world == 1:
            return list(rows_by_dest)
        send = torch.cat([r.to(self.device, torch.float32) for r in rows_by_dest], dim=0)
        recv, recv_counts = self.exchange_sorted(send, counts, row_width, layer, phase)
        return list(torch.split(recv, recv_counts, dim=0))

    def exchange_sorted(self, send: torch.Tensor, send_counts: list, row_width: int, layer, phase: str,
                        recv_counts: list | None = None) -> tuple:
        """Rows already grouped by destination (send [N, row_width]: send_counts[d] rows for rank d,
        in rank order) -> (the rows received [M, row_width], grouped by source, and their counts):
        one call whatever the number of ranks, no list of per-rank pieces. The row counts travel first
        (a collective of their own), unless the caller knows what each rank sends it (`recv_counts`: the
        combine returns each rank the rows its dispatch sent), which saves that round trip, or the ranks
        share a host channel, whose slot headers carry them."""
        send_counts = [int(c) for c in send_counts]
        if self.world == 1:
            return send, send_counts
        counted = recv_counts is None
        send = send.to(self.device, torch.float32).reshape(-1, row_width)
        if self.channel is not None:  # one round: the counts ride in the slots' headers
            recv, recv_counts = self.channel.all_to_all(send, send_counts)
        else:
            recv, recv_counts = self._collective(send, send_counts, row_width, recv_counts)
        off_rank = [c for d, c in enumerate(send_counts) if d != self.rank]
        row_bytes = row_width * 4
        self.counters.add(layer, phase, nbytes=sum(off_rank) * row_bytes,
                          messages=sum(1 for c in off_rank if c > 0),
                          control_bytes=8 * (self.world - 1) * counted, control_messages=(self.world - 1) * counted)
        # layer None: a once-per-step exchange (prompt or new-token sync), counted under `step`
        return recv, recv_counts

    def _collective(self, send: torch.Tensor, send_counts: list, row_width: int, recv_counts: list | None) -> tuple:
        """The process group's `all_to_all_single` of send [N, row_width] float32, after one of the counts
        unless they are given."""
        if recv_counts is None:
            counts_out = torch.tensor(send_counts, dtype=torch.int64, device=self.device)
            counts_in = torch.empty_like(counts_out)
            dist.all_to_all_single(counts_in, counts_out)
            recv_counts = counts_in.tolist()
        else:
            recv_counts = [int(c) for c in recv_counts]
        recv = torch.empty(sum(recv_counts), row_width, dtype=torch.float32, device=self.device)
        dist.all_to_all_single(recv, send.contiguous(), output_split_sizes=recv_counts, input_split_sizes=send_counts)
        return recv, recv_counts


def by_destination(dest: torch.Tensor, world: int) -> tuple:
    """Exchange packing, vectorised: for destination ranks dest [n, k] (CPU) of n rows, the rows to
    send in rank order (int64 [N], a row once per distinct rank among its slots) and how many go to
    each rank (list of `world` ints)."""
    member = (dest[:, :, None] == torch.arange(world)).any(dim=1)  # [n, W]
    rank_of, rows = member.T.nonzero(as_tuple=True)
    return rows, torch.bincount(rank_of, minlength=world).tolist()
