"""One rank's share of continuous batching: applies each step plan to its rows of the library's KV
cache and runs the step's library forwards through the expert-parallel engine (`engine.Engine`).
The one generation loop: the service's steps come from rank 0's scheduler (`engine_loop.py`), a
static run's from `static_batch.py`.

A step, on every rank and in the same order:
1. the plan's departures leave the cache (`RowCache.leave`);
2. decode: if any sequence was running before this step (anywhere), one forward of one new token
   per row; prefill: if the plan admits sequences, one forward of their prompts (left-padded) into
   a fresh cache, whose rows then join the running ones. In standard mode a rank runs only the
   sequences it owns and joins a forward it has no row in with a one-row dummy, so every rank
   takes part in every exchange; in coherent mode every rank runs every
   sequence (the engine's context exchange keeps every rank's cache whole);
3. the rank holding a token's last hidden state samples it (`sampler.py`) and the new tokens are
   shared (`token_sync`): with every rank in coherent mode (each feeds every sequence), with rank 0
   in standard mode when rank 0 emits the events (the service; owners feed their own), with nobody
   in a static run's standard mode (each rank writes its own sequences' results).
Rows are keyed as the engine keys tokens, sequence x KEY_STRIDE + position.
"""
from __future__ import annotations

from collections import Counter

import torch
import torch.distributed as dist

from ..ep.engine import COHERENT
from ..ep.gathered_moe import gathered_prefill_rows
from ..ep.exchange import pack, unpack
from .row_cache import RowCache, prefill_inputs
from .row_pool import PooledRows
from .sampler import Sampler

KEY_STRIDE = 1 << 24  # positions per sequence in a row key (contexts are far shorter)


def _prefill_rows(admit: list, world: int) -> int | None:
    """The rows every rank sends in this step's gathered prefill (`gathered_moe.gathered_prefill_rows`: each rank's
    admissions left-padded to their longest prompt), or None (dynamic gating)."""
    width, count = [0] * world, [0] * world
    for a in admit:
        width[a.owner] = max(width[a.owner], len(a.prompt))
        count[a.owner] += 1
    return gathered_prefill_rows(width, count)


