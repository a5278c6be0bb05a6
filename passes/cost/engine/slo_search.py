"""The SLO search: the fewest GPUs, and on them the layout, that serve a workload within a latency
objective, priced by the engine pricing's own predictor (`prediction.py: predict_serving`).

The space (one `Candidate` each): GPU count (1, 2, 4, ... up to a node, then whole nodes doubling up to
`max_gpus`), attention tensor parallel or data parallel (the replica counts the engine can run:
`attention_choices`), EP size (every GPU one EP rank unless `all_ep_sizes`: then also MoE tensor
parallel inside each expert; an EP size that does not divide the experts is skipped), redundant expert slots (0, or one or two per EP rank) and max running
requests (the workload's R, R/2, R/4: fewer decode at once, faster, the rest queue).

How it stays fast (a DeepSeek-V3 search in well under the 5 minutes issue 38 allows):
1. GPU counts are tried in increasing order and the search stops growing at the first count where a
   deployment meets the SLO (`beyond` more counts are screened for the frontier only).
2. Memory first: a candidate whose weights + KV + the engine's reserve do not fit one GPU
   (`memory.py`, no step priced) is dropped before any pricing; counts below the memory floor cost
   only that arithmetic.
3. Screening uses the cheap load model: balanced routing (every EP rank gets B x top_k / EP rows), with
   no redundant slots (under balanced routing replicas only add memory).
4. Only the `finalists` best screened candidates of a count that meet the SLO are priced under the real
   placement of the trace (`route(candidate)`: the placement the plan would write, by the caller), each
   with every redundant-slot choice; the choice is made among those. If no finalist meets the SLO under
   its placement, the search goes on to the next count.

The choice (`choose`): the fewest GPUs whose finalist meets the SLO and fits; among them the highest
output tokens per second per GPU, within 1 % counting as a tie that fewer redundant slots, then more
running requests, then the layout's order (TP before DP) decide, so the same inputs give the same choice. Nothing meets it up to `max_gpus`: one line naming the closest.

With fewer running requests than R, the requests beyond them wait: `ttft_s` of a candidate then adds
the mean wait of the later waves, each wave a whole generation (new tokens x TPOT) plus its own prefill
(`queued_ttft`); the engine pricing's own TTFT assumes everyone is admitted at once.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from moeplan.core.errors import UserError
from moeplan.passes.cost.engine import memory as M
from moeplan.passes.cost.engine.deployment import Deployment
from moeplan.passes.cost.engine.prediction import Routing, predict_serving
from moeplan.passes.cost.engine.serving import Workload, parse_workload

DEFAULT_MAX_GPUS = 64
FINALISTS = 3
REDUNDANT_PER_RANK = (0, 1, 2)    # redundant slots per EP rank tried for finalists
RUNNING_SHARES = (1, 2, 4)        # max running requests: R / share
TIE = 0.01                        # tokens/s per GPU this close to the best count as a tie


@dataclass(frozen=True, order=True)
class Candidate:
    """One deployment the search may write (the layout fields of `deployment.py: Deployment`)."""

    gpus: int
    nodes: int
    gpus_per_node: int
    attention_dp: int
    moe_ep: int
    redundant_experts: int
    max_running_requests: int

    @property
    def attention(self) -> str:
        return "tp" if self.attention_dp == 1 else ("dp" if self.attention_dp == self.gpus else
                                                    f"tp{self.gpus // self.attention_dp}xdp{self.attention_dp}")

    def label(self) -> str:
        """e.g. '16 GPUs (2x8), attention dp16, ep16, 32 redundant, 512 running'."""
        return (f"{self.gpus} GPU{'s' if self.gpus > 1 else ''} ({self.nodes}x{self.gpus_per_node}), attention "
                f"{self.attention}, ep{self.moe_ep}, {self.redundant_experts} redundant, {self.max_running_requests} running")

    def deployment(self, engine: str, hardware: str, kv_cache_dtype: str | None = None) -> Deployment:
        return Deployment(engine, hardware, self.nodes, self.gpus_per_node, self.gpus // self.attention_dp,
                          self.attention_dp, self.moe_ep, self.gpus // self.moe_ep, self.redundant_experts,
                          self.max_running_requests, kv_cache_dtype)

    def to_json(self) -> dict:
        return {"gpus": self.gpus, "nodes": self.nodes, "gpus_per_node": self.gpus_per_node,
                "attention_tp": self.gpus // self.attention_dp, "attention_dp": self.attention_dp,
                "moe_ep": self.moe_ep, "moe_tp": self.gpus // self.moe_ep,
                "redundant_experts": self.redundant_experts, "max_running_requests": self.max_running_requests}


@dataclass(frozen=True)
class Priced:
    """A candidate's figures: `routing` 'balanced' (screening) or 'trace' (a finalist under its placement);
    `fits` False: memory alone was computed (tpot_s, ttft_s None)."""

    candidate: Candidate
    routing: str
    fits: bool
    memory_per_gpu_bytes: int
    tpot_s: float | None = None
    ttft_s: float | None = None
    output_tokens_per_s_per_gpu: float | None = None
    max_over_mean_load: float | None = None
    meets: bool = False

    def shortfall(self, slo) -> float:
        """The largest ratio of a figure to its limit (1 or less: met)."""
        ratios = [value / limit for value, limit in ((self.tpot_s, slo.tpot_s), (self.ttft_s, slo.ttft_s))
                  if limit is not None]
        return max(ratios) if ratios else 0.0

    def rank_key(self) -> tuple:
        """Better first: fewer GPUs, more tokens/s per GPU, fewer redundant slots, then the layout's order."""
        c = self.candidate
        return (c.gpus, -(self.output_tokens_per_s_per_gpu or 0.0), c.redundant_experts, c)

    def text(self) -> str:
        if not self.fits:
            return f"{self.candidate.label()}: does not fit ({self.memory_per_gpu_bytes / 2**30:.1f} GiB per GPU)"
        return (f"{self.candidate.label()}: TPOT {self.tpot_s * 1e3:.2f} ms, TTFT {self.ttft_s:.3f} s, "
                f"{self.output_tokens_per_s_per_gpu:.0f} output tokens/s per GPU ({self.routing})")

    def to_json(self) -> dict:
        return {**self.candidate.to_json(), "routing": self.routing, "fits": self.fits,
                "memory_per_gpu_bytes": self.memory_per_gpu_bytes, "tpot_s": self.tpot_s, "ttft_s": self.ttft_s,
                "output_tokens_per_s_per_gpu": self.output_tokens_per_s_per_gpu,
                "max_over_mean_load": self.max_over_mean_load, "meets_slo": self.meets}


