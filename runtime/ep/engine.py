"""One rank's expert-parallel forward over the library's own model: context-coherent (ExFlow) or
standard EP.

The model is the library's (`library_model.RankModel`); the engine replaces only the routed-expert
computation of each MoE block (`moe_adapter`) and, in coherent mode, watches three hook points. The
generation loop is not here: the batch worker (`serving/worker.py`) runs every forward, for the
service and for static runs alike (`serving/static_batch.py`), through the public interface:
`install_hooks`/`remove_hooks`, `forward_rows` (one library forward over keyed rows, batched and
left-padded, with the library's KV cache), `route` (what every MoE block calls), `real_rows`, and
for recording engines `recorded_logits`/`recorded_routing`. A sequence is owned by one rank.

* **standard EP**: a rank runs its own requests. At each MoE block the library routes; the adapter
  sends each token's normed hidden state and gate weights to the ranks of its k experts
  (`dispatch`), they run their local experts, and the weighted outputs come back (`combine`).
  Shared experts, residuals and everything else stay the library's, on the owner. A rank with no
  request runs a one-row dummy forward so that every rank joins every exchange.
* **context-coherent EP**: every rank runs every request's forward, so every rank holds every
  context in its own library cache; a token's hidden state is real only on its *current* rank,
  the other ranks carry a placeholder row (zeros). Until the first MoE block all ranks compute
  every token identically; there each rank serves its own experts' slots and the weighted outputs
  meet on the rank of the token's highest-weight expert (`merge`), which becomes its current rank.
  At later blocks:
  - context (`context_exchange.py`): the current rank sends every rank what they need to fill
    their library KV cache for its tokens, per block the smaller of the normed hidden state (put
    in the placeholder rows at the attention input) and the K/V the cache stores (swapped in at
    the cache's `update`: K + V for GQA, the latent + rotated key for MLA); the outputs of
    placeholder rows are discarded;
  - norm-before-MoE hook: the current rank learns the routing by running the library's own norm
    and MoE block on its tokens up to the experts (stopped there, `moe_adapter.Captured`), then
    sends the post-attention hidden state and gate weights to its experts' ranks (`dispatch`);
    receivers put it in the row the library normalises;
  - the adapter: each rank runs its local experts on what it received; outputs merge on the
    primary rank (`merge`);
  - block output hook: on the primary rank the library's output row is x + f(...) with the
    placeholder residual; it is corrected to the received residual (out - placeholder + x),
    and every row that is not current here is reset to zeros.
  Costs: placeholder rows repeat the dense compute of other ranks' tokens (attention as ExFlow
  needs for the KV cache; norms, routers and shared experts beyond that). Bytes are counted as
  before: (world - 1) x (C + 2) x 4 per token per block in `context` (C = D, or the K/V elements),
  the dispatch and merge rows.
The final hidden state never returns to the owner: the current rank computes the logits and
samples the token, and the worker's per-step AllGather of new tokens (`token_sync`) tells every rank.
"""
from __future__ import annotations

from contextlib import contextmanager

import numpy as np
import torch

from .context_exchange import ContextExchange, context_plan, hidden_size
from .exchange import by_destination, pack, pack_small, unpack, unpack_small
from .gathered_moe import gathered_route
from ..model.moe_adapter import Captured

COHERENT, STANDARD = "coherent", "standard"


