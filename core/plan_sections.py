"""Typed sections of a Plan: `communication`, `predicted`, `placement` and `deployment` (plan.json bytes unchanged).

Each section is a frozen dataclass whose fields are the keys the targets write (a field a target
does not write reads None); `from_json(dict)` and `to_json() -> dict` convert to and from the
plan.json object. A section keeps every key it was given, in the order given, the keys it does not
declare too (`extra`: a target's own, or a later version's), and emits no key it was not given, so
a plan reads back and writes out byte for byte. Sections are also read-only mappings
(`section["mode"]`, `section.get("expert_cache")`, `{**section}`), for code that treats the
section as the JSON object it is (the bundle runtime reads plan.json itself and keeps dicts).

What each target writes (docs/formats.md has the meanings):

* `communication`: torchrun and Kubernetes: mode, gating, layers, attention_state, capacity,
  expert_cache (a dict: per-rank caches); sglang and trtllm: mode, engine, ep_size, redundant,
  slots_per_rank, objective; lambda: serverless_version, batch_tokens, methods; offload:
  offload_version, expert_cache (an int: the one GPU's capacity), eviction, prefetch, memory,
  tiers, timing, hardware, host_resident, policy_model, eamc.
* `predicted`: torchrun and Kubernetes: gpu_local_fraction, node_local_fraction,
  max_over_mean_load, transitions, cross_gpu_transitions, cross_node_transitions,
  inter_layer_top1_affinity, cost, expert_cache; sglang and trtllm: max_over_mean_load, serving (with
  --hardware / --workload: the engine's TPOT, TTFT, throughput, memory per GPU), warnings; lambda:
  cost_per_request_usd (per sized batch), latency_s, request_cost, api_call and the sizing's figures;
  offload: hit_ratio,
  seconds_per_token, belady_gap_points, policies, ...
* `placement`: placement.json's document (version, policy, layers, topology, num_experts,
  metrics) for torchrun, Kubernetes and the engine targets; lambda: version, policy, layers,
  dense_slices, unit_segments; offload: version, policy, resident.
* `deployment`: how the bundle is deployed. The engine targets (sglang, vllm, trtllm): the engine's
  parallel layout (attention_tp, attention_dp, moe_ep, moe_tp, redundant_experts,
  max_running_requests, moe_a2a, hardware, chosen_by; vllm: eplb), which `core/engine_layout.py`
  builds and checks against `topology` and `communication`, and sglang's kubernetes, image;
  torchrun: weights; Kubernetes: image, storage_class, batch_job; lambda: payload_limit_bytes,
  requests_per_second, http_entry.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any


@dataclass(frozen=True, eq=False)
class Section(Mapping):
    """A plan section: declared fields, the keys it does not declare (`extra`), the keys' order."""

    extra: dict = field(default_factory=dict)
    given: tuple = field(default=(), repr=False, compare=False)  # the keys, in order, as from_json got them

    @classmethod
    def declared(cls) -> tuple:
        return tuple(f.name for f in fields(cls) if f.name not in ("extra", "given"))

    @classmethod
    def from_json(cls, doc: dict) -> Section:
        names = set(cls.declared())
        return cls(**{k: v for k, v in doc.items() if k in names},
                   extra={k: v for k, v in doc.items() if k not in names}, given=tuple(doc))

    def keys_present(self) -> tuple:
        if self.given:
            return self.given
        # built in code: the declared fields that are set, then the extra keys
        return tuple(k for k in self.declared() if getattr(self, k) is not None) + tuple(self.extra)

    def to_json(self) -> dict:
        names = set(self.declared())
        return {k: (getattr(self, k) if k in names else self.extra[k]) for k in self.keys_present()}

    # read-only mapping over exactly the keys present
    def __getitem__(self, key: str):
        if key not in self.keys_present():
            raise KeyError(key)
        return getattr(self, key) if key in set(self.declared()) else self.extra[key]

    def __iter__(self):
        return iter(self.keys_present())

    def __len__(self) -> int:
        return len(self.keys_present())

    def __eq__(self, other) -> bool:  # equal to any mapping of the same keys and values (a dict included)
        return isinstance(other, Mapping) and self.to_json() == dict(other.items())

    __hash__ = None


