"""Named hardware profiles (hardware.yaml, with sources) for offload planning and simulation."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import yaml

from moeplan.planner.errors import UserError

PROFILES = Path(__file__).with_name("hardware.yaml")
DEFAULT = "rtx4090-pcie4"


@dataclass(frozen=True)
class Hardware:
    name: str
    gpu_memory_bytes: int
    gpu_memory_bandwidth: float
    host_memory_bytes: int
    pcie_bandwidth: float
    nvme_bandwidth: float
    memory_efficiency: float
    layer_overhead_s: float
    copy_latency_s: float
    host_memory_bytes_per_s: float = 0.0  # host compute on a miss: weights read by the host CPU (0: none)
    host_flops_per_s: float = 0.0  # the host CPU's matmul throughput
    host_overhead_s: float = 0.0  # per host-computed expert: activations there and back, launch

    @property
    def host_compute(self) -> bool:
        return self.host_memory_bytes_per_s > 0 and self.host_flops_per_s > 0

    def to_dict(self) -> dict:
        """The profile's fields (the host compute ones only when it has them: older plans unchanged)."""
        out = asdict(self)
        if not self.host_compute:
            for k in ("host_memory_bytes_per_s", "host_flops_per_s", "host_overhead_s"):
                del out[k]
        return out

    @classmethod
    def from_dict(cls, d: dict) -> "Hardware":
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


def load_hardware(name: str = DEFAULT) -> Hardware:
    """The named profile, or a UserError listing the known names."""
    profiles = yaml.safe_load(PROFILES.read_text())["profiles"]
    if name not in profiles:
        raise UserError(f"unknown hardware profile '{name}'; use one of {', '.join(sorted(profiles))}")
    return Hardware(name=name, **{k: (int(v) if k.endswith("_bytes") else float(v)) for k, v in profiles[name].items()})