class BatchWorker:
    """Runs step plans on one rank (see module docstring)."""

    def __init__(self, engine, kind: str, control_group=None, tokens_to_rank0: bool = True):
        """`kind`: the library cache's kind (`row_cache.py`); `control_group`: the process group of
        `gather_stats`; `tokens_to_rank0`: standard mode sends every new token to rank 0."""
        self.engine, self.kind, self.group = engine, kind, control_group
        self.rank, self.world, self.coherent = engine.rank, engine.world, engine.mode == COHERENT
        self.tokens_to_rank0 = tokens_to_rank0
        engine.install_hooks()
        self.rows = RowCache(kind)
        self.running: set = set()   # every running sequence, on every rank
        self.owner: dict = {}       # seq -> the rank that owns it, every running sequence
        self.sampling: dict = {}    # seq -> (temperature, top_p, top_k, seed), sequences run here
        self.prompt_len: dict = {}
        self.last: dict = {}        # seq -> its newest token (the next decode input), sequences run here
        self.decodes = 0            # decode steps run (each gives every running sequence one token)
        self.context_base: dict = {}  # seq -> its prompt's length less the decode steps before it joined, every
                                      # running sequence (whoever runs it): its cache holds base + decodes tokens
        self.sampler = Sampler()
        self.steps = 0

    def close(self) -> None:
        self.engine.remove_hooks()

    def step(self, plan) -> dict:
        """Apply one STEP plan; {seq: new token} of every sequence this rank learned (rank 0: all)."""
        for seq in plan.depart:
            self.running.discard(seq)
            self.owner.pop(seq, None)
            self.sampling.pop(seq, None)
            self.prompt_len.pop(seq, None)
            self.last.pop(seq, None)
            self.context_base.pop(seq, None)
        self.rows.leave(plan.depart)
        new = {}
        if self.running:
            new.update(self._decode())
            self.decodes += 1
        if plan.admit:
            with self.engine.gathering(_prefill_rows(plan.admit, self.world) if self.engine.gathers else None):
                new.update(self._prefill([a for a in plan.admit if self.coherent or a.owner == self.rank]))
            self.running.update(a.seq for a in plan.admit)
            self.owner.update((a.seq, a.owner) for a in plan.admit)
            self.context_base.update((a.seq, len(a.prompt) - self.decodes) for a in plan.admit)
        if self.running:  # every rank agrees: a forward ran this step
            new = self._share(new)
        for seq, token in new.items():
            if seq in self.sampling:
                self.last[seq] = token
        self.steps += 1
        return new

    # --- forwards ----------------------------------------------------------------------------------
    def _dummy(self) -> None:
        """Join a forward with no sequence here (standard mode): its exchanges only (`Engine.join_exchanges`)."""
        self.engine.join_exchanges()

    def _decode(self) -> dict:
        # gathered (`ep/gathered_moe.py`): every rank sends as many rows as the fullest rank runs; where the steps
        # replay CUDA graphs (`model/graph_decode.py`), as many as that rank's bucket, the same bucket on every rank
        fullest = max(Counter(self.owner[s] for s in self.running).values()) if self.engine.gathers else None
        graphs = self.engine.model.compiled_decode
        if fullest is not None and isinstance(self.rows, PooledRows) and hasattr(graphs, "share"):
            widest = self.decodes + max(self.context_base[s] for s in self.running)
            fullest = graphs.share(fullest, widest + 1, self.rows.capacity_rows, self.rows.capacity_columns)
        with self.engine.gathering(fullest):
            return self._decode_rows()

    def _decode_rows(self) -> dict:
        rows = self.rows
        if not len(rows):
            self._dummy()
            return {}
        ids = torch.tensor([[self.last[s]] for s in rows.seqs], dtype=torch.int64)
        pos = torch.tensor([[n] for n in rows.lengths], dtype=torch.int64)
        keys = torch.tensor([s * KEY_STRIDE + n for s, n in zip(rows.seqs, rows.lengths)], dtype=torch.int64)
        logits, here, cache = self.engine.forward_rows(ids, pos, rows.decode_mask(), rows.cache, keys)
        rows.advanced(cache, 1)
        return self._sample(logits, here, keys)

    def _prefill(self, admitted: list) -> dict:
        for a in admitted:
            self.sampling[a.seq], self.prompt_len[a.seq] = a.sampling, len(a.prompt)
        if not admitted:
            self._dummy()
            return {}
        ids, pos, mask = prefill_inputs([a.prompt for a in admitted])
        seqs = torch.tensor([a.seq for a in admitted], dtype=torch.int64)
        keys = torch.where(mask, seqs[:, None] * KEY_STRIDE + pos, torch.full_like(pos, -1)).flatten()
        logits, here, cache = self.engine.forward_rows(ids, pos, mask, None, keys)
        joined = RowCache(self.kind)
        joined.cache, joined.seqs, joined.width = cache, [a.seq for a in admitted], ids.shape[1]
        joined.lengths = [len(a.prompt) for a in admitted]
        self.rows.join(joined)
        last = [i for i, k in enumerate(keys[here].tolist()) if k % KEY_STRIDE == self.prompt_len[k // KEY_STRIDE] - 1]
        return self._sample(logits, here[last], keys)

    def _sample(self, logits: torch.Tensor, here: torch.Tensor, keys: torch.Tensor) -> dict:
        """Sample the rows `here` (each a sequence's last token in this forward) of logits [R, V]."""
        if here.numel() == 0:
            return {}
        ks = keys[here].tolist()
        seqs = [k // KEY_STRIDE for k in ks]
        indices = [k % KEY_STRIDE + 1 - self.prompt_len[s] for k, s in zip(ks, seqs)]
        tokens = self.sampler.sample(logits[here.to(logits.device)], [self.sampling[s] for s in seqs], indices)
        return dict(zip(seqs, tokens))

    # --- sharing ---------------------------------------------------------------------------------------
    def _share(self, new: dict) -> dict:
        """token_sync: every rank's new tokens to every rank (coherent) or to rank 0 (standard, when
        `tokens_to_rank0`)."""
        if self.world == 1 or not (self.coherent or self.tokens_to_rank0):
            return new
        meta = torch.tensor(sorted(new.items()), dtype=torch.int64).reshape(-1, 2)
        rows = pack(torch.zeros(meta.shape[0], 0), meta)
        send = [rows if d != self.rank and (self.coherent or d == 0) else rows[:0] for d in range(self.world)]
        merged = dict(new)
        for got in self.engine.ex.exchange(send, rows.shape[1], None, "token_sync"):
            if got.shape[0]:
                _, m = unpack(got.cpu(), 0)
                merged.update((int(s), int(t)) for s, t in m.tolist())
        return merged

    def forget_counts(self) -> None:
        """The worker's and engine's counts, records and expert cache back to a fresh run's: after warm-up steps
        (`decode_compile.py`'s, `static_batch.py`'s), which are not the run's work."""
        self.steps = 0
        engine = self.engine
        fresh = type(engine.counters)(len(engine.counters.layers))
        engine.counters.layers, engine.counters.step = fresh.layers, fresh.step  # the exchanger holds this object
        engine.logit_keys, engine.logit_rows, engine.trace = [], [], []
        cache = getattr(engine.model, "expert_cache", None)
        if cache is not None:
            cache.restart()

    # --- figures for rank 0's metrics ----------------------------------------------------------------
    def stats_vector(self) -> torch.Tensor:
        """float64 [L * 6 + 8]: per block the bytes of dispatch, combine, merge, context and the
        local/all slot counts; token_sync bytes; expert-cache requests, hits, loads, prefetches,
        prefetched keys that hit, requests computed on the host; steps."""
        values = []
        for layer in self.engine.counters.layers:
            values += [layer[p]["bytes"] for p in ("dispatch", "combine", "merge", "context")]
            values += [layer["local_slots"], layer["slots"]]
        values.append(self.engine.counters.step["token_sync_bytes"])
        cache = getattr(self.engine.model, "expert_cache", None)
        values += ([cache.requests, cache.hits, cache.loads, cache.prefetches, cache.prefetch_hits, cache.host_computed]
                   if cache is not None else [0] * 6)
        values.append(self.steps)
        return torch.tensor(values, dtype=torch.float64)

    def gather_stats(self) -> list | None:
        """Every rank's `stats_vector` on rank 0 (a list, one per rank); None elsewhere."""
        mine = self.stats_vector()
        if self.world == 1:
            return [mine]
        out = [torch.zeros_like(mine) for _ in range(self.world)] if self.rank == 0 else None
        dist.gather(mine, out, dst=0, group=self.group)
        return out


def stats_figures(vectors: list, num_layers: int) -> dict:
    """metrics() figures from every rank's `stats_vector` (lists of floats): exchange bytes summed over
    ranks by (block, kind) and (None, "token_sync"), expert-cache hits, misses, prefetches, prefetched
    keys that hit and misses computed on the host, GPU-local fraction."""
    total = [sum(v[i] for v in vectors) for i in range(len(vectors[0]))]
    exchange, local, slots = {}, 0, 0
    for layer in range(num_layers):
        row = total[layer * 6:(layer + 1) * 6]
        for k, kind in enumerate(("dispatch", "combine", "merge", "context")):
            exchange[(layer, kind)] = int(row[k])
        local, slots = local + row[4], slots + row[5]
    exchange[(None, "token_sync")] = int(total[num_layers * 6])
    requests, hits, _, prefetches, prefetch_hits, host = total[num_layers * 6 + 1:num_layers * 6 + 7]
    cache = {"hits": int(hits), "misses": int(requests - hits), "prefetches": int(prefetches),
             "prefetch_hits": int(prefetch_hits), "host_computed": int(host)}
    return {"exchange_bytes": exchange, "expert_cache": cache,
            "gpu_local_fraction": local / slots if slots else None}