@dataclass(frozen=True, eq=False)
class Communication(Section):
    """How tokens move (what the runtime is configured with); see the module docstring per target."""

    mode: str | None = None                 # coherent | standard (torchrun, Kubernetes, engine targets)
    gating: str | None = None
    layers: list | None = None              # per MoE layer: all_to_all, exchanges
    attention_state: str | None = None
    capacity: dict | None = None            # sequences and context the ranks hold (passes/cost/capacity.py)
    expert_cache: Any = None                # per-rank caches (dict), or the offload target's capacity (int)
    engine: str | None = None               # sglang | trtllm
    ep_size: int | None = None
    redundant: int | None = None
    slots_per_rank: int | None = None
    objective: str | None = None
    serverless_version: int | None = None   # lambda
    batch_tokens: int | None = None
    methods: list | None = None
    offload_version: int | None = None      # offload
    eviction: str | None = None
    prefetch: str | None = None
    memory: dict | None = None
    tiers: dict | None = None
    timing: dict | None = None
    hardware: str | None = None
    host_resident: list | None = None
    policy_model: dict | None = None
    eamc: dict | None = None


@dataclass(frozen=True, eq=False)
class Predicted(Section):
    """What the planner predicts for the plan; see the module docstring per target."""

    gpu_local_fraction: float | None = None
    node_local_fraction: float | None = None
    max_over_mean_load: float | None = None
    load_drift: dict | None = None           # vllm: expert loads across windows of the trace, what sized --eplb-config
    transitions: Any = None
    cross_gpu_transitions: Any = None
    cross_node_transitions: Any = None
    inter_layer_top1_affinity: list | None = None
    cost: dict | None = None                 # the cost model: modes, the chosen one, the profile (passes/cost/)
    expert_cache: dict | None = None         # torchrun's per-rank caches: hit ratio, seconds per token
    cost_per_request_usd: float | None = None  # lambda
    moe_cost_per_batch_usd: float | None = None
    dense_cost_per_batch_usd: float | None = None
    latency_s: float | None = None
    throughput_tokens_per_s: float | None = None
    batch_tokens: int | None = None
    request_cost: dict | None = None          # the request cost model's spec (runtime/lambda_/request_cost.py)
    api_call: dict | None = None              # its price of the API call named at compile, and the month of them
    dense_partition: dict | None = None
    validation: dict | None = None
    predictor_error: dict | None = None
    predictor_options: Any = None
    algorithm: str | None = None
    solves: list | None = None
    profile: dict | None = None
    bo: dict | None = None
    hit_ratio: float | None = None           # offload
    seconds_per_token: float | None = None
    belady_gap_points: float | None = None
    bytes_moved_per_token: float | None = None
    policies: dict | None = None
    prefetch: dict | None = None
    resident_at_layer_start: float | None = None
    validation_tokens: int | None = None
    serving: dict | None = None               # engine targets: the serving prediction (passes/cost/engine/)
    warnings: list | None = None              # engine targets: what the user should know (one line each)


@dataclass(frozen=True, eq=False)
class Placement(Section):
    """Where every expert runs: placement.json's document, or the Lambda / offload target's placement."""

    version: int | None = None
    policy: str | None = None
    layers: list | None = None
    topology: dict | None = None
    num_experts: int | None = None
    metrics: dict | None = None
    dense_slices: list | None = None         # lambda
    unit_segments: dict | None = None
    resident: list | None = None             # offload


@dataclass(frozen=True, eq=False)
class Deployment(Section):
    """How the bundle is deployed. For the engine targets, the layout the engine is launched with (a
    decision: the flags' or the SLO search's; `core/engine_layout.py` builds it and checks it against
    `topology` and `communication`); for every target, settings that shape the bundle."""

    attention_tp: int | None = None         # engine targets: GPUs per attention replica (tensor parallel)
    attention_dp: int | None = None         # attention replicas (data parallel); attention_tp x attention_dp = GPUs
    moe_ep: int | None = None               # expert-parallel ranks (= communication.ep_size)
    moe_tp: int | None = None               # tensor parallelism inside each expert; moe_ep x moe_tp = GPUs
    redundant_experts: int | None = None    # replica slots per MoE layer over all EP ranks (= communication.redundant)
    max_running_requests: int | None = None  # requests decoding at once over the whole deployment; None: the engine's
    moe_a2a: str | None = None              # how tokens reach their experts: allgather | deepep
    hardware: str | None = None             # the hardware profile the deployment was planned for, or None
    chosen_by: str | None = None            # flags | slo_search
    eplb: dict | None = None                # vllm: the --eplb-config (window_size, step_interval, num_redundant_experts)
    kubernetes: bool | None = None          # sglang: kubernetes/ manifests written too
    image: str | None = None                # Kubernetes, sglang --kubernetes: the pods' image
    storage_class: str | None = None        # Kubernetes
    batch_job: bool | None = None
    weights: str | None = None              # torchrun: reference (absent: copy)
    payload_limit_bytes: int | None = None  # lambda
    requests_per_second: float | None = None
    http_entry: str | None = None


SECTIONS = {"communication": Communication, "predicted": Predicted, "placement": Placement, "deployment": Deployment}
