"""Hardware profiles: every constant a plan's predictions are priced with, in one system.

Why data and not code: a plan is often compiled on a CI machine with no GPU, so the hardware it
will run on is the user's choice. Built-in profiles live in `core/hardware_data/<name>.yaml`,
every figure with its source (published specifications for GPUs, `moeplan calibrate` for a CPU);
`--hardware FILE` reads a user's YAML with the same keys, and `--hardware this-machine` the
cached calibration of the machine at hand (`moeplan calibrate` writes it).

One profile serves every prediction: the cost model of torchrun/Kubernetes plans (compute, weight
reads, framework calls, collective and per-message latency, link bandwidth per tier), and the
expert-cache / offload planner (device and host memory, host-to-device and disk read bandwidth,
copy latency, per-layer overhead, memory efficiency). A figure a profile does not know is `null`
in its YAML with a source saying why; a prediction that needs it refuses in one line
(`HardwareProfile.require`), never guesses.
"""
from __future__ import annotations

import hashlib
import math
import os
import platform
import re
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from importlib import resources
from pathlib import Path

import yaml

from moeplan.core.errors import UserError

TIERS = ("same_node", "other_node")
THIS_MACHINE = "this-machine"
# The default profile per target: torchrun/Kubernetes bundles run on this repository's CPU ranks
# unless told otherwise; the offload target plans one GPU whose experts do not all fit.
DEFAULT_HARDWARE = "cpu-gloo"
DEFAULT_OFFLOAD_HARDWARE = "rtx4090-pcie4"
# Bump when `moeplan calibrate` measures differently, so older cached calibrations are not reused.
CALIBRATION_METHOD = 6  # 3: also the host's expert rates (host compute on a miss); 4: multi-rank engine under torchrun;
                        # 5: the op cost fitted over the runtime's counted ops (runtime_op_overhead_s);
                        # 6: and its part per row (runtime_op_row_s)

COST_FIGURES = ("flops_per_s", "memory_bytes_per_s", "op_overhead_s", "python_slot_s", "attention_ops_per_sequence",
                "parallel_ranks", "collective_latency_base_s", "collective_latency_per_peer_s")
MEMORY_FIGURES = ("device_memory_bytes", "host_memory_bytes", "host_to_device_bytes_per_s", "disk_read_bytes_per_s",
                  "memory_efficiency", "layer_overhead_s", "copy_latency_s")
TIERED = ("bandwidth_bytes_per_s", "message_latency_s")
_MAY_BE_ZERO = ("python_slot_s", "attention_ops_per_sequence", "runtime_op_row_s")
# the intercept of the exchange call's latency line, only ever priced at 2 ranks or more: `moeplan calibrate`
# fits the line through its 2- and 4-rank runs, and where 4 ranks share 2 cores the calls slow down faster
# than linearly from one rank, so the line's value at 1 rank (the intercept) can be negative
_INTERCEPT = "collective_latency_base_s"
_INTEGER = ("device_memory_bytes", "host_memory_bytes")
# optional keys (absent = unknown): host compute on a miss; `moeplan calibrate` measures the first two
HOST_FIGURES = ("host_memory_bytes_per_s", "host_flops_per_s", "host_overhead_s")
# optional: the dense FP8 tensor-core peak, which engine pricing's roofline gives FP8 weights (a GPU without
# FP8 tensor cores, or a profile that does not say, computes FP8 weights at flops_per_s)
PRECISION_FIGURES = ("fp8_flops_per_s",)
# optional: the measured cost of one op of moeplan's own runtime (eager, host-dispatched), which the torchrun cost
# model prices the runtime's counted ops at (passes/cost/runtime_ops.py); absent: op_overhead_s and the fitted counts
# optional: one op of a decode step the runtime captures as a CUDA graph (GPU ranks,
# runtime/model/graph_decode.py): a fixed part and a part per row of the step, measured (docs/gpu_checks.md)
RUNTIME_FIGURES = ("runtime_op_overhead_s", "runtime_op_row_s", "graph_op_overhead_s", "graph_op_row_s")
OPTIONAL_FIGURES = HOST_FIGURES + PRECISION_FIGURES + RUNTIME_FIGURES
PRECISIONS = ("fp8", "bf16", "fp32")  # runtime/precision.py's, named here: core imports nothing of the runtime