class Engine:
    """One rank's share of expert-parallel forwards over a RankModel (see module docstring)."""

    def __init__(self, model, table, exchanger, counters, rank: int, world_size: int, mode: str, device,
                 top_k: int, context: str = "auto", record: bool = True):
        if mode not in (COHERENT, STANDARD):
            raise ValueError(f"mode must be '{COHERENT}' or '{STANDARD}', got {mode!r}")
        self.model, self.table, self.ex, self.counters = model, table, exchanger, counters
        self.rank, self.world, self.mode, self.device, self.top_k = rank, world_size, mode, device, int(top_k)
        self.num_layers = model.num_layers
        self.local_experts = {(l, e) for l, e in table.experts_on(rank)}
        self.logit_keys, self.logit_rows = [], []
        self.trace = []  # (MoE layer, keys [n], expert ids [n, k], weights [n, k])
        self.records = bool(record)  # static runs keep every logit row and routing for results; a service keeps none
        self.hooks: list = []  # handles of install_hooks()
        self.capture = False
        # gathered forwards (`gathered_moe.py`, turned on by `gathered_moe.enable_gathering`): while a forward
        # gathers, a tensor [n] whose size is the rows every rank sends (`gathering`); None: dynamic gating
        self.gather_anchor = None
        self.local_tally = None
        self.replica_rule = None  # the replica rule on the device, where experts have copies (`device_replicas.py`)
        # coherent mode: per block, ("hidden" | "kv", elements per token) of the context exchange
        self.context_plan = context_plan(model.attention, hidden_size(model.model), context)

    # --- one forward ---------------------------------------------------------------------------
    def _to_all_others(self, rows: torch.Tensor) -> list:
        return [rows[:0] if d == self.rank else rows for d in range(self.world)]

    def _rows_of(self, keys: torch.Tensor) -> torch.Tensor:
        """int64 [m]: the forward's row of each token key [m] (CPU; every key one of this step's)."""
        if self._key_index is None:
            self._key_index = torch.sort(self.keys)
        ordered, rows = self._key_index
        return rows[torch.searchsorted(ordered, keys.contiguous())]

    def forward_rows(self, ids, pos, key_mask, cache, keys):
        """One library forward over rows `keys` [B * S] (sequence x stride + position; -1: padding or a
        dummy row) of ids, pos, key_mask [B, S] (key_mask [B, cache columns + S] with a cache): (logits
        [B * S, V], indices of the rows whose forward ended on this rank, the cache to pass next time).
        Every rank calls it for every forward of a step, in the same order (the exchanges pair up);
        a recording engine keeps the logits of the rows that ended here."""
        dev = self.device
        self.keys = keys
        real = keys >= 0
        # a prefill takes the general path even with no padding, so that a compiled one is one graph for both
        self.all_real = bool(real.all()) and ids.shape[1] == 1
        self.active = real.nonzero().flatten()          # rows that are tokens (not padding), CPU
        self.dev_active = self.active.to(dev)
        self.dev_real = real.to(dev)
        for rows in (self.dev_active, self.dev_real):  # sizes a compiled step keeps symbolic
            torch._dynamo.maybe_mark_dynamic(rows, 0)
        self._key_index = None                          # (sorted keys, their rows): `_rows_of`, built when asked
        self.mine = real
        self.replicated = self.mode == COHERENT
        # a compiled prefill's MoE blocks must not read the routing on the host: alone, or gathered
        self.model.prefill_compiles = self.world == 1 or self.gather_anchor is not None
        with torch.no_grad():
            logits, cache = self.model.forward(ids.to(dev), pos.to(dev), key_mask.to(dev), cache)
        # counted here, outside a compiled step: a world of one serves every slot; a gathered forward tallied the
        # slots it served on the device (`gathered_moe.py`); dynamic gating counted them as it routed
        if (self.world == 1 and self.mode == STANDARD) or self.gather_anchor is not None:
            slots = self.active.numel() * self.top_k
            local = [slots] * self.num_layers if self.world == 1 else self.local_tally.tolist()
            if self.world > 1:
                self.local_tally.zero_()
            for adapter in self.model.adapters:
                self._count_local(adapter.layer, adapter.moe, local[adapter.layer], slots)
        flat = logits.reshape(-1, logits.shape[-1])
        here = (self.mine & (keys >= 0)).nonzero().flatten()
        if self.records:
            self.logit_keys.append(keys[here])
            self.logit_rows.append(flat[here.to(dev)].detach().float().cpu())
        return flat, here, cache

    def join_exchanges(self) -> None:
        """Take part in a forward's exchanges with no row of this rank's own (standard mode, no sequence here this
        step): each MoE block's route over zero rows, in block order, without the model: the other ranks' rows are
        served here as in a forward, at the cost of the MoE blocks' exchanges and experts only."""
        empty = torch.zeros(0, dtype=torch.int64)
        self.keys, self.active, self.dev_active, self.mine = empty, empty, empty.to(self.device), empty.bool()
        self.dev_real, self.all_real, self.replicated, self._key_index = self.mine.to(self.device), True, False, None
        dtype = next(self.model.model.parameters()).dtype
        h = torch.zeros(0, hidden_size(self.model.model), dtype=dtype, device=self.device)
        ids = torch.zeros(0, self.top_k, dtype=torch.int64, device=self.device)
        with torch.no_grad():
            for adapter in self.model.adapters:
                adapter.routed(h, ids, h.new_zeros(0, self.top_k))

    @contextmanager
    def gathering(self, rows: int | None):
        """The forwards inside gather (`gathered_moe.py`) where this engine gathers, every rank sending `rows` rows
        to each; None, or an engine that does not gather: they exchange by dynamic gating. Every rank enters it
        alike around a forward."""
        if rows is not None and self.gathers:
            self.gather_anchor = torch.empty(rows, device=self.device)
            torch._dynamo.maybe_mark_dynamic(self.gather_anchor, 0)  # a compiled step keeps n a symbol
        try:
            yield
        finally:
            self.gather_anchor = None

    @contextmanager
    def padded(self, rows: int, real: torch.Tensor):
        """Inside, a decode forward runs `rows` rows, its own then padding rows (a CUDA graph's bucket,
        `model/graph_decode.py`); `real` bool [rows] (on the device, the bucket's own tensor) says which are its own.
        A rank alone computes the padding rows like the others (no row is selected: fixed shapes); a gathered step
        routes them nowhere (`gathered_moe.py` reads `real`). The step's slots are still counted from its own rows,
        after the forward."""
        keys, all_real, dev_real = self.keys, self.all_real, self.dev_real
        self.keys = torch.cat([keys, keys.new_full((rows - keys.shape[0],), -1)])
        self.all_real = self.gather_anchor is None
        self.dev_real = real
        try:
            yield
        finally:
            self.keys, self.all_real, self.dev_real = keys, all_real, dev_real

    def stop_gathering(self) -> None:
        """Back to dynamic gating for every forward (a warm-up that ended eager)."""
        self.gather_anchor = self.local_tally = self.replica_rule = None

    @property
    def gathers(self) -> bool:
        """Whether `gathered_moe.enable_gathering` turned this engine's gathered decode steps on."""
        return self.local_tally is not None

    def real_rows(self) -> torch.Tensor:
        """bool [n]: the forward's rows whose hidden state is real on this rank (own requests in
        standard mode, the rows current here in coherent mode; never padding)."""
        return (self.keys >= 0) & (self.mine if self.mode == COHERENT else True)

    # --- the routed computation (called by the library's MoE blocks) ------------------------
    def route(self, adapter, h, ids, weights):
        """The routed-expert sum [n, D] of one MoE block (`adapter`) for the forward's rows h [n, D]
        the library routed to ids/weights [n, k], heaviest first: this rank's experts run here, the
        others' through the exchanges. `install_hooks` makes every MoE block call it."""
        if self.capture:
            raise Captured(ids.detach().cpu(), weights.detach())
        # (a compiled decode step, `compiled_decode.py`, passes every row; the check there would fix the batch size)
        if not torch.compiler.is_compiling() and h.shape[0] != self.keys.shape[0]:
            raise RuntimeError(f"MoE block saw {h.shape[0]} rows, the step has {self.keys.shape[0]}")
        if self.mode == STANDARD:
            if self.gather_anchor is not None:
                return gathered_route(self, adapter, h, ids, weights)
            return self._standard(adapter, h, ids, weights)
        if self.replicated:
            return self._coherent_first(adapter, h, ids.cpu(), weights)
        rows, r_ids, r_w, r_dest = self.received
        partial = self._serve(adapter, h[rows.to(h.device)], r_ids, r_w, r_dest)
        return self._merge_on_primary(adapter.layer, h, rows, partial, r_dest[:, 0])

    def _destinations(self, moe: int, ids: torch.Tensor, current: np.ndarray) -> torch.Tensor:
        """int64 [n, k]: the rank of every slot of expert ids [n, k] (CPU) of tokens current on ranks [n]
        (the replica rule of `expert_table.py`)."""
        return torch.from_numpy(self.table.choose(moe, ids.numpy(), current))

    def _count_local(self, layer: int, moe: int, local: int, slots: int) -> None:
        if moe >= 1:
            lay = self.counters.layers[layer]
            lay["local_slots"] += int(local)
            lay["slots"] += int(slots)

    def _dispatch(self, adapter, x, ids, weights, keys, dest):
        """Send rows (x [n, D] with weights, keys, ids, dest) to the ranks of their slots, packed in
        rank order in one tensor (`exchange.by_destination`); returns what this rank received:
        (x [m, D], weights [m, k], keys [m], ids [m, k], dest [m, k]; CPU but x and weights), how many
        rows came from each rank, the rows sent, in the order they went, and how many went to each rank."""
        k, D = ids.shape[1], x.shape[1]
        order, counts = by_destination(dest, self.world)
        meta = torch.cat([keys[:, None], pack_small(torch.cat([ids, dest], 1))], 1)[order]
        rows = pack(torch.cat([x, weights.to(x.dtype)], dim=1)[order.to(x.device)], meta)
        got, got_counts = self.ex.exchange_sorted(rows, counts, rows.shape[1], adapter.layer, "dispatch")
        rx, m = unpack(got, D + k)
        m = m.cpu()
        slots = unpack_small(m[:, 1:], 2 * k)
        return (rx[:, :D], rx[:, D:], m[:, 0], slots[:, :k], slots[:, k:]), got_counts, order, counts

    def _one_rank(self, adapter, h, ids, weights):
        """World of one: every slot is local, nothing to choose, pack or exchange; the routing stays on
        the device (no host sync), padding rows aside."""
        if self.all_real:
            a_h, a_ids, a_w = h, ids, weights
        else:
            a_h, a_ids, a_w = h[self.dev_active], ids[self.dev_active], weights[self.dev_active]
        if self.records:
            self._record_routing(adapter.moe, self.keys[self.active], a_ids.cpu(), a_w)
        partial = adapter.local_expert_output(a_h, adapter.local_slots(a_ids), a_w).to(h.dtype)
        return partial if self.all_real else torch.zeros_like(h).index_copy(0, self.dev_active, partial)

    def _standard(self, adapter, h, ids, weights):
        if self.world == 1:
            return self._one_rank(adapter, h, ids, weights)
        active, dev_active = self.active, self.dev_active
        a_ids, a_w, a_h, keys = ids.cpu()[active], weights[dev_active], h[dev_active], self.keys[active]
        dest = self._destinations(adapter.moe, a_ids, np.full(active.numel(), self.rank))
        self._count_local(adapter.layer, adapter.moe, int((dest == self.rank).sum()), dest.numel())
        self._record_routing(adapter.moe, keys, a_ids, a_w)
        (r_h, r_w, _, r_ids, r_dest), got_counts, sent, sent_counts = self._dispatch(adapter, a_h, a_ids, a_w, keys, dest)
        partial = self._serve(adapter, r_h, r_ids, r_w, r_dest)
        # the partial sums go back to their sources in the order they came; they return in the order sent,
        # as many from each rank as went to it (no counts to exchange)
        returned, _ = self.ex.exchange_sorted(partial, got_counts, h.shape[1], adapter.layer, "combine", sent_counts)
        return torch.zeros_like(h).index_add(0, dev_active[sent.to(h.device)], returned.to(h.dtype))

    def _coherent_first(self, adapter, h, ids, weights):
        """First MoE block in coherent mode: every rank holds every token, nothing is dispatched;
        replica choices depend only on the token, so ranks agree without talking."""
        active, dev_active = self.active, self.dev_active
        a_ids, a_w = ids.cpu()[active], weights[dev_active]
        first = self.table.primary(adapter.moe, a_ids[:, 0].numpy(), np.full(active.numel(), -1))
        dest = self._destinations(adapter.moe, a_ids, first)
        primary = dest[:, 0] == self.rank
        self._record_routing(adapter.moe, self.keys[active][primary], a_ids[primary], a_w[primary.to(a_w.device)])
        sel = (dest == self.rank).any(dim=1).nonzero().flatten()
        rows = active[sel]
        partial = self._serve(adapter, h[rows.to(h.device)], a_ids[sel], a_w[sel.to(h.device)], dest[sel])
        return self._merge_on_primary(adapter.layer, h, rows, partial, dest[sel, 0], all_rows=active, all_primary=dest[:, 0])

    def _serve(self, adapter, x, ids, w, dest):
        """Sum over this rank's slots of weight x expert(x): [m, D] for rows x [m, D] with expert ids,
        weights and destination ranks [m, k] (ids and dest on the CPU); zero for rows with no slot here.
        One grouped call (`moe_adapter.slot_output`) over the (row, slot) pairs served here."""
        here = dest == self.rank
        if x.shape[0] == 0 or bool(here.all()):
            return adapter.local_expert_output(x, self._held(adapter, ids).to(x.device), w).to(x.dtype)
        rows, slots = here.nonzero(as_tuple=True)
        out = torch.zeros_like(x)
        if rows.numel() == 0:
            return out
        dev_rows = rows.to(x.device)
        local = self._held(adapter, ids[rows, slots])[:, None].to(x.device)
        y = adapter.local_expert_output(x[dev_rows], local, w[dev_rows, slots.to(x.device)][:, None])
        return out.index_add(0, dev_rows, y.to(out.dtype))

    def _held(self, adapter, ids: torch.Tensor) -> torch.Tensor:
        """Local expert indices of expert ids (CPU), refusing an expert this rank does not hold."""
        local = adapter.local_slots(ids)
        missing = local < 0
        if bool(missing.any()):
            raise RuntimeError(f"rank {self.rank} received tokens for expert {int(ids[missing][0])} of MoE layer "
                               f"{adapter.moe} it does not hold")
        return local

    def _merge_on_primary(self, layer, h, rows, partial, primary, all_rows=None, all_primary=None):
        """Coherent combine: partial outputs of forward rows `rows` meet on their primary rank.
        Returns the routed sum [n, D] (nonzero only on rows whose primary is this rank) and sets
        the rows current here after this block."""
        away = (primary != self.rank).nonzero().flatten()
        away = away[torch.argsort(primary[away], stable=True)]  # grouped by primary rank, in row order
        counts = torch.bincount(primary[away], minlength=self.world).tolist()
        send = pack(partial[away.to(partial.device)], self.keys[rows][away][:, None])
        merged, _ = self.ex.exchange_sorted(send, counts, h.shape[1] + 2, layer, "merge")
        here = (primary == self.rank).nonzero().flatten()
        out = torch.zeros_like(h).index_add(0, rows[here].to(h.device), partial[here.to(h.device)].to(h.dtype))
        if merged.shape[0]:
            p, m = unpack(merged, h.shape[1])
            out = out.index_add(0, self._rows_of(m[:, 0].cpu()).to(h.device), p.to(h.dtype))
        all_rows = rows if all_rows is None else all_rows
        all_primary = primary if all_primary is None else all_primary
        mine = torch.zeros_like(self.mine)
        mine[all_rows[all_primary == self.rank]] = True
        self.next_mine = mine
        return out

    # --- hooks into the library's model ------------------------------------------------------
    def install_hooks(self) -> None:
        """Make the library's model run through this engine until `remove_hooks`: every MoE block's
        routed experts go through `route`; coherent mode adds its context, norm-before-MoE and
        block-output hooks; an expert cache's live speculation (issue 33) hooks in last, after the
        block-output hook, so it sees the corrected rows. Installing twice is refused."""
        if self.hooks:
            raise RuntimeError("the engine's hooks are already installed")
        for adapter in self.model.adapters:
            adapter.route_fn = self.route
        handles = self._coherent_hooks() if self.mode == COHERENT else []
        speculation = getattr(self.model, "speculation", None)
        if speculation is not None:
            handles += speculation.install(self.real_rows)
        self.hooks = handles

    def remove_hooks(self) -> None:
        """Undo `install_hooks`' forward hooks (the MoE blocks keep calling `route`, which only this engine sets)."""
        for handle in self.hooks:
            handle.remove()
        self.hooks = []

    def _coherent_hooks(self) -> list:
        m = self.model
        handles = []
        handles += ContextExchange(self, self.context_plan).install()  # hidden state or K/V, per block
        for layer in range(m.num_layers):
            handles.append(m.layers[layer].register_forward_hook(self._block_output(layer)))
        for adapter in m.adapters:
            handles.append(m.ffn_norm[adapter.layer].register_forward_pre_hook(self._ffn_norm_input(adapter)))
        return handles

    def _ffn_norm_input(self, adapter):
        def hook(module, args):
            if self.replicated or self.capture:
                return None
            x = args[0]
            flat = x.reshape(-1, x.shape[-1])
            mine = self.mine.nonzero().flatten()
            dev_mine = mine.to(flat.device)
            ids, w = torch.zeros(0, self.top_k, dtype=torch.int64), flat.new_zeros(0, self.top_k)
            if mine.numel():
                self.capture = True
                try:  # the library's own norm and MoE block route my tokens, stopped at the experts
                    adapter.block(module(flat[dev_mine]).unsqueeze(0))
                except Captured as c:
                    ids, w = c.ids, c.weights
                finally:
                    self.capture = False
            dest = self._destinations(adapter.moe, ids, np.full(mine.numel(), self.rank))
            self._count_local(adapter.layer, adapter.moe, int((dest == self.rank).sum()), dest.numel())
            self._record_routing(adapter.moe, self.keys[mine], ids, w)
            (r_x, r_w, r_keys, r_ids, r_dest), _, _, _ = self._dispatch(adapter, flat[dev_mine], ids, w, self.keys[mine], dest)
            rows = self._rows_of(r_keys)
            self.received = (rows, r_ids, r_w, r_dest)
            dev_rows = rows.to(flat.device)
            self.placeholder = flat[dev_rows].clone()
            self.residual = r_x.to(flat.dtype)
            new = flat.clone()
            new[dev_rows] = self.residual
            return (new.view(x.shape),) + tuple(args[1:])
        return hook

    def _block_output(self, layer: int):
        def hook(module, args, output):
            moe = self.model.moe_of.get(layer)
            if self.replicated and moe is None:
                return None
            out = output[0] if isinstance(output, tuple) else output
            flat = out.reshape(-1, out.shape[-1]).clone()
            if moe is not None:
                if not self.replicated:
                    rows, _, _, r_dest = self.received
                    here = (r_dest[:, 0] == self.rank).nonzero().flatten()
                    r = rows[here].to(flat.device)
                    flat[r] = self.residual[here.to(flat.device)] + (flat[r] - self.placeholder[here.to(flat.device)])
                self.mine = self.next_mine
                self.replicated = False
            flat[(~self.mine).to(flat.device)] = 0
            new = flat.view(out.shape)
            return (new,) + tuple(output[1:]) if isinstance(output, tuple) else new
        return hook

    # --- recording (static runs: results, verification, the cost model's checks) --------------
    def _record_routing(self, moe: int, keys: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> None:
        """Keep the routing of the tokens current here at MoE layer `moe`: keys [n], ids/weights [n, k]."""
        if self.records:
            self.trace.append((moe, keys, ids, weights.detach().float().cpu()))

    def recorded_logits(self) -> tuple:
        """(keys [T], logits [T, V]) of every token whose forward pass ended on this rank (recording engines)."""
        if not self.logit_keys:
            return torch.zeros(0, dtype=torch.int64), torch.zeros(0, 0)
        return torch.cat(self.logit_keys), torch.cat(self.logit_rows)

    def recorded_routing(self) -> dict:
        """{MoE layer: (keys [T], expert ids [T, k], weights [T, k])} of every token routed on this rank
        (recording engines), each token once: at its current rank in coherent mode, its owner in standard."""
        parts = {}
        for moe, keys, ids, w in self.trace:
            parts.setdefault(moe, []).append((keys, ids, w))
        return {moe: tuple(torch.cat(p) for p in zip(*got)) for moe, got in sorted(parts.items())}
