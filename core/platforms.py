"""Serverless platform model: the constants that turn a sizing decision into seconds and dollars.

Why data and not code: prices, limits and bandwidths change and differ per region and account,
so the defaults live in `core/platform_data/<name>.yaml` (each value with its source) and a
user overrides any subset of them from their own YAML file without touching moeplan.
"""
from __future__ import annotations

import math
from dataclasses import MISSING, asdict, dataclass, fields
from importlib import resources
from pathlib import Path

import yaml

from moeplan.core.errors import UserError

BUILTIN = ("aws_lambda",)


@dataclass(frozen=True)
class Platform:
    """One serverless platform; see `platform_data/aws_lambda.yaml` for units and sources."""

    name: str
    memory_options_mb: tuple
    mb_per_vcpu: float
    max_vcpus: float
    price_per_gb_s: float
    price_per_request: float
    billing_granularity_s: float
    payload_limit_bytes: int
    s3_bandwidth_bytes_per_s: float
    s3_latency_s: float
    f2f_bandwidth_bytes_per_s: float
    warm_start_s: float
    max_replicas: int
    runtime_memory_mb: float
    dense_function_memory_mb: float
    cpu_cluster_price_per_hour: float
    cpu_cluster_cores: int
    # serving a request (the HTTP front, EXPRESS executions, S3 requests): defaults for plans made before
    s3_put_price: float = 0.000005
    s3_get_price: float = 0.0000004
    express_request_price: float = 0.000001
    express_price_per_gb_s: float = 0.06 / 3600
    express_billing_granularity_s: float = 0.1
    express_memory_mb: float = 64.0
    express_max_duration_s: float = 300.0
    http_api_request_price: float = 0.000001
    http_api_timeout_s: float = 30.0
    http_api_payload_limit_bytes: int = 10 * 1024 * 1024
    front_function_memory_mb: float = 256.0

    def vcpus(self, memory_mb: float) -> float:
        """vCPU share of a function with this much memory (proportional, capped)."""
        return min(memory_mb / self.mb_per_vcpu, self.max_vcpus)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["memory_options_mb"] = list(self.memory_options_mb)
        return d


def _builtin_values(name: str) -> dict:
    text = resources.files("moeplan.core").joinpath("platform_data", f"{name}.yaml").read_text()
    return yaml.safe_load(text)


def load_platform(override: str | Path | None = None, base: str = "aws_lambda", **values) -> Platform:
    """The built-in platform `base`, with keys from the YAML file `override` and `values` replaced.

    Unknown keys and bad values are user errors naming the key.
    """
    if base not in BUILTIN:
        raise UserError(f"unknown platform '{base}'; known: {', '.join(BUILTIN)}")
    data = _builtin_values(base)
    if override is not None:
        path = Path(override)
        if not path.is_file():
            raise UserError(f"platform file '{path}' does not exist; pass a YAML file of platform keys to override")
        try:
            extra = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        except UnicodeDecodeError:
            raise UserError(f"platform file '{path}' is not UTF-8 text; pass a YAML file of platform keys") from None
        except (yaml.YAMLError, RecursionError) as exc:
            raise UserError(f"platform file '{path}' is not valid YAML ({exc.__class__.__name__})") from None
        if not isinstance(extra, dict):
            raise UserError(f"platform file '{path}' must hold a mapping of keys to values")
        data.update(extra)
    data.update(values)
    return platform_from_dict(data)


def platform_from_dict(data: dict) -> Platform:
    """Validate a complete mapping of platform keys into a `Platform`."""
    names = [f.name for f in fields(Platform)]
    unknown = sorted(set(data) - set(names))
    if unknown:
        raise UserError(f"unknown platform key(s) {unknown}; known keys: {', '.join(names)}")
    defaults = {f.name: f.default for f in fields(Platform) if f.default is not MISSING}
    data = {**defaults, **data}
    missing = [n for n in names if n not in data]
    if missing:
        raise UserError(f"platform is missing key(s) {missing}")
    out = {}
    for f in fields(Platform):
        value = data[f.name]
        if f.name == "name":
            out[f.name] = str(value)
        elif f.name == "memory_options_mb":
            if not isinstance(value, (list, tuple)) or not value:
                raise UserError("platform key 'memory_options_mb' must be a non-empty list of MB values")
            opts = sorted({_number(f.name, v) for v in value})
            if opts[0] <= 0:
                raise UserError("platform key 'memory_options_mb' must hold positive values")
            out[f.name] = tuple(opts)
        else:
            num = _number(f.name, value)
            if num < 0 or (num == 0 and f.name in _POSITIVE):
                raise UserError(f"platform key '{f.name}' must be {'positive' if f.name in _POSITIVE else 'non-negative'}, got {value}")
            out[f.name] = int(num) if f.name in _INTEGER else num
    return Platform(**out)


_INTEGER = ("max_replicas", "payload_limit_bytes", "cpu_cluster_cores", "http_api_payload_limit_bytes")
_POSITIVE = {
    "mb_per_vcpu", "max_vcpus", "payload_limit_bytes", "s3_bandwidth_bytes_per_s",
    "f2f_bandwidth_bytes_per_s", "max_replicas", "cpu_cluster_cores", "express_memory_mb", "express_max_duration_s",
    "http_api_timeout_s", "http_api_payload_limit_bytes", "front_function_memory_mb",
}


def _number(key: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise UserError(f"platform key '{key}' must be a finite number, got {value!r}")
    return float(value)


def time_limit_s(platform: dict, http_entry: str) -> float:
    """How long a request may take end to end behind this HTTP entry of a Lambda deployment (`platform`:
    the platform's dict): the synchronous EXPRESS execution's limit, and behind an API Gateway HTTP API its
    integration timeout (backends/lambda_/front.py has the sources)."""
    express = float(platform.get("express_max_duration_s", 300.0))
    if http_entry == "http-api":
        return min(express, float(platform.get("http_api_timeout_s", 30.0)))
    return express