@dataclass(frozen=True)
class HardwareProfile:
    """One machine type; units in the key names; None = unknown (`sources` says why)."""

    name: str
    flops_per_s: float | None                # dense matmul throughput of one rank
    memory_bytes_per_s: float | None         # weight reads of one rank (device memory bandwidth)
    op_overhead_s: float | None              # one framework op / kernel launch
    python_slot_s: float | None              # the runtime's replica choice, per (token, expert) slot
    attention_ops_per_sequence: float | None  # framework calls per sequence in a block's attention
    parallel_ranks: float | None             # ranks that compute at once (CPU: cores; GPUs: all)
    collective_latency_base_s: float | None  # fixed part of one all_to_all call (a fitted intercept: any sign)
    collective_latency_per_peer_s: float | None
    bandwidth_bytes_per_s: dict              # tier -> bytes/s one rank sends (None: unknown)
    message_latency_s: dict                  # tier -> seconds per message
    device_memory_bytes: int | None = None   # memory of one rank's device (GPU; a CPU rank: the host's)
    host_memory_bytes: int | None = None     # host DRAM of one machine
    host_to_device_bytes_per_s: float | None = None  # one expert copy host -> device (PCIe; a CPU: memory copy)
    disk_read_bytes_per_s: float | None = None       # one expert read from the checkpoint (NVMe)
    memory_efficiency: float | None = None   # share of memory_bytes_per_s a decode step's weight reads reach
    layer_overhead_s: float | None = None    # fixed time of one layer step in the offload timing
    copy_latency_s: float | None = None      # fixed time of one expert copy
    sources: dict = field(default_factory=dict, compare=False)
    # optional: the host CPU computing a missed expert instead of copying it (offloading's host
    # compute, docs/offload.md); None: the profile does not say, and plans always copy
    host_memory_bytes_per_s: float | None = None  # weights read by all cores (a decode row is memory-bound)
    host_flops_per_s: float | None = None         # float32 matmul, all cores
    host_overhead_s: float | None = None          # per host-computed expert: activations there and back, launch
    fp8_flops_per_s: float | None = None          # dense FP8 matmul throughput of one rank (engine pricing)
    runtime_op_overhead_s: float | None = None    # one aten op of moeplan's runtime, measured (torchrun cost model)
    runtime_op_row_s: float | None = None         # and per row of its step on a host device (CPU calibrations)
    graph_op_overhead_s: float | None = None      # one op of a captured decode step (CUDA graph), fixed part
    graph_op_row_s: float | None = None           # and per row of the step
    calibration: dict | None = field(default=None, compare=False)  # `moeplan calibrate`: date, machine, key
    # optional: the narrowest weights the device computes at speed (`runtime/precision.py`: fp8 | bf16 |
    # fp32); None: bf16 on GPUs, fp32 where the device is the host
    weight_precision: str | None = None

    def collective_latency(self, world: int) -> float:
        """One all_to_all call among `world` ranks: base + per_peer x (world - 1)."""
        return self.collective_latency_base_s + self.collective_latency_per_peer_s * (world - 1)

    @property
    def host_compute(self) -> bool:
        """Whether the profile knows the host's rates, so a missed expert may be computed there."""
        return bool(self.host_memory_bytes_per_s) and bool(self.host_flops_per_s)

    @property
    def precision(self) -> str:
        """The narrowest weights the device computes at speed (`weight_precision`, else bf16 on GPUs and
        fp32 where the device is the host): what `runtime/precision.py` holds a model at."""
        if self.weight_precision is not None:
            return self.weight_precision
        return "fp32" if self.device_is_host else "bf16"

    @property
    def device_is_host(self) -> bool:
        """Whether a rank's "device" is the host itself (cpu-gloo, a calibration): its memory figure is the
        machine's, which the ranks on one node share."""
        return self.device_memory_bytes is not None and self.device_memory_bytes == self.host_memory_bytes

    def to_dict(self) -> dict:
        out = asdict(self)
        if out["calibration"] is None:
            out.pop("calibration")
        for key in (*OPTIONAL_FIGURES, "weight_precision"):  # optional: written only where known
            if out[key] is None:
                out.pop(key)
        return out

    def require(self, keys, purpose: str) -> HardwareProfile:
        """Self, or a UserError naming the first unknown figure among `keys` ('tier.key' for tiers)."""
        for key in keys:
            head, _, tier = key.partition(".")
            value = getattr(self, head)[tier] if tier else getattr(self, head)
            if value is None:
                why = self.sources.get(head, "no source given")
                raise UserError(f"hardware profile '{self.name}' does not know {key} ({why}), which {purpose} needs; "
                                f"give --hardware FILE with it set (copy the profile's YAML from "
                                f"moeplan/core/hardware_data/ or write one with 'moeplan calibrate --out FILE')")
        return self


