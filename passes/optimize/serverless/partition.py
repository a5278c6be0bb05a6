"""MOPAR's HyPAD on the dense (non-MoE) stages of an MoE model: which dense units share a function.

Why: one function holding every dense weight is sized for the hungriest unit and pays that
memory for all of them; one function per stage pays a start-up and a transfer per stage.
HyPAD (MOPAR, Alg. 1) slices the chain in between. Reading used here (see docs/serverless.md):

* units: the dense stages in model order with each router after its layer's norm; MoE layers
  split the chain into *segments* (segment e runs before MoE layer e, the last one after).
  A slice is a run of consecutive units deployed as one function; it is invoked once per
  segment it touches (the experts run in between), each invocation loading the slice's weights
  (T^h of the serverless-MoE cost model) and reading/writing its activations;
* a unit's memory and time come from the profile's XGBoost predictors at the request's tokens;
  a function needs runtime + slice weights + the largest unit's intermediates and in/out tensors,
  rounded up to a platform memory option; time at a memory size uses its vCPU share;
* cut inside a segment: through S3 (write + read, one round trip each side), as the Lambda
  bundle does (Step Functions passes only request ids: its state is capped at 256 KB); with
  `payload_cuts=True` the activations go in the invoke payload when they fit the payload limit
  (the sender pays the transfer);
  the transfers at MoE boundaries happen under every partition and are counted for all;
* 1. simplify: neighbouring units of a segment whose memory differs by <= 5% merge (max memory,
  summed time), to a fixpoint; 2. exact DP over contiguous slices of the merged chain for
  minimum cost per request (each slice at its minimum memory, parallelism 1); 3. parallelism
  search: while the latency exceeds the limit (default: the single function's latency, MOPAR's
  constraint), give the slice whose next step (eta + 1 shards over the tokens, or the next
  memory option) buys latency at the least extra cost that step; none left -> UserError.
Cost per request = billed GB-s x price + request fees over every invocation.

Two accountings (`accounting=`): "lambda" (default, above: memory includes the runtime, vCPUs
follow memory) and "mopar", MOPAR's own (memory = the slice's largest unit, no runtime; time at
a fixed MOPAR_VCPUS whatever the memory), kept to show where its 2.58x comes from.
`compute_floor` bounds every partition's cost under "lambda" from below.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np

from moeplan.core.errors import UserError
from moeplan.runtime.lambda_.charges import MB_PER_GB, billed_gb_seconds, lambda_usd
from moeplan.core.platforms import Platform

MB = 1024 * 1024
MERGE_THRESHOLD = 0.05
ACCOUNTINGS = ("lambda", "mopar")
MOPAR_VCPUS = 1.0   # MOPAR profiles time once, independent of the function's memory


@dataclass(frozen=True)
class DenseUnit:
    """One dense unit (or a merged run of them) as partitioning sees it."""

    names: tuple
    segment: int
    param_bytes: int
    peak_bytes_per_token: float          # intermediates (max over the merged units)
    out_bytes_per_token: int             # tensor handed to the next unit
    in_bytes_per_token: int
    s_per_token: tuple                   # [threads] seconds per token at the request size, 1..n threads
    threads: tuple

    def seconds(self, tokens: float, vcpus: float) -> float:
        """Compute time for `tokens` at a vCPU share: best thread count, t / v slowdown below t vCPUs."""
        return min(s * tokens * max(1.0, t / vcpus) for s, t in zip(self.s_per_token, self.threads))

    def own_memory_bytes(self, tokens: float) -> float:
        return self.param_bytes + tokens * (self.peak_bytes_per_token + self.in_bytes_per_token + self.out_bytes_per_token)


@dataclass(frozen=True)
class Slice:
    first: int                 # index into the unit chain
    last: int
    memory_mb: int
    eta: int = 1               # parallel shards over the request's tokens


@dataclass
class SliceReport:
    names: list
    segments: list
    memory_mb: int
    eta: int
    param_bytes: int
    invocations: int
    billed_gb_s: float
    cost_usd: float
    latency_s: float


@dataclass
class PartitionResult:
    slices: list                 # SliceReport
    cost_per_request_usd: float
    latency_s: float
    latency_limit_s: float
    merged_units: int
    units: int
    steps: list = field(default_factory=list)   # parallelism-search moves taken
    fits: bool = True            # False when a fixed memory size is below a slice's need

    def to_dict(self) -> dict:
        return {"cost_per_request_usd": self.cost_per_request_usd, "latency_s": self.latency_s,
                "latency_limit_s": self.latency_limit_s, "units": self.units, "merged_units": self.merged_units,
                "slices": [vars(s) for s in self.slices], "parallelism_steps": self.steps}


class CostModel:
    """Cost and latency of a partition of the unit chain for a request of `tokens` tokens."""

    def __init__(self, units: list, platform: Platform, tokens: int, memory_options=None, payload_cuts: bool = False,
                 accounting: str = "lambda"):
        if accounting not in ACCOUNTINGS:
            raise ValueError(f"accounting must be one of {ACCOUNTINGS}, got {accounting!r}")
        self.units, self.p, self.tokens, self.payload_cuts = list(units), platform, int(tokens), payload_cuts
        self.options = sorted(int(m) for m in (memory_options or platform.memory_options_mb))
        self.accounting = accounting

    def vcpus(self, memory_mb: float) -> float:
        """Lambda: the share that memory buys; MOPAR: a fixed share (its time ignores memory)."""
        return self.p.vcpus(memory_mb) if self.accounting == "lambda" else MOPAR_VCPUS

    # -- transfers -----------------------------------------------------------------------
    def _internal_cut(self, k: int) -> bool:
        """Is the edge after unit k a cut inside a segment (not at an MoE layer or the end)?"""
        return k + 1 < len(self.units) and self.units[k].segment == self.units[k + 1].segment

    def _s3(self, n_bytes: float) -> float:
        return self.p.s3_latency_s + n_bytes / self.p.s3_bandwidth_bytes_per_s

    def _payload_fits(self, n_bytes: float) -> bool:
        return self.payload_cuts and n_bytes <= self.p.payload_limit_bytes

    def _in_time(self, k: int, tokens: float) -> float:
        """Reading the input of unit k when a slice starts there."""
        n = tokens * self.units[k].in_bytes_per_token
        if k > 0 and self._internal_cut(k - 1) and self._payload_fits(n):
            return 0.0  # arrives in the invoke payload; the sender paid the transfer
        return self._s3(n)

    def _out_time(self, k: int, tokens: float) -> float:
        n = tokens * self.units[k].out_bytes_per_token
        if self._internal_cut(k) and self._payload_fits(n):
            return n / self.p.f2f_bandwidth_bytes_per_s
        return self._s3(n)

    # -- one slice -----------------------------------------------------------------------
    def need_mb(self, first: int, last: int, eta: int = 1) -> float:
        """Lambda: runtime + all weights + the largest activations; MOPAR: the largest unit alone."""
        tokens = math.ceil(self.tokens / eta)
        us = self.units[first:last + 1]
        if self.accounting == "mopar":
            return max(u.own_memory_bytes(tokens) for u in us) / MB
        params = sum(u.param_bytes for u in us)
        act = max(tokens * (u.peak_bytes_per_token + u.in_bytes_per_token + u.out_bytes_per_token) for u in us)
        return self.p.runtime_memory_mb + (params + act) / MB

    def min_memory(self, first: int, last: int, eta: int = 1) -> int | None:
        need = self.need_mb(first, last, eta)
        return next((m for m in self.options if m >= need - 1e-9), None)

    def invocations(self, s: Slice) -> list:
        """Seconds of each invocation of one shard, one per segment the slice touches."""
        tokens = math.ceil(self.tokens / s.eta)
        v = self.vcpus(s.memory_mb)
        params = sum(u.param_bytes for u in self.units[s.first:s.last + 1])
        start = self.p.s3_latency_s + self.p.warm_start_s + params / self.p.s3_bandwidth_bytes_per_s
        out, k = [], s.first
        while k <= s.last:
            seg = self.units[k].segment
            end = k
            while end + 1 <= s.last and self.units[end + 1].segment == seg:
                end += 1
            t = start + self._in_time(k, tokens) + self._out_time(end, tokens)
            t += sum(self.units[i].seconds(tokens, v) for i in range(k, end + 1))
            out.append(t)
            k = end + 1
        return out

    def slice_cost(self, s: Slice) -> tuple:
        """(dollars, billed GB-s, invocations) for all shards of a slice."""
        gb_s, n = 0.0, 0
        for t in self.invocations(s):
            gb_s += s.eta * billed_gb_seconds(t, s.memory_mb, self.p.billing_granularity_s)
            n += s.eta
        return lambda_usd(gb_s, n, self.p.price_per_gb_s, self.p.price_per_request), gb_s, n

    def latency(self, slices: list) -> float:
        """End-to-end seconds of the dense part: the slices run one after another in each segment."""
        total = 0.0
        for s in slices:
            total += sum(self.invocations(s))
        return total

    def cost(self, slices: list) -> float:
        return sum(self.slice_cost(s)[0] for s in slices)

    def report(self, slices: list, limit: float, merged: int, units: int, steps=()) -> PartitionResult:
        reports = []
        for s in slices:
            cost, gb_s, n = self.slice_cost(s)
            us = self.units[s.first:s.last + 1]
            reports.append(SliceReport([n for u in us for n in u.names], sorted({u.segment for u in us}), s.memory_mb,
                                       s.eta, sum(u.param_bytes for u in us), n, gb_s, cost, sum(self.invocations(s))))
        return PartitionResult(reports, self.cost(slices), self.latency(slices), limit, merged, units, list(steps))


def simplify(units: list, tokens: int, threshold: float = MERGE_THRESHOLD) -> list:
    """MOPAR step 1: merge neighbours of a segment whose memory differs by <= threshold."""
    out = list(units)
    changed = True
    while changed:
        changed = False
        for k in range(len(out) - 1):
            a, b = out[k], out[k + 1]
            ma, mb = a.own_memory_bytes(tokens), b.own_memory_bytes(tokens)
            if a.segment == b.segment and abs(ma - mb) <= threshold * max(ma, 1e-9):
                out[k:k + 2] = [merge(a, b)]
                changed = True
                break
    return out


def merge(a: DenseUnit, b: DenseUnit) -> DenseUnit:
    return DenseUnit(a.names + b.names, a.segment, a.param_bytes + b.param_bytes,
                     max(a.peak_bytes_per_token, b.peak_bytes_per_token), b.out_bytes_per_token, a.in_bytes_per_token,
                     tuple(x + y for x, y in zip(a.s_per_token, b.s_per_token)), a.threads)


def group_units(units: list, key, param_bytes=None) -> list:
    """Merge neighbouring units of one segment with the same `key(name)`: the places a runtime
    cannot cut between (the Lambda runtime cuts only between decoder blocks). `param_bytes(unit,
    first_of_segment)`, when given, replaces a group's bytes with what its function will hold."""
    out = []
    for u in units:
        if out and out[-1].segment == u.segment and key(out[-1].names[-1]) == key(u.names[0]):
            out[-1] = merge(out[-1], u)
        else:
            out.append(u)
    if param_bytes is not None:
        out = [replace(u, param_bytes=int(param_bytes(u, k == 0 or out[k - 1].segment != u.segment)))
               for k, u in enumerate(out)]
    return out