@dataclass(frozen=True)
class SearchResult:
    """What the search found: the chosen candidate (priced under its placement where a trace was given)
    and its prediction, every candidate priced (screened and final), the frontier and why."""

    slo: object
    workload: Workload
    engine: str
    hardware: str
    chosen: Priced
    prediction: object
    screened: tuple
    finalists: tuple
    memory_floor_gpus: int
    why: str
    counts_tried: tuple = field(default=())

    def frontier(self) -> list:
        """The priced deployments no other beats on both TPOT and output tokens/s per GPU, by TPOT."""
        points = [p for p in self.screened + self.finalists if p.fits]
        best = {}
        for p in points:  # the best point per (GPU count, layout) under each routing
            key = (p.candidate.gpus, p.candidate.attention, p.candidate.moe_ep, p.candidate.max_running_requests,
                   p.candidate.redundant_experts, p.routing)
            best[key] = p
        out = [p for p in best.values() if not any(
            q.tpot_s <= p.tpot_s and q.output_tokens_per_s_per_gpu >= p.output_tokens_per_s_per_gpu
            and (q.tpot_s, -q.output_tokens_per_s_per_gpu) != (p.tpot_s, -p.output_tokens_per_s_per_gpu)
            for q in best.values())]
        return sorted(out, key=lambda p: (p.tpot_s, p.candidate))

    def to_json(self) -> dict:
        """plan.json's `predicted.slo_search`."""
        return {"slo": str(self.slo), "workload": str(self.workload), "engine": self.engine, "hardware": self.hardware,
                "chosen": self.chosen.to_json(), "why": self.why, "memory_floor_gpus": self.memory_floor_gpus,
                "gpu_counts_tried": list(self.counts_tried),
                "frontier": [p.to_json() for p in self.frontier()],
                "finalists": [p.to_json() for p in self.finalists],
                "screened": [p.to_json() for p in self.screened]}


