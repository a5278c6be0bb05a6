"""The serving prediction of one engine deployment: (model, deployment, workload, routing) -> TPOT, TTFT,
throughput and memory per GPU, each op's price with its source. This is the engine pricing's public API:
the engine targets' serving pass (`serving_pass.py`) and the SLO search call `predict_serving`.

    model = engine_model(config, name)                       # model_shape.py: from the HF config.json
    dep = Deployment("sglang", "h100-sxm", nodes=1, gpus_per_node=8, attention_tp=8, attention_dp=1, moe_ep=8)
    routing = Routing.placed(trace, placement)               # or Routing.balanced()
    p = predict_serving(model, dep, "64x1024+128", routing)  # p.tpot_s, p.ttft_s, p.fits, p.to_json()

`Routing` says how a step's tokens reach the experts' ranks: `balanced` (every EP rank gets B x top_k / EP
rows, as AIConfigurator assumes), or a real trace under a placement (`rank_rows.py`: the busiest rank's rows
by the runtime's replica rule, so a skewed trace with a poor placement paces the step at its hot rank).
What each figure means, and the engine rules behind it: `serving.py` (TPOT quadrature, chunked-prefill
TTFT), `memory.py` (weights, KV, the engine's reserve).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from moeplan.core.errors import UserError
from moeplan.passes.cost.engine import rank_rows, serving
from moeplan.passes.cost.engine.pricing import Pricer

BALANCED, TRACE = "balanced", "trace"


class Routing:
    """How a step's tokens reach the experts' EP ranks: balanced, or a trace under a placement.

    `load(num_moe_layers, tokens)` is the busiest rank's MoE load (`rank_rows.RankLoad`) for a step of
    `tokens` tokens over all attention replicas; computed once per step size (a Routing is reused
    across the deployments an SLO search prices with the same placement)."""

    def __init__(self, trace=None, table=None):
        if (trace is None) != (table is None):
            raise ValueError("Routing needs both a trace and an expert table, or neither (balanced)")
        self.trace, self.table = trace, table
        self._loads: dict = {}
        self._whole = None  # rows per rank over the whole trace, for steps of at least its tokens

    @classmethod
    def balanced(cls) -> Routing:
        return cls()

    @classmethod
    def placed(cls, trace, placement) -> Routing:
        """A trace (`passes/analysis/trace/format.py: Trace`) under a placement: a `Placement`
        (`passes/optimize/placement/schema.py`) or the runtime's `ExpertTable` built from one."""
        table = placement.expert_table() if hasattr(placement, "expert_table") else placement
        return cls(trace, table)

    @property
    def kind(self) -> str:
        return BALANCED if self.table is None else TRACE

    @property
    def ranks(self) -> int | None:
        """EP ranks of the placement (None: balanced, any EP size)."""
        return None if self.table is None else int(self.table.hosts.shape[2])

    def load(self, num_moe_layers: int, tokens: int) -> rank_rows.RankLoad:
        key = (int(num_moe_layers), max(int(tokens), 1))
        if key not in self._loads:
            if self.table is None:
                self._loads[key] = rank_rows.balanced(*key)
            else:
                if key[1] >= self.trace.num_tokens and self._whole is None and not self.trace.loads_only:
                    self._whole = rank_rows.whole_trace_rows(self.trace, self.table)
                self._loads[key] = rank_rows.rank_load(self.trace, self.table, key[1], whole=self._whole)
        return self._loads[key]


@dataclass(frozen=True)
class ServingPrediction:
    """What a deployment does with a workload (units in the names: seconds, bytes, tokens per second).

    `op_prices`: the decode step at the middle context, op by op ({op, seconds, source}); `sources`:
    seconds of that step per price source (measured table, roofline, roofline scaled at the grid edge;
    plan.json `price_sources`: [{source, seconds}] by source)."""

    workload: str
    routing: str
    tpot_s: float
    ttft_s: float
    prefill_s: float
    output_tokens_per_s: float
    running_requests: int
    max_over_mean_load: float
    memory_per_gpu_bytes: int
    fits: bool
    memory: dict
    layout: dict
    engine_limits: dict
    op_prices: tuple = field(default=())
    sources: dict = field(default_factory=dict)

    @property
    def output_tokens_per_s_per_gpu(self) -> float:
        return self.output_tokens_per_s / self.layout["gpus"]

    def to_json(self) -> dict:
        """plan.json's `predicted.serving` (keys in a fixed order; the plan rounds the floats)."""
        return {"workload": self.workload, "routing": self.routing, "tpot_s": self.tpot_s, "ttft_s": self.ttft_s,
                "prefill_s": self.prefill_s, "output_tokens_per_s": self.output_tokens_per_s,
                "output_tokens_per_s_per_gpu": self.output_tokens_per_s_per_gpu,
                "running_requests": self.running_requests, "max_over_mean_load": self.max_over_mean_load,
                "memory_per_gpu_bytes": self.memory_per_gpu_bytes, "fits": self.fits, "memory": dict(self.memory),
                "layout": dict(self.layout), "engine_limits": dict(self.engine_limits),
                "price_sources": [{"source": k, "seconds": v} for k, v in sorted(self.sources.items())],
                "op_prices": [dict(r) for r in self.op_prices]}


def predict_serving(model, deployment, workload, routing: Routing | None = None, profile=None,
                    use_measured: bool = True) -> ServingPrediction:
    """The serving prediction of `workload` (a `serving.Workload` or its text `RxP+G`) on `deployment`
    (`deployment.py: Deployment`) of `model` (`model_shape.py: EngineModel`), under `routing` (default
    balanced). `profile`: the hardware profile (`core/hardware.py`; default the built-in profile the
    deployment names); `use_measured=False` prices every op by the roofline even where
    aiconfigurator-core's tables would."""
    from moeplan.core.hardware import load_hardware

    if isinstance(workload, str):
        workload = serving.parse_workload(workload)
    routing = routing or Routing.balanced()
    if routing.ranks is not None and routing.ranks != deployment.moe_ep:
        raise UserError(f"the placement spreads experts over {routing.ranks} ranks and the deployment runs EP "
                        f"{deployment.moe_ep}; place the experts over the deployment's EP ranks")
    profile = profile or load_hardware(deployment.hardware)
    pricer = Pricer(deployment, profile, use_measured=use_measured)
    out = serving.predict(model, deployment, pricer, profile, workload,
                          lambda tokens: routing.load(model.num_moe_layers, tokens))
    return ServingPrediction(routing=routing.kind, **out)