def vertical_split(model: CostModel) -> list:
    """MOPAR step 2: exact DP over contiguous slices (minimum memory, eta 1) for least cost."""
    n = len(model.units)
    best = [0.0] + [math.inf] * n
    arg = [0] * (n + 1)
    for j in range(1, n + 1):
        for i in range(1, j + 1):
            mem = model.min_memory(i - 1, j - 1)
            if mem is None or best[i - 1] == math.inf:
                continue
            c = best[i - 1] + model.slice_cost(Slice(i - 1, j - 1, mem))[0]
            if c < best[j] - 1e-15:
                best[j], arg[j] = c, i
    if best[n] == math.inf:
        worst = max(model.need_mb(k, k) for k in range(n))
        raise UserError(f"a dense unit needs {worst:.0f} MB, more than the largest memory option "
                        f"({model.options[-1]} MB); raise memory_options_mb in the platform file")
    slices, j = [], n
    while j > 0:
        i = arg[j]
        slices.append(Slice(i - 1, j - 1, model.min_memory(i - 1, j - 1)))
        j = i - 1
    return slices[::-1]


def parallelism_search(model: CostModel, slices: list, limit: float, max_eta: int) -> tuple:
    """MOPAR step 3 under the latency limit: cheapest latency per dollar, one step at a time."""
    slices, steps = list(slices), []
    while model.latency(slices) > limit + 1e-12:
        lat, cost = model.latency(slices), model.cost(slices)
        best = None
        for k, s in enumerate(slices):
            moves = []
            if s.eta < max_eta:
                mem = model.min_memory(s.first, s.last, s.eta + 1)
                if mem is not None:
                    moves.append(replace(s, eta=s.eta + 1, memory_mb=max(mem, s.memory_mb)))
            bigger = [m for m in model.options if m > s.memory_mb]
            if bigger:
                moves.append(replace(s, memory_mb=bigger[0]))
            for mv in moves:
                trial = slices[:k] + [mv] + slices[k + 1:]
                gain = lat - model.latency(trial)
                if gain <= 1e-12:
                    continue
                score = (model.cost(trial) - cost) / gain
                if best is None or score < best[0] - 1e-15:
                    best = (score, k, mv)
        if best is None:
            raise UserError(f"the dense stages cannot meet the latency limit {limit:.3f} s (best {lat:.3f} s at "
                            f"{max_eta} shards and the largest memory); raise the SLO or the memory options")
        _, k, mv = best
        slices[k] = mv
        steps.append({"slice": k, "eta": mv.eta, "memory_mb": mv.memory_mb})
    return slices, steps