def gpu_counts(gpus_per_node: int, max_gpus: int) -> list:
    """[(gpus, nodes, gpus per node)]: 1, 2, 4, ... within one node, then 2, 4, 8, ... whole nodes."""
    out, n = [], 1
    while n < gpus_per_node and n <= max_gpus:
        out.append((n, 1, n))
        n *= 2
    nodes = 1
    while nodes * gpus_per_node <= max_gpus:
        out.append((nodes * gpus_per_node, nodes, gpus_per_node))
        nodes *= 2
    return out


def _powers_dividing(n: int) -> list:
    return [d for d in (2 ** i for i in range(n.bit_length())) if n % d == 0]


def attention_choices(engine: str, gpus: int, gpus_per_node: int) -> list:
    """Attention replica counts (data-parallel ranks) the engine runs on `gpus`: sglang any power of two
    dividing them (`--dp-size`); trtllm 1 or all (`enable_attention_dp`); vllm those whose replicas of
    tp = gpus / dp GPUs sit whole inside a node."""
    choices = _powers_dividing(gpus)
    if engine == "trtllm":
        return sorted({1, gpus})
    if engine == "vllm":
        return [dp for dp in choices if gpus // dp <= gpus_per_node and gpus_per_node % (gpus // dp) == 0]
    return choices


def running_choices(requests: int, attention_dp: int) -> list:
    """Max running requests over the deployment: R, R/2, R/4, at least one per attention replica."""
    return sorted({max(requests // share, attention_dp) for share in RUNNING_SHARES}, reverse=True)


def queued_ttft(ttft_s: float, prefill_s: float, tpot_s: float, workload: Workload, running: int) -> float:
    """Mean TTFT over the R requests when only `running` decode at once: wave w waits w whole generations
    (each new_tokens x TPOT plus its prefill) before its own prefill (module docstring)."""
    waves = math.ceil(workload.requests / running)
    if waves <= 1:
        return ttft_s
    wait = (waves - 1) / 2 * (workload.new_tokens * tpot_s + prefill_s / waves)
    return ttft_s + wait


@dataclass(frozen=True)
class Fixed:
    """Dimensions the command fixed (None: searched): `attention` 'tp' or 'dp' (else 'auto'),
    `redundant_experts` slots over all EP ranks, `max_running_requests` over the deployment."""

    attention: str = "auto"
    redundant_experts: int | None = None
    max_running_requests: int | None = None

    def attention_dps(self, engine: str, gpus: int, gpus_per_node: int) -> list:
        choices = attention_choices(engine, gpus, gpus_per_node)
        wanted = {"tp": [1], "dp": [gpus]}.get(self.attention, choices)
        return [dp for dp in choices if dp in wanted]

    def running(self, requests: int, attention_dp: int) -> list:
        if self.max_running_requests is None:
            return running_choices(requests, attention_dp)
        return [self.max_running_requests] if self.max_running_requests >= attention_dp else []

    def redundant(self, moe_ep: int) -> list:
        if self.redundant_experts is None:
            return [per_rank * moe_ep for per_rank in REDUNDANT_PER_RANK]
        return [self.redundant_experts] if self.redundant_experts % moe_ep == 0 else []


def screen_candidates(engine, gpus, nodes, gpn, workload, all_ep_sizes, num_experts, fixed: Fixed = Fixed()) -> list:
    """A GPU count's candidates for screening: with the fewest redundant slots allowed. An EP size must
    divide the experts (the engines give every rank as many slots, and redundant slots come whole per rank)."""
    eps = [ep for ep in (_powers_dividing(gpus) if all_ep_sizes else [gpus]) if num_experts % ep == 0]
    out = []
    for dp in fixed.attention_dps(engine, gpus, gpn):
        for ep in eps:
            redundant = fixed.redundant(ep)[:1]
            for running in fixed.running(workload.requests, dp):
                out.extend(Candidate(gpus, nodes, gpn, dp, ep, r, running) for r in redundant)
    return out


class CandidatePricer:
    """Prices candidates with `predict_serving` (the plan's own predictor) and memory alone first."""

    def __init__(self, model, engine, hardware, profile, workload, slo, kv_cache_dtype, use_measured):
        self.model, self.engine, self.hardware, self.profile = model, engine, hardware, profile
        self.workload, self.slo, self.kv, self.use_measured = workload, slo, kv_cache_dtype, use_measured
        self.predictions = {}

    def memory(self, c: Candidate) -> dict:
        dep = c.deployment(self.engine, self.hardware, self.kv)
        running = min(self.workload.requests, c.max_running_requests)
        return M.memory_per_gpu(self.model, dep, self.profile.device_memory_bytes, running,
                                self.workload.prompt + self.workload.new_tokens)

    def price(self, c: Candidate, routing: Routing | None) -> Priced:
        memory = self.memory(c)
        kind = "balanced" if routing is None else "trace"
        if not memory["fits"]:
            return Priced(c, kind, False, memory["memory_per_gpu_bytes"])
        p = predict_serving(self.model, c.deployment(self.engine, self.hardware, self.kv), self.workload,
                            routing, profile=self.profile, use_measured=self.use_measured)
        self.predictions[(c, kind)] = p
        ttft = queued_ttft(p.ttft_s, p.prefill_s, p.tpot_s, self.workload, p.running_requests)
        return Priced(c, kind, True, p.memory_per_gpu_bytes, p.tpot_s, ttft, p.output_tokens_per_s_per_gpu,
                      p.max_over_mean_load, self.slo.met_by(p.tpot_s, ttft))


def search(model, engine: str, hardware: str, profile, workload, slo, gpus_per_node: int = 8,
           max_gpus: int = DEFAULT_MAX_GPUS, route=None, finalists: int = FINALISTS, beyond: int = 1,
           all_ep_sizes: bool = False, fixed: Fixed = Fixed(), kv_cache_dtype: str | None = None,
           use_measured: bool = True, progress=lambda message: None) -> SearchResult:
    """The search (module docstring). `model`: `model_shape.EngineModel`; `profile`: the HardwareProfile
    named `hardware`; `workload`: `RxP+G` or a Workload; `slo`: `core/slo.py: Slo` (tpot and/or ttft);
    `route(candidate) -> Routing`: the real placement of the trace for a finalist (None: balanced only,
    the finalists are the screened ones); `fixed`: the dimensions the command fixed. A one-line UserError
    when nothing up to `max_gpus` meets it."""
    if isinstance(workload, str):
        workload = parse_workload(workload)
    slo = slo.for_engine(engine)
    pricer = CandidatePricer(model, engine, hardware, profile, workload, slo, kv_cache_dtype, use_measured)
    screened, final, tried, floor, chosen, stop_at = [], [], [], None, None, None
    for gpus, nodes, gpn in gpu_counts(gpus_per_node, max_gpus):
        if stop_at is not None and len(tried) >= stop_at:
            break
        candidates = screen_candidates(engine, gpus, nodes, gpn, workload, all_ep_sizes, model.num_experts, fixed)
        fitting = [c for c in candidates if pricer.memory(c)["fits"]]
        if not fitting:
            if candidates:
                screened.append(min((pricer.price(c, None) for c in candidates), key=lambda p: p.memory_per_gpu_bytes))
            continue
        floor = gpus if floor is None else floor
        tried.append(gpus)
        progress(f"SLO search: pricing {len(fitting)} deployments on {gpus} GPUs")
        priced = [pricer.price(c, None) for c in fitting]
        screened.extend(priced)
        if chosen is not None:
            continue  # beyond the choice: screened for the frontier only
        meeting = sorted((p for p in priced if p.meets), key=Priced.rank_key)[:finalists]
        if not meeting:
            continue
        final_here = _finalists(pricer, meeting, route, fixed, progress)
        final.extend(final_here)
        winners = [p for p in final_here if p.meets]
        if winners:
            chosen = choose(winners)
            stop_at = len(tried) + beyond
    if chosen is None:
        raise UserError(_refusal(slo, workload, hardware, max_gpus, screened + final, floor))
    result = SearchResult(slo, workload, engine, hardware, chosen, pricer.predictions[(chosen.candidate, chosen.routing)],
                          tuple(screened), tuple(final), floor, "", tuple(tried))
    return replace(result, why=_why(result))


def choose(meeting: list) -> Priced:
    """The best of the deployments that meet the SLO: the fewest GPUs; among them the most output tokens/s
    per GPU, where those within TIE (the pricing's resolution) of the best count as equal and the fewer
    redundant slots, then the more running requests, then the layout's order decide."""
    fewest = min(p.candidate.gpus for p in meeting)
    here = [p for p in meeting if p.candidate.gpus == fewest]
    best = max(p.output_tokens_per_s_per_gpu for p in here)
    near = [p for p in here if p.output_tokens_per_s_per_gpu >= best * (1 - TIE)]
    return min(near, key=lambda p: (p.candidate.redundant_experts, -p.candidate.max_running_requests,
                                    -p.output_tokens_per_s_per_gpu, p.candidate))


def _finalists(pricer, meeting, route, fixed, progress) -> list:
    """The screened candidates that met the SLO, priced under the real placement with each redundant-slot
    choice that fits (balanced again where no trace is given)."""
    if route is None:
        return list(meeting)
    out = []
    for screened in meeting:
        for redundant in fixed.redundant(screened.candidate.moe_ep):
            c = replace(screened.candidate, redundant_experts=redundant)
            if not pricer.memory(c)["fits"]:
                continue
            progress(f"SLO search: placing the trace for {c.label()}")
            out.append(pricer.price(c, route(c)))
    return out


def _refusal(slo, workload, hardware, max_gpus, priced, floor) -> str:
    fitting = [p for p in priced if p.fits]
    if not fitting:
        big = min(priced, key=lambda p: p.memory_per_gpu_bytes) if priced else None
        need = f"; the smallest needs {big.memory_per_gpu_bytes / 2**30:.1f} GiB per GPU" if big else ""
        return (f"no deployment up to {max_gpus} GPUs holds the model and {workload} in {hardware} memory{need}; "
                f"give a larger --max-gpus or fewer requests in --workload")
    best = min(fitting, key=lambda p: (p.shortfall(slo), p.rank_key()))
    return (f"no deployment up to {max_gpus} {hardware} GPUs meets --slo {slo} for {workload}; the best is "
            f"{best.text()}; give a larger --max-gpus, fewer requests in --workload or a looser --slo")


def _why(result: SearchResult) -> str:
    """One paragraph: why this count, why this layout."""
    c, slo = result.chosen.candidate, result.slo
    smaller = [p for p in result.screened + result.finalists if p.candidate.gpus < c.gpus]
    parts = []
    if result.memory_floor_gpus and result.memory_floor_gpus > 1:
        parts.append(f"weights + KV + the engine's reserve fit from {result.memory_floor_gpus} GPUs")
    fitting_smaller = [p for p in smaller if p.fits]
    if fitting_smaller:
        best = min(fitting_smaller, key=lambda p: (p.shortfall(slo), p.rank_key()))
        parts.append(f"no deployment on fewer GPUs meets {slo} (closest: {best.text()})")
    same = sorted((p for p in result.finalists if p.candidate.gpus == c.gpus and p.meets), key=Priced.rank_key)
    runner = next((p for p in same if p.candidate != c), None)
    parts.append(f"{c.gpus} GPU{'s' if c.gpus > 1 else ''} is the fewest that meets {slo}")
    if runner is not None:
        tie = runner.output_tokens_per_s_per_gpu >= result.chosen.output_tokens_per_s_per_gpu * (1 - TIE)
        parts.append(f"among those meeting it there, {result.chosen.output_tokens_per_s_per_gpu:.0f} output tokens/s "
                     f"per GPU against {runner.output_tokens_per_s_per_gpu:.0f} for the next best ({runner.candidate.label()})"
                     + (f": within {TIE:.0%}, a tie that fewer redundant slots, then more running requests, decide" if tie else ""))
    parts.append(f"priced under {'the real placement of the trace' if result.chosen.routing == 'trace' else 'balanced routing'}")
    return "; ".join(parts)