def cost_model_figures(nodes: int) -> tuple:
    """The figures the cost model reads for a plan over `nodes` nodes (the other-node tier only then)."""
    tiers = TIERS if nodes > 1 else ("same_node",)
    return COST_FIGURES + tuple(f"{k}.{t}" for k in TIERED for t in tiers)


OFFLOAD_FIGURES = ("memory_bytes_per_s", "memory_efficiency", "layer_overhead_s", "copy_latency_s",
                   "host_to_device_bytes_per_s", "disk_read_bytes_per_s")


def builtin_profiles() -> tuple:
    """The names of the built-in profiles: the YAML files of core/hardware_data/ (one list)."""
    data = resources.files("moeplan.core").joinpath("hardware_data")
    return tuple(sorted(p.name[:-len(".yaml")] for p in data.iterdir() if p.name.endswith(".yaml")))


BUILTIN = builtin_profiles()


def hardware_names() -> str:
    """The names `--hardware` takes, for help texts and errors."""
    return ", ".join(BUILTIN) + f", {THIS_MACHINE} (this machine's cached 'moeplan calibrate')"


@dataclass(frozen=True)
class LoadedProfile:
    """A profile and where it came from: what a plan records so a report can say which figures a
    prediction used. `origin` is 'built-in', 'this-machine' or 'file'."""

    profile: HardwareProfile
    given: str         # the --hardware argument as given (name or path)
    origin: str
    sha256: str        # of the YAML bytes read

    def provenance(self) -> dict:
        """{given, origin, sha256, calibration?}: deterministic for the same file."""
        out = {"given": self.given, "origin": self.origin, "sha256": self.sha256}
        if self.profile.calibration is not None:
            out["calibration"] = self.profile.calibration
        return out

    def plan_record(self, figures: bool) -> dict:
        """What a plan keeps of where its profile came from: {"hardware_profile": provenance (and,
        with `figures`, every figure, so a later run prices with them wherever the file is)} for a
        file or this machine's calibration; nothing for a built-in profile, which its name identifies
        (so plans made with one stay byte for byte as they were)."""
        if self.origin == "built-in":
            return {}
        record = self.provenance()
        if figures:
            record["figures"] = {k: v for k, v in self.profile.to_dict().items() if k not in ("sources", "calibration")}
        return {"hardware_profile": record}


def profile_of_record(record: dict | None, name: str | None) -> HardwareProfile:
    """The profile a plan was priced with: its recorded figures (`plan_record(figures=True)`), else
    the built-in profile of its name, else the default."""
    if record is not None and "figures" in record:
        return profile_from_dict({**record["figures"], "calibration": record.get("calibration")}, "plan.json")
    return load_hardware(name if name in BUILTIN else DEFAULT_HARDWARE)


