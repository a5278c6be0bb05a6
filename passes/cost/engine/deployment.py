"""A deployment as the engine runs it: GPUs, the attention and MoE parallel layout, and the engine.

Attention runs `attention_tp`-way tensor parallel in each of `attention_dp` data-parallel replicas
(SGLang `--tp-size N --enable-dp-attention --dp-size D` gives tp N / D in D replicas); the MoE layers
run `moe_ep`-way expert parallel x `moe_tp`-way tensor parallel over the same GPUs. Tokens meet the
experts in one of two ways (SGLang 0.5.23 `--moe-a2a-backend`): within a node the MoE input is made
whole on every rank (an all-reduce after TP attention, an all-gather after DP attention) and each rank
runs its own experts over it; across nodes DeepEP's all-to-all sends each token to its experts' ranks
only (low-latency kernels for decode, normal kernels for prefill), as AIConfigurator 0.12.0 assumes
for expert parallelism wider than a node (aiconfigurator/sdk/moe_comm_resolver.py).
"""
from __future__ import annotations

from dataclasses import dataclass

from moeplan.core.errors import UserError

ENGINES = ("sglang", "vllm", "trtllm")
# aiconfigurator-core 0.12.0's database of each engine: the version whose kernels it measured ("current" slot)
DATABASE_VERSIONS = {"sglang": "0.5.14", "vllm": "0.24.0", "trtllm": "1.3.0rc20"}
# moeplan hardware profile -> aiconfigurator-core system; other profiles are priced by the roofline only
DATABASE_SYSTEMS = {"h100-sxm": "h100_sxm", "h200-sxm": "h200_sxm"}
ALLGATHER, DEEPEP = "allgather", "deepep"


@dataclass(frozen=True)
class Deployment:
    """One engine deployment. `redundant_experts`: extra expert slots over all EP ranks (EPLB replicas);
    `kv_cache_dtype`: None = the model's compute dtype (the engines' "auto"); `a2a`: the MoE all-to-all
    as the plan's deployment record chose it (allgather or deepep; None = `moe_a2a`'s rule)."""

    engine: str
    hardware: str
    nodes: int
    gpus_per_node: int
    attention_tp: int
    attention_dp: int
    moe_ep: int
    moe_tp: int = 1
    redundant_experts: int = 0
    max_running_requests: int | None = None
    kv_cache_dtype: str | None = None
    a2a: str | None = None

    def __post_init__(self):
        if self.engine not in ENGINES:
            raise UserError(f"unknown engine '{self.engine}'; engine pricing knows {', '.join(ENGINES)}")
        for key in ("nodes", "gpus_per_node", "attention_tp", "attention_dp", "moe_ep", "moe_tp"):
            if int(getattr(self, key)) < 1:
                raise UserError(f"deployment {key} is {getattr(self, key)}; it must be at least 1")
        if self.attention_tp * self.attention_dp != self.gpus:
            raise UserError(f"attention tp {self.attention_tp} x dp {self.attention_dp} must equal the {self.gpus} GPUs "
                            f"({self.nodes} nodes x {self.gpus_per_node})")
        if self.moe_ep * self.moe_tp != self.gpus:
            raise UserError(f"MoE ep {self.moe_ep} x tp {self.moe_tp} must equal the {self.gpus} GPUs "
                            f"({self.nodes} nodes x {self.gpus_per_node})")
        if self.a2a not in (None, ALLGATHER, DEEPEP):
            raise UserError(f"deployment moe_a2a {self.a2a!r} is not one of {ALLGATHER}, {DEEPEP}")
        if self.redundant_experts < 0 or (self.redundant_experts and self.redundant_experts % self.moe_ep):
            raise UserError(f"redundant experts {self.redundant_experts} must be a multiple of the EP size {self.moe_ep} "
                            f"(every rank holds as many slots)")

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def moe_a2a(self) -> str:
        """How tokens reach their experts: as chosen, else DeepEP where expert parallelism spans nodes,
        else all-gather (`core/engine_layout.py: moe_a2a_for`, the same rule)."""
        if self.a2a is not None:
            return self.a2a
        return DEEPEP if self.moe_ep > self.gpus_per_node else ALLGATHER

    @property
    def database(self) -> tuple | None:
        """(system, backend, version) of aiconfigurator-core's measured tables for this deployment, or None
        where the hardware profile has none (then every op is priced by the roofline)."""
        system = DATABASE_SYSTEMS.get(self.hardware)
        return None if system is None else (system, self.engine, DATABASE_VERSIONS[self.engine])

    def layout(self) -> dict:
        """The parallel layout as a plan records it."""
        return {"gpus": self.gpus, "nodes": self.nodes, "gpus_per_node": self.gpus_per_node,
                "attention_tp": self.attention_tp, "attention_dp": self.attention_dp, "moe_ep": self.moe_ep,
                "moe_tp": self.moe_tp, "redundant_experts": self.redundant_experts, "moe_a2a": self.moe_a2a,
                "max_running_requests": self.max_running_requests, "engine": self.engine,
                "database_version": DATABASE_VERSIONS[self.engine], "hardware": self.hardware}
