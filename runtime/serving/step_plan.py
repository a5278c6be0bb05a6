"""The step plan: what rank 0 decides before each step and every rank applies, so the batch's
composition is agreed by all ranks.

A plan admits sequences (id, owner rank, prompt ids, sampling parameters) and lets others leave
(finished, cancelled). Its wire form is int64: a fixed header broadcast every step (one small
collective while the batch is steady) and, only when something joins or leaves, a payload.
Floats travel as their float64 bit patterns, so every rank reads exactly rank 0's values.

Kinds: STEP (run one step), HEARTBEAT (nothing to run: keeps every rank's collective inside the
process group's timeout while idle, and shows rank 0 within a second that a peer is gone), STOP.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

STEP, HEARTBEAT, STOP = 1, 2, 3
HEADER = 6  # kind, admissions, departures, gather stats, payload length, plan number
ADMISSION_FIELDS = 8  # seq, owner, seed, temperature, top_p, top_k, max_tokens, prompt length (then the prompt)


def _f2i(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def _i2f(i: int) -> float:
    return struct.unpack("<d", struct.pack("<q", int(i)))[0]


@dataclass(frozen=True)
class Admission:
    seq: int
    owner: int          # standard mode: the rank that runs the sequence; coherent: every rank does
    prompt: tuple
    seed: int
    temperature: float
    top_p: float
    top_k: int
    max_tokens: int = 0  # the request's token budget (0: not given); rank 0's engine process runs ahead within it

    @property
    def sampling(self) -> tuple:
        return (self.temperature, self.top_p, self.top_k, self.seed)


@dataclass
class StepPlan:
    kind: int = STEP
    admit: list = field(default_factory=list)
    depart: list = field(default_factory=list)
    gather_stats: bool = False
    number: int = 0

    def encode(self) -> tuple:
        """(header [HEADER] int64, payload [n] int64)."""
        payload = list(self.depart)
        for a in self.admit:
            payload += [a.seq, a.owner, a.seed, _f2i(a.temperature), _f2i(a.top_p), a.top_k, a.max_tokens, len(a.prompt),
                        *a.prompt]
        header = [self.kind, len(self.admit), len(self.depart), int(self.gather_stats), len(payload), self.number]
        return torch.tensor(header, dtype=torch.int64), torch.tensor(payload, dtype=torch.int64)

    @classmethod
    def decode(cls, header: torch.Tensor, payload: torch.Tensor) -> StepPlan:
        kind, n_admit, n_depart, gather, _, number = header.tolist()
        values = payload.tolist()
        depart, at = values[:n_depart], n_depart
        admit = []
        for _ in range(n_admit):
            seq, owner, seed, temperature, top_p, top_k, max_tokens, n = values[at:at + ADMISSION_FIELDS]
            at += ADMISSION_FIELDS
            admit.append(Admission(seq, owner, tuple(values[at:at + n]), seed, _i2f(temperature), _i2f(top_p), top_k,
                                   max_tokens))
            at += n
        return cls(kind, admit, depart, bool(gather), number)


def broadcast_plan(plan: StepPlan | None, rank: int, group=None) -> StepPlan:
    """Rank 0 sends `plan`, every other rank receives it, over `group` (a gloo group: CPU tensors;
    an idle rank sleeps in gloo's blocking wait, measured at about 0.2% of a core, where a waiting
    NCCL collective would spin)."""
    if rank == 0:
        header, payload = plan.encode()
        dist.broadcast(header, 0, group=group)
        if payload.numel():
            dist.broadcast(payload, 0, group=group)
        return plan
    header = torch.zeros(HEADER, dtype=torch.int64)
    dist.broadcast(header, 0, group=group)
    payload = torch.zeros(int(header[4]), dtype=torch.int64)
    if payload.numel():
        dist.broadcast(payload, 0, group=group)
    return StepPlan.decode(header, payload)