def load_hardware(name_or_file: str | None, default: str = DEFAULT_HARDWARE) -> HardwareProfile:
    """A built-in profile by name, this machine's calibration, or a YAML file (errors name the key)."""
    return load_profile(name_or_file, default).profile


def load_profile(name_or_file: str | None, default: str = DEFAULT_HARDWARE) -> LoadedProfile:
    spec = name_or_file or default
    if spec in BUILTIN:
        raw = resources.files("moeplan.core").joinpath("hardware_data", f"{spec}.yaml").read_bytes()
        return LoadedProfile(_parse(raw, spec), spec, "built-in", hashlib.sha256(raw).hexdigest())
    if spec == THIS_MACHINE:
        path = calibration_path()
        if not path.is_file():
            raise UserError(f"--hardware {THIS_MACHINE}: this machine ({machine_key()}) has no calibration yet; run "
                            f"'moeplan calibrate' once (about two minutes; cached in {path.parent})")
        raw = path.read_bytes()
        return LoadedProfile(_parse(raw, str(path)), THIS_MACHINE, THIS_MACHINE, hashlib.sha256(raw).hexdigest())
    path = Path(spec)
    if not path.is_file():
        raise UserError(f"unknown hardware '{spec}': give one of {hardware_names()}, or a YAML profile file "
                        f"(write one for this machine with 'moeplan calibrate --out FILE')")
    raw = path.read_bytes()
    return LoadedProfile(_parse(raw, str(path)), spec, "file", hashlib.sha256(raw).hexdigest())


def _parse(raw: bytes, where: str) -> HardwareProfile:
    try:
        data = yaml.safe_load(raw.decode("utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise UserError(f"hardware file '{where}' is not valid YAML ({exc.__class__.__name__}); fix it or re-run "
                        f"'moeplan calibrate'") from None
    return profile_from_dict(data, where)


def profile_from_dict(data, where: str) -> HardwareProfile:
    """A profile from its YAML mapping: every key present (null = unknown), numbers in range."""
    if not isinstance(data, dict):
        raise UserError(f"hardware profile '{where}' must be a mapping of keys to values")
    figures = (*COST_FIGURES, *MEMORY_FIGURES, *TIERED)
    known = {"name", "sources", "calibration", "weight_precision", *figures, *OPTIONAL_FIGURES}
    unknown = sorted(set(data) - known)
    if unknown:
        raise UserError(f"hardware profile '{where}' has unknown key(s) {unknown}; known keys: {', '.join(sorted(known))}")
    missing = sorted(k for k in (*figures, "name") if k not in data)
    if missing:
        raise UserError(f"hardware profile '{where}' is missing key(s) {missing} (write null for a figure it does not "
                        f"know, with a source saying why)")
    values = {k: _figure(where, k, data[k]) for k in (*COST_FIGURES, *MEMORY_FIGURES)}
    values.update({k: _figure(where, k, data[k]) for k in OPTIONAL_FIGURES if k in data})  # optional keys
    precision = data.get("weight_precision")
    if precision is not None and precision not in PRECISIONS:
        raise UserError(f"hardware profile '{where}': 'weight_precision' must be one of {', '.join(PRECISIONS)} or absent, "
                        f"got {precision!r}")
    for k in _INTEGER:
        values[k] = None if values[k] is None else int(values[k])
    base, per_peer = values["collective_latency_base_s"], values["collective_latency_per_peer_s"]
    if base is not None and per_peer is not None and base + per_peer <= 0:
        raise UserError(f"hardware profile '{where}': one all_to_all call at 2 ranks (collective_latency_base_s + "
                        f"collective_latency_per_peer_s = {base + per_peer!r}) must take a positive time")
    tiers = {}
    for key in TIERED:
        per = data[key]
        if not isinstance(per, dict) or sorted(per) != sorted(TIERS):
            raise UserError(f"hardware profile '{where}': '{key}' must map exactly {', '.join(TIERS)} to numbers (or null)")
        tiers[key] = {t: _figure(where, f"{key}.{t}", per[t]) for t in TIERS}
    calibration = data.get("calibration")
    if calibration is not None and not isinstance(calibration, dict):
        raise UserError(f"hardware profile '{where}': 'calibration' must be a mapping (date, machine, machine_key)")
    return HardwareProfile(name=str(data["name"]), sources=dict(data.get("sources") or {}), calibration=calibration,
                           weight_precision=precision, **values, **tiers)


def _figure(where: str, key: str, value):
    """A figure: None (unknown), or a finite positive number (zero where the key allows it)."""
    if value is None:
        return None
    if key == _INTERCEPT:  # any sign: profile_from_dict checks the latency at 2 ranks
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise UserError(f"hardware profile '{where}': '{key}' must be a number or null, got {value!r}")
        return float(value)
    zero_ok = key in _MAY_BE_ZERO
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
            or value < 0 or (value == 0 and not zero_ok)):
        raise UserError(f"hardware profile '{where}': '{key}' must be a {'non-negative' if zero_ok else 'positive'} "
                        f"number or null, got {value!r}")
    return float(value)