def single_function(model: CostModel) -> list:
    mem = model.min_memory(0, len(model.units) - 1)
    if mem is None:
        raise UserError("the dense stages together exceed the largest memory option")
    return [Slice(0, len(model.units) - 1, mem)]


def hypad(units: list, platform: Platform, tokens: int, *, latency_limit_s: float | None = None,
          memory_options=None, max_eta: int | None = None, threshold: float = MERGE_THRESHOLD,
          accounting: str = "lambda") -> PartitionResult:
    """Partition the dense unit chain; the latency limit defaults to the single function's latency."""
    if not units:
        raise UserError("the model has no dense stage to partition")
    merged = simplify(units, tokens, threshold)
    model = CostModel(merged, platform, tokens, memory_options, accounting=accounting)
    if latency_limit_s is None:
        full = CostModel(units, platform, tokens, memory_options, accounting=accounting)
        latency_limit_s = full.latency(single_function(full))
    slices = vertical_split(model)
    slices, steps = parallelism_search(model, slices, latency_limit_s,
                                       platform.max_replicas if max_eta is None else max_eta)
    return model.report(slices, latency_limit_s, len(merged), len(units), steps)


def evaluate(units: list, platform: Platform, tokens: int, groups: list, memory_options=None,
             memory_mb: int | None = None, accounting: str = "lambda") -> PartitionResult:
    """A fixed partition (lists of consecutive unit indices) at minimum (or the given) memory: the baselines."""
    model = CostModel(units, platform, tokens, memory_options, accounting=accounting)
    slices = []
    for g in groups:
        mem = memory_mb or model.min_memory(g[0], g[-1])
        if mem is None:
            raise UserError(f"units {g[0]}..{g[-1]} exceed the largest memory option")
        slices.append(Slice(g[0], g[-1], int(mem)))
    lat = model.latency(slices)
    result = model.report(slices, lat, len(units), len(units))
    result.fits = all(s.memory_mb >= model.need_mb(s.first, s.last, s.eta) - 1e-9 for s in slices)
    return result


