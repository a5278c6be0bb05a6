"""ModelIR: the one description of a model that every importer produces and every pass reads.

A model is an ordered tuple of stages. Dense stages (embedding, attention, norm, mlp, head) carry
their size and cost; MoE stages additionally carry the router and the experts. Sizes are counted
from the real parameter shapes (meta tensors included), so a full-size model planned from its
config has exact figures. `source` points back at the module path or ONNX node the stage came
from; it is excluded from equality so that a torch import and an ONNX import of the same model
compare equal.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields

IR_VERSION = 1

DENSE_KINDS = ("embedding", "attention", "norm", "mlp", "head", "other")

DTYPE_BYTES = {
    "float32": 4, "float16": 2, "bfloat16": 2, "float64": 8,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "int8": 1, "uint8": 1, "int4": 0.5,
}


def dtype_bytes(dtype: str) -> float:
    """Bytes per element of a dtype name as it appears in torch, ONNX or HF configs."""
    name = str(dtype).replace("torch.", "")
    if name not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}")
    return DTYPE_BYTES[name]


@dataclass(frozen=True)
class DenseStage:
    """A stage every token passes through: embedding, attention, norm, dense MLP or head."""

    name: str
    kind: str
    params: int
    param_bytes: int
    flops_per_token: int
    activation_bytes_per_token: int
    dtype: str
    source: str = field(default="", compare=False)
    inactive_params: int = 0  # params a token skips: unselected experts of a mixture of attention heads

    @property
    def is_moe(self) -> bool:
        return False


@dataclass(frozen=True)
class MoEStage:
    """Router + E routed experts (top-k per token) + optional always-on shared experts.

    `params`/`param_bytes` count everything in the stage; the per-part fields let planners size
    one expert (a unit of placement) without re-deriving it. `flops_per_token` is the active
    compute of one token: router, k routed experts and the shared experts.
    """

    name: str
    moe_index: int
    params: int
    param_bytes: int
    flops_per_token: int
    activation_bytes_per_token: int
    dtype: str
    hidden_size: int
    num_experts: int
    top_k: int
    expert_params: int
    expert_param_bytes: int
    expert_flops_per_token: int
    router_params: int
    shared_experts: int = 0
    shared_expert_params: int = 0
    source: str = field(default="", compare=False)

    kind = "moe"

    @property
    def is_moe(self) -> bool:
        return True


Stage = DenseStage | MoEStage


@dataclass(frozen=True)
class ModelIR:
    """An MoE model as planning sees it. Frozen; round-trips through JSON exactly."""

    name: str
    architecture: str
    hidden_size: int
    vocab_size: int
    dtype: str
    stages: tuple
    source_format: str = field(default="", compare=False)
    quantization: str = ""  # checkpoint storage of quantized weights ("mxfp4", "fp8 blocks 128x128"); "" = dtype

    @property
    def active_params(self) -> int:
        """Parameters one token uses, each counted once, the input embedding matrix included.

        Dense stages count whole (less any unselected attention experts); an MoE stage counts its
        router, top_k routed experts and its shared experts.
        """
        return sum(s.params - s.inactive_params for s in self.dense_stages) + sum(
            s.router_params + s.top_k * s.expert_params + s.shared_expert_params for s in self.moe_stages
        )

    @property
    def active_params_excluding_embedding(self) -> int:
        """`active_params` without the input embedding, as model cards count active parameters.

        A token looks up one row of the embedding, so cards leave the matrix out; a head tied to it
        still multiplies through it and stays in (its weights are read from its FLOPs, 2 per weight).
        """
        embedding = sum(s.params for s in self.dense_stages if s.kind == "embedding")
        tied_head = sum(max(0, s.flops_per_token // 2 - s.params) for s in self.dense_stages if s.kind == "head")
        return self.active_params - embedding + tied_head

    @property
    def moe_stages(self) -> tuple:
        return tuple(s for s in self.stages if s.is_moe)

    @property
    def dense_stages(self) -> tuple:
        return tuple(s for s in self.stages if not s.is_moe)

    @property
    def total_params(self) -> int:
        return sum(s.params for s in self.stages)

    @property
    def total_param_bytes(self) -> int:
        return sum(s.param_bytes for s in self.stages)

    @property
    def dense_params(self) -> int:
        return sum(s.params for s in self.dense_stages) + sum(
            s.router_params + s.shared_expert_params for s in self.moe_stages
        )

    @property
    def flops_per_token(self) -> int:
        return sum(s.flops_per_token for s in self.stages)

    def to_dict(self) -> dict:
        stages = []
        for s in self.stages:
            d = asdict(s)
            d["type"] = "moe" if s.is_moe else "dense"
            stages.append(d)
        return {
            "version": IR_VERSION,
            "name": self.name,
            "architecture": self.architecture,
            "hidden_size": self.hidden_size,
            "vocab_size": self.vocab_size,
            "dtype": self.dtype,
            "source_format": self.source_format,
            "quantization": self.quantization,
            "stages": stages,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_dict(cls, data: dict) -> ModelIR:
        if data.get("version") != IR_VERSION:
            raise ValueError(f"IR version {data.get('version')!r} is not {IR_VERSION}")
        stages = []
        for raw in data["stages"]:
            raw = dict(raw)
            stage_cls = MoEStage if raw.pop("type") == "moe" else DenseStage
            names = {f.name for f in fields(stage_cls)}
            stages.append(stage_cls(**{k: v for k, v in raw.items() if k in names}))
        return cls(
            name=data["name"],
            architecture=data["architecture"],
            hidden_size=data["hidden_size"],
            vocab_size=data["vocab_size"],
            dtype=data["dtype"],
            stages=tuple(stages),
            source_format=data.get("source_format", ""),
            quantization=data.get("quantization", ""),
        )

    @classmethod
    def from_json(cls, text: str) -> ModelIR:
        return cls.from_dict(json.loads(text))
