"""Greedy generation under expert parallelism: context-coherent (ExFlow) or standard EP.

Requests are owned round-robin (request i by rank i % world). Per MoE layer:

* **standard EP**: a token enters on its owner rank, which holds the request's KV cache and runs
  all its attention and dense parts; dispatch all-to-all
  of the token to the ranks of its k experts; combine all-to-all of the weighted expert outputs
  back to the owner.
* **context-coherent EP**: every rank holds every request's context, so attention runs wherever
  the token is. One dispatch all-to-all moves the token from its current rank to the ranks of its
  experts; the combine happens on the rank of its highest-weight expert, which becomes its
  current rank for the next layer's attention. With top-k > 1 the other experts' weighted
  outputs (only those computed off that rank) reach it through a smaller `merge` exchange.

The first MoE layer needs no dispatch in coherent mode: every rank holds every context, so every
rank embeds every new token and runs the blocks up to the first MoE router itself (identical
inputs, identical results); each rank then serves its own experts' slots from its copy and only
the partial outputs travel to the primary rank (`merge`). Replica choices there depend only on
the token, so ranks agree without talking.

Attention state (ExFlow leaves it open): after each layer's attention norm, the normed hidden
state h of every token processed this step is sent to every other rank (`context` phase), and
each rank projects the keys and values itself from its replicated attention weights, so every
rank keeps the full KV cache of all requests and can run any token's attention. h is D floats
per token and destination, half of shipping K and V. This costs (world - 1) x (D x 4 + 8) bytes
per token per block after the first MoE layer, independent of placement, and is counted in the
`context` phase, apart from the all-to-all phases: with it, coherent mode moves more bytes in
total than standard EP on small models, which the run report shows side by side. The final hidden state never returns to the owner: the current rank
computes the logits and the greedy token, and the per-step AllGather of new tokens (which context
coherence needs anyway) tells every rank, the owner included.
"""
from __future__ import annotations

import time

import torch

from .exchange import pack, pack_small, unpack, unpack_small

COHERENT, STANDARD = "coherent", "standard"


