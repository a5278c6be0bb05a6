"""Hardware profiles: the constants the cost model prices a plan's compute and traffic with.

Why data and not code: a plan is often compiled on a CI machine with no GPU, so the hardware it
will run on is the user's choice. Built-in profiles live in `planner/hardware_data/<name>.yaml`,
every number with its source (published specifications for GPUs, `moeplan calibrate` for the
CPU at hand); `--hardware FILE` reads a user's YAML with the same keys.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path

import yaml

from moeplan.planner.errors import UserError

BUILTIN = ("cpu-gloo", "h100-sxm", "h200-sxm", "a100-sxm")
DEFAULT_HARDWARE = "cpu-gloo"
TIERS = ("same_node", "other_node")
_SCALARS = ("flops_per_s", "memory_bytes_per_s", "op_overhead_s", "python_slot_s", "attention_ops_per_sequence", "parallel_ranks",
            "collective_latency_base_s", "collective_latency_per_peer_s")


@dataclass(frozen=True)
class HardwareProfile:
    """One machine type; units in the key names. `sources` says where each number comes from."""

    name: str
    flops_per_s: float                # dense matmul throughput of one rank
    memory_bytes_per_s: float         # weight reads of one rank
    op_overhead_s: float              # one framework op / kernel launch
    python_slot_s: float              # the runtime's replica choice, per (token, expert) slot
    attention_ops_per_sequence: float  # framework calls per sequence in a block's attention
    parallel_ranks: float             # ranks that compute at once (CPU: cores; GPUs: all)
    collective_latency_base_s: float  # fixed part of one all_to_all call
    collective_latency_per_peer_s: float
    bandwidth_bytes_per_s: dict       # tier -> bytes/s one rank sends
    message_latency_s: dict           # tier -> seconds per message
    sources: dict = field(default_factory=dict, compare=False)
    # optional: the host CPU computing a missed expert (offloading's host compute, docs/offload.md)
    host_memory_bytes_per_s: float = 0.0  # weights read by all cores (a decode row is memory-bound)
    host_flops_per_s: float = 0.0         # float32 matmul, all cores

    def collective_latency(self, world: int) -> float:
        """One all_to_all call among `world` ranks: base + per_peer x (world - 1)."""
        return self.collective_latency_base_s + self.collective_latency_per_peer_s * (world - 1)

    def to_dict(self) -> dict:
        return asdict(self)


def load_hardware(name_or_file: str | None) -> HardwareProfile:
    """A built-in profile by name, or a YAML file with the same keys (errors name the key)."""
    spec = name_or_file or DEFAULT_HARDWARE
    if spec in BUILTIN:
        text = resources.files("moeplan.planner").joinpath("hardware_data", f"{spec}.yaml").read_text()
        return profile_from_dict(yaml.safe_load(text), spec)
    path = Path(spec)
    if not path.is_file():
        raise UserError(f"unknown hardware '{spec}': give one of {', '.join(BUILTIN)} or a YAML profile file "
                        f"(write one for this machine with 'moeplan calibrate --out FILE')")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise UserError(f"hardware file '{path}' is not valid YAML ({exc.__class__.__name__}); fix it or re-run 'moeplan calibrate'")
    return profile_from_dict(data, str(path))


def profile_from_dict(data, where: str) -> HardwareProfile:
    if not isinstance(data, dict):
        raise UserError(f"hardware profile '{where}' must be a mapping of keys to values")
    known = {"name", "sources", "bandwidth_bytes_per_s", "message_latency_s", *_SCALARS, *_OPTIONAL}
    unknown = sorted(set(data) - known)
    if unknown:
        raise UserError(f"hardware profile '{where}' has unknown key(s) {unknown}; known keys: {', '.join(sorted(known))}")
    missing = sorted(known - {"sources", *_OPTIONAL} - set(data))
    if missing:
        raise UserError(f"hardware profile '{where}' is missing key(s) {missing}")
    values = {k: _positive(where, k, data[k], zero_ok=k in _MAY_BE_ZERO) for k in _SCALARS}
    values.update({k: _positive(where, k, data[k], zero_ok=True) for k in _OPTIONAL if k in data})  # 0: not measured
    tiers = {}
    for key in ("bandwidth_bytes_per_s", "message_latency_s"):
        per = data[key]
        if not isinstance(per, dict) or sorted(per) != sorted(TIERS):
            raise UserError(f"hardware profile '{where}': '{key}' must map exactly {', '.join(TIERS)} to numbers")
        tiers[key] = {t: _positive(where, f"{key}.{t}", per[t]) for t in TIERS}
    return HardwareProfile(name=str(data["name"]), sources=dict(data.get("sources") or {}), **values, **tiers)


_MAY_BE_ZERO = ("python_slot_s", "attention_ops_per_sequence")
_OPTIONAL = ("host_memory_bytes_per_s", "host_flops_per_s")  # `moeplan calibrate` measures them


def _positive(where: str, key: str, value, zero_ok: bool = False) -> float:
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
            or value < 0 or (value == 0 and not zero_ok)):
        raise UserError(f"hardware profile '{where}': '{key}' must be a {'non-negative' if zero_ok else 'positive'} "
                        f"number, got {value!r}")
    return float(value)