def compute_floor(units: list, platform: Platform, tokens: int) -> float:
    """Dollars per request that no partition, memory, eta or slicing can undercut (Lambda accounting).

    Why: it caps what partitioning can save. Proof: an invocation of M MB bills M/1024 GB-s per
    second, with v = vcpus(M) <= M / mb_per_vcpu and, for any M the slice fits in, M >= runtime +
    the unit's weights; unit u at t threads takes s_t n max(1, t/v) s on n tokens, so it bills
    >= s_t n max(M, t mb_per_vcpu) MB-s >= s_t n max(runtime + params_u, t mb_per_vcpu); shards
    cover >= `tokens` tokens, waits (S3, warm start, weight loading) are >= 0, billing rounds up
    (less a 1e-9-granule float tolerance), each segment costs >= 1 request fee; merging units (min
    of a sum >= sum of mins) only adds.
    """
    mb_s = 0.0
    for u in units:
        base = platform.runtime_memory_mb + u.param_bytes / MB
        mb_s += min(s * tokens * max(base, t * platform.mb_per_vcpu) for s, t in zip(u.s_per_token, u.threads))
    segments = len({u.segment for u in units})
    return lambda_usd(mb_s / MB_PER_GB, segments, platform.price_per_gb_s, platform.price_per_request)