# --- this machine's calibration (the cache `moeplan calibrate` writes) ---------------------------

def calibration_dir() -> Path:
    """$XDG_CACHE_HOME/moeplan/hardware, else ~/.cache/moeplan/hardware (absolute)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base).resolve() / "moeplan" / "hardware"


@lru_cache(maxsize=1)
def runtime_digest() -> str:
    """The first 8 hex digits of sha256 over the runtime package's Python files (paths and bytes): a
    calibration fits the cost of the runtime's own calls (`op_overhead_s`, the exchange latency as the
    engine meets it), so one measured on other runtime code (an upgrade, a faster step) prices the
    runtime of then, not the one bundles ship now, and is measured again."""
    digest = hashlib.sha256()

    def walk(folder, prefix: str) -> None:
        for entry in sorted(folder.iterdir(), key=lambda e: e.name):
            if entry.is_dir() and entry.name != "__pycache__":
                walk(entry, f"{prefix}{entry.name}/")
            elif entry.name.endswith(".py"):
                digest.update(f"{prefix}{entry.name}\0".encode())
                digest.update(entry.read_bytes())

    walk(resources.files("moeplan.runtime"), "")
    return digest.hexdigest()[:8]


def machine_facts() -> dict:
    """What a calibration depends on: CPU model, cores this process may use, memory, torch, method, and the
    runtime's code (`runtime_digest`)."""
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            if line.lower().startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return {"cpu": cpu or platform.processor() or platform.machine() or "unknown", "cores": cores,
            "memory_gib": round(physical_memory_bytes() / 2**30), "torch": _torch_version(),
            "method": CALIBRATION_METHOD, "runtime": runtime_digest()}


def machine_key(facts: dict | None = None) -> str:
    """A readable key for a calibration: e.g. intel-xeon-processor-2c-24g-torch2.13.0-m4-r1a2b3c4d (the last part:
    the runtime's code, `runtime_digest`)."""
    f = facts or machine_facts()
    cpu = re.sub(r"[^a-z0-9]+", "-", re.sub(r"\((r|tm)\)", "", f["cpu"].lower())).strip("-")[:48] or "cpu"
    return f"{cpu}-{f['cores']}c-{f['memory_gib']}g-torch{f['torch']}-m{f['method']}-r{f.get('runtime', 'unknown')}"


def calibration_path(key: str | None = None) -> Path:
    return calibration_dir() / f"cpu-gloo-{key or machine_key()}.yaml"


def physical_memory_bytes() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0


def _torch_version() -> str:
    from importlib import metadata

    try:
        return metadata.version("torch").split("+")[0]
    except metadata.PackageNotFoundError:
        return "none"