class Engine:
    """One rank's share of expert-parallel greedy generation."""

    def __init__(self, arch, table, exchanger, counters, rank: int, world_size: int, mode: str, device):
        if mode not in (COHERENT, STANDARD):
            raise ValueError(f"mode must be '{COHERENT}' or '{STANDARD}', got {mode!r}")
        self.arch, self.table, self.ex, self.counters = arch, table, exchanger, counters
        self.rank, self.world, self.mode, self.device = rank, world_size, mode, device
        self.local_experts = {(l, e) for l, e in table.experts_on(rank)}
        self.logit_keys, self.logit_rows = [], []
        self.trace = []  # (layer, keys [n], expert ids [n, k], weights [n, k])
        self.expert_cache = None  # expert_cache.ExpertCache when experts are offloaded (issue 13)
        self.forward_index = 0

    # --- bookkeeping -----------------------------------------------------------------------
    def owner(self, seq: int) -> int:
        return seq % self.world

    def key(self, seq, pos):
        return seq * self.max_len + pos

    def _to_all_others(self, rows: torch.Tensor) -> list:
        empty = rows[:0]
        return [empty if d == self.rank else rows for d in range(self.world)]

    # --- generation ------------------------------------------------------------------------
    def generate(self, prompts: list, new_tokens: int) -> dict:
        """Greedy-generate `new_tokens` tokens for every prompt; returns this rank's results."""
        arch = self.arch
        self.max_len = max(len(p) for p in prompts) + new_tokens
        if self.max_len > arch.max_positions:
            raise ValueError(f"prompt + new tokens = {self.max_len} exceeds the model's {arch.max_positions} positions")
        B = len(prompts)
        shape = (B, arch.num_kv_heads, self.max_len, arch.head_dim)
        self.k_cache = [torch.zeros(shape, device=self.device) for _ in range(arch.num_layers)]
        self.v_cache = [torch.zeros(shape, device=self.device) for _ in range(arch.num_layers)]
        own = [s for s in range(B) if self.owner(s) == self.rank]
        contexts = {s: list(prompts[s]) for s in own}
        if self.mode == COHERENT:
            contexts = self._sync_prompts(prompts, own)
        generated = {s: [] for s in contexts}
        start = time.perf_counter()
        # coherent: every rank holds every context, so every rank enters every token (see module)
        entering = sorted(contexts) if self.mode == COHERENT else own
        step_tokens = [(s, p) for s in entering for p in range(len(prompts[s]))]
        for step in range(new_tokens):
            self.forward_index = step
            seqs = torch.tensor([s for s, _ in step_tokens], dtype=torch.int64)
            poss = torch.tensor([p for _, p in step_tokens], dtype=torch.int64)
            ids = torch.tensor([contexts[s][p] for s, p in step_tokens], dtype=torch.int64)
            last = {s: len(c) - 1 for s, c in contexts.items()}
            new = self._forward_step(seqs, poss, ids, last)
            if self.mode == COHERENT:
                new = self._sync_tokens(new)
            for s, t in sorted(new.items()):
                contexts[s].append(t)
                generated[s].append(t)
            step_tokens = [(s, len(contexts[s]) - 1) for s in entering]
        elapsed = time.perf_counter() - start
        return {
            "generated": {int(s): g for s, g in generated.items()},
            "elapsed_s": elapsed,
            "counters": self.counters.to_dict(),
        }

    def _sync_prompts(self, prompts: list, own: list) -> dict:
        """AllGather of the prompts: every rank learns every request's context from its owner."""
        meta = torch.tensor([[s, p, t] for s in own for p, t in enumerate(prompts[s])], dtype=torch.int64).reshape(-1, 3)
        rows = pack(torch.zeros(meta.shape[0], 0), meta)
        contexts = {s: list(prompts[s]) for s in own}
        for got in self.ex.exchange(self._to_all_others(rows), rows.shape[1], None, "prompt_sync"):
            _, m = unpack(got.cpu(), 0)
            for s, p, t in m.tolist():
                contexts.setdefault(s, []).append((p, t))
        for s, entries in contexts.items():
            if s not in own:
                contexts[s] = [t for _, t in sorted(entries)]
        return {s: contexts[s] for s in sorted(contexts)}

    def _sync_tokens(self, new: dict) -> dict:
        """AllGather of the tokens just generated on this rank."""
        meta = torch.tensor(sorted(new.items()), dtype=torch.int64).reshape(-1, 2)
        rows = pack(torch.zeros(meta.shape[0], 0), meta)
        merged = dict(new)
        for got in self.ex.exchange(self._to_all_others(rows), rows.shape[1], None, "token_sync"):
            _, m = unpack(got.cpu(), 0)
            merged.update({s: t for s, t in m.tolist()})
        return merged

    # --- one forward step ------------------------------------------------------------------
    def _forward_step(self, seq, pos, token_ids, last_pos: dict) -> dict:
        """Run the tokens entering on this rank through every layer; returns {seq: next token}
        for the sequences whose last token of this step (position last_pos[seq]) ends here."""
        arch, dev = self.arch, self.device
        x = arch.embed(token_ids.to(dev), pos.to(dev))
        replicated = self.mode == COHERENT  # every rank computes the same tokens until the first MoE
        for layer in range(arch.num_layers):
            x = x + self._attention(layer, seq, pos, x, replicated)
            moe = arch.moe_index(layer)
            if moe is None:  # a dense feed-forward block: replicated, runs where the token is
                x = x + arch.dense_mlp(layer, x)
            else:
                seq, pos, x = self._moe(layer, moe, seq, pos, x, replicated)
                replicated = False
        logits = arch.logits(x)
        keys = self.key(seq, pos)
        self.logit_keys.append(keys.cpu())
        self.logit_rows.append(logits.detach().cpu())
        new = {}
        for i, (s, p) in enumerate(zip(seq.tolist(), pos.tolist())):
            if p == last_pos[s]:
                new[s] = int(torch.argmax(logits[i]).item())
        return new

    def _attention(self, layer, seq, pos, x, replicated=False):
        arch, dev = self.arch, self.device
        h = arch.attention_input(layer, x)
        all_h, all_seq, all_pos = h, seq, pos
        if self.mode == COHERENT and not replicated:
            rows = pack(h, self.key(seq, pos)[:, None])
            got = self.ex.exchange(self._to_all_others(rows), rows.shape[1], layer, "context")
            parts = [unpack(g, arch.hidden) for g in got if g.shape[0]]
            if parts:
                all_h = torch.cat([h] + [p for p, _ in parts])
                keys = torch.cat([self.key(seq, pos)] + [m[:, 0].cpu() for _, m in parts])
                all_seq, all_pos = keys // self.max_len, keys % self.max_len
        q, k, v = arch.qkv(layer, all_h, all_pos.to(dev))
        self.k_cache[layer][all_seq.to(dev), :, all_pos.to(dev)] = k
        self.v_cache[layer][all_seq.to(dev), :, all_pos.to(dev)] = v
        q = q[: x.shape[0]]
        y = torch.empty_like(q)
        for s in torch.unique(seq).tolist():
            idx = (seq == s).nonzero().flatten()
            p = pos[idx].to(dev)
            span = int(p.max()) + 1
            keys, values = self.k_cache[layer][s, :, :span], self.v_cache[layer][s, :, :span]
            if arch.num_kv_heads != arch.num_heads:  # grouped-query attention
                groups = arch.num_heads // arch.num_kv_heads
                keys, values = keys.repeat_interleave(groups, dim=0), values.repeat_interleave(groups, dim=0)
            scores = torch.einsum("mhd,hpd->hmp", q[idx.to(dev)], keys) * arch.attention_scale
            future = torch.arange(span, device=dev)[None, :] > p[:, None]
            scores = scores.masked_fill(future[None], float("-inf"))
            y[idx.to(dev)] = torch.einsum("hmp,hpd->mhd", torch.softmax(scores, dim=-1), values)
        return arch.attention_output(layer, y)

    def _moe(self, layer, moe, seq, pos, x, replicated=False):
        """Block `layer`'s MoE, the `moe`-th MoE layer (placement and trace index).

        `replicated`: every rank holds the same tokens (the first MoE layer in coherent mode), so
        nothing is dispatched; each rank serves its slots from its own copy and the partial
        outputs merge on the primary rank. Replica choices then depend only on the token (the
        secondary slots prefer the primary's rank), so all ranks agree without talking."""
        arch, dev, k = self.arch, self.device, self.arch.top_k
        n = x.shape[0]
        ids, weights = arch.route(layer, x)
        ids = ids.cpu()
        if replicated:
            first = torch.tensor([self.table.primary_rank(moe, e, -1) for e in ids[:, 0].tolist()], dtype=torch.int64)
            dest = self.table.choose(moe, ids, first)
        else:
            dest = self.table.choose(moe, ids, torch.full((n,), self.rank, dtype=torch.int64))
        keys = self.key(seq, pos)
        recorded = (dest[:, 0] == self.rank) if replicated else torch.ones(n, dtype=torch.bool)
        self.trace.append((moe, keys[recorded], ids[recorded], weights.detach().cpu()[recorded]))
        if replicated:
            sel = (dest == self.rank).any(dim=1).nonzero().flatten()
            partial = self._experts(layer, moe, x[sel.to(dev)], weights[sel.to(dev)], ids[sel], dest[sel])
            return self._merge_on_primary(layer, x[sel.to(dev)], partial, seq[sel], pos[sel], dest[sel])
        if moe >= 1:
            lay = self.counters.layers[layer]
            lay["local_slots"] += int((dest == self.rank).sum())
            lay["slots"] += n * k
        payload = torch.cat([x, weights], dim=1)
        meta = torch.cat([keys[:, None], pack_small(torch.cat([ids, dest], dim=1))], dim=1)
        rows = pack(payload, meta)
        sent_idx = [(dest == d).any(dim=1).nonzero().flatten() for d in range(self.world)]
        got = self.ex.exchange([rows[i.to(dev)] for i in sent_idx], rows.shape[1], layer, "dispatch")
        width = arch.hidden + k
        parts = [unpack(g, width) for g in got]
        rx = torch.cat([p for p, _ in parts])
        rmeta = torch.cat([m.cpu() for _, m in parts])
        sources = torch.cat([torch.full((p.shape[0],), src, dtype=torch.int64) for src, (p, _) in enumerate(parts)])
        r_x, r_w = rx[:, : arch.hidden], rx[:, arch.hidden:]
        slots = unpack_small(rmeta[:, 1:], 2 * k)
        r_seq, r_pos = rmeta[:, 0] // self.max_len, rmeta[:, 0] % self.max_len
        r_ids, r_dest = slots[:, :k], slots[:, k:]
        partial = self._experts(layer, moe, r_x, r_w, r_ids, r_dest)
        if self.mode == STANDARD:
            back = [partial[(sources == d).nonzero().flatten().to(dev)] for d in range(self.world)]
            returned = self.ex.exchange(back, arch.hidden, layer, "combine")
            out = x + arch.shared(layer, x)
            for d in range(self.world):
                if sent_idx[d].numel():
                    out = out.index_add(0, sent_idx[d].to(dev), returned[d][:, : arch.hidden])
            return seq, pos, out
        return self._merge_on_primary(layer, r_x, partial, r_seq, r_pos, r_dest)

    def _merge_on_primary(self, layer, r_x, partial, r_seq, r_pos, r_dest):
        """Coherent combine: each token's weighted expert outputs meet on the rank of its
        highest-weight expert, which keeps the token (its new current rank)."""
        arch, dev = self.arch, self.device
        primary = r_dest[:, 0]
        mine = (primary == self.rank).nonzero().flatten()
        send = []
        for d in range(self.world):
            idx = ((primary == d) & (primary != self.rank)).nonzero().flatten()
            send.append(pack(partial[idx.to(dev)], self.key(r_seq[idx], r_pos[idx])[:, None]))
        merged = self.ex.exchange(send, arch.hidden + 2, layer, "merge")
        m_seq, m_pos = r_seq[mine], r_pos[mine]
        base = r_x[mine.to(dev)]
        out = base + partial[mine.to(dev)] + arch.shared(layer, base)
        row_of = {kk: i for i, kk in enumerate(self.key(m_seq, m_pos).tolist())}
        for g in merged:
            if g.shape[0] == 0:
                continue
            p, m = unpack(g, arch.hidden)
            rows_at = torch.tensor([row_of[kk] for kk in m[:, 0].cpu().tolist()], dtype=torch.int64)
            out = out.index_add(0, rows_at.to(dev), p)
        order = torch.argsort(self.key(m_seq, m_pos))
        return m_seq[order], m_pos[order], out[order.to(dev)]

    def _experts(self, layer, moe, x, w, ids, dest):
        """Sum over this rank's slots of weight x expert(x) for received rows (zero elsewhere)."""
        out = torch.zeros_like(x)
        here = dest == self.rank
        experts = sorted(set(ids[here].tolist()))
        if self.expert_cache is not None:  # offloading: each expert made resident as its turn comes, in request order
            experts = self.expert_cache.serve(moe, list(dict.fromkeys(ids[here].tolist())), self.forward_index)
        for e in experts:
            rows, slots = ((ids == e) & here).nonzero(as_tuple=True)
            if (moe, e) not in self.local_experts:
                raise RuntimeError(f"rank {self.rank} received tokens for expert {e} of MoE layer {moe} it does not hold")
            dev_rows = rows.to(x.device)
            y = self.arch.expert(layer, e, x[dev_rows]) * w[dev_rows, slots.to(x.device)].unsqueeze(-1)
            out = out.index_add(0, dev_rows, y)
        return out

    # --- results ---------------------------------------------------------------------------
    def logits(self) -> tuple:
        """(keys [T], logits [T, V]) of every token whose forward pass ended on this rank."""
        if not self.logit_keys:
            return torch.zeros(0, dtype=torch.int64), torch.zeros(0, 0)
        return torch.cat(self.logit_keys), torch.cat(self.logit_rows)