def fine_memory_options(platform: Platform, low: int = 128, high: int = 10240) -> list:
    """Lambda's own configurable sizes: every MB from 128 to 10,240 (MOPAR sizes per MB)."""
    return list(range(low, high + 1))


def units_from_profile(ir, profile, tokens: int, module=None, seed: int = 0) -> list:
    """Dense units of a model with per-token time and memory predicted by the profile's XGBoost models."""
    return units_on_grid(ir, profile, [tokens], module, seed)[tokens]


def units_on_grid(ir, profile, grid, module=None, seed: int = 0) -> dict:
    """{tokens: dense units at that request size} for every token count of `grid`, from one fit of
    the profile's XGBoost predictors (the request cost model prices steps of any size)."""
    from moeplan.passes.analysis.profile.predictor import features, fit_predictors
    from moeplan.passes.analysis.profile.operators import model_units
    from moeplan.core.ir import dtype_bytes

    rows = profile.rows
    X = features([r["flops_per_token"] for r in rows], [r["param_bytes"] for r in rows], [r["tokens"] for r in rows],
                 [r["threads"] for r in rows], [r["kind"] == "expert" for r in rows])
    preds = fit_predictors(X, np.array([r["seconds"] for r in rows]), np.array([r["peak_bytes"] for r in rows]),
                           seed=seed)
    moe = {f"layer{s.moe_index}": s.moe_index for s in ir.moe_stages}
    last = len(ir.moe_stages)
    width = int(ir.hidden_size * dtype_bytes(ir.dtype))
    kinds = {s.name: s.kind for s in ir.stages}
    top_k = {f"{s.name}.router": s.top_k for s in ir.moe_stages}
    dense = [u for u in model_units(ir, module) if u.kind == "dense"]
    out = {}
    for tokens in grid:
        units = []
        for u in dense:
            segment = 0 if u.group == "head" else last if u.group == "tail" else moe[u.group]
            secs = [float(preds.time(features(u.flops_per_token, u.param_bytes, tokens, t, False))[0]) / tokens
                    for t in profile.threads]
            peak = float(preds.memory(features(u.flops_per_token, u.param_bytes, tokens, 1, False))[0]) / tokens
            kind = kinds.get(u.name, "router")
            # what the bundle's state file carries per token: ids, positions, sequence (24 B), the residual
            # stream and the last norm's output (2 x width), routers add ids + weights, the head logits
            in_b = 24 if kind == "embedding" else 24 + 2 * width
            out_b = 24 + 2 * width + (ir.vocab_size * 4 if kind == "head" else 16 * top_k.get(u.name, 0))
            units.append(DenseUnit((u.name,), segment, int(u.param_bytes), peak, out_b, in_b, tuple(secs),
                                   tuple(int(t) for t in profile.threads)))
        out[tokens] = units
    return out
