"""The routing-trace file format (`.npz`, version 1): the contract between tracing and planning.

| array          | shape        | meaning                                                       |
| experts        | int [T,L,K]  | expert chosen by token t at MoE layer l, k-th choice, heaviest first; -1 = none |
| weights        | f32 [T,L,K]  | gate weights (optional; default 1/K)                          |
| token_ids      | int [T]      | vocabulary id (optional)                                      |
| positions      | int [T]      | position in its sequence (optional)                           |
| sequence       | int [T]      | request/sequence id (optional)                                |
| attention_ids  | int [T,L]    | token id receiving the highest summed attention before layer l (optional) |
| num_experts    | int scalar   | experts per MoE layer (optional; else max id + 1)             |
| loads          | int [L,E]    | (token, choice) assignments per MoE layer and expert; present only in a loads-only trace |
| speculation    | int [T,L,D,K] | top-k the router of MoE layer l+d picks for token t from a hidden state of layer l, at [t, l, d-1] (optional; -1 past the last layer; speculate.py) |
| speculation_source | int scalar | which hidden state: index into `SPECULATION_SOURCES` (with `speculation`) |
| version        | int scalar   | format version: 2 with `speculation`, else 1 (both are read)  |

Every read validates shapes, dtypes and ranges, and reports the first problem as a `UserError`.

A *loads-only* trace comes from engines that count tokens per expert but do not log each token
(SGLang's `stat` recorder, TensorRT-LLM's expert statistics): it holds `loads` and an `experts`
array with no tokens. Balance-only placement (`eplb`, `contiguous`) needs nothing more; whatever
needs to follow tokens from layer to layer (affinity, `ilp`, locality metrics) calls
`require_routing` and refuses it with a message naming the fix.
"""
from __future__ import annotations

import hashlib
import os
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moeplan.core.atomic import atomic_path
from moeplan.core.errors import UserError

TRACE_VERSION = 2
READ_VERSIONS = (1, 2)  # version 1: no speculation; traces without speculation are still written as 1
OPTIONAL_PER_TOKEN = ("token_ids", "positions", "sequence")
SPECULATION_SOURCES = ("block-output", "residual", "router-input")  # speculate.py says what each is


@dataclass(frozen=True, eq=False)
class Trace:
    """A validated routing trace; arrays are read-only numpy arrays."""

    experts: np.ndarray  # int32 [T, L, K]
    weights: np.ndarray  # float32 [T, L, K]
    num_experts: int
    token_ids: np.ndarray | None = None
    positions: np.ndarray | None = None
    sequence: np.ndarray | None = None
    attention_ids: np.ndarray | None = None
    loads: np.ndarray | None = None  # int64 [L, E], loads-only traces only
    speculation: np.ndarray | None = None  # int32 [T, L, D, K]
    speculation_source: str | None = None  # one of SPECULATION_SOURCES, with `speculation`

    @property
    def speculation_depth(self) -> int:
        return 0 if self.speculation is None else self.speculation.shape[2]

    @property
    def loads_only(self) -> bool:
        return self.loads is not None

    @property
    def num_tokens(self) -> int:
        return self.experts.shape[0]

    @property
    def num_layers(self) -> int:
        return self.experts.shape[1]

    @property
    def top_k(self) -> int:
        return self.experts.shape[2]

    def expert_loads(self, rows=None) -> np.ndarray:
        """int64 [L, E]: (token, choice) pairs routed to expert e at layer l, over all rows or the given
        rows (a mask or indices); -1 (no expert) is not counted. The one load count of every pass.
        A loads-only trace returns its own counts (it has no rows to choose)."""
        if self.loads_only:
            if rows is not None:
                require_routing(self, "counting the loads of some tokens")
            return self.loads
        experts = self.experts if rows is None else self.experts[rows]
        L, E = self.num_layers, self.num_experts
        flat = np.moveaxis(experts, 1, 0).reshape(L, -1)
        return np.stack([np.bincount(layer[layer >= 0], minlength=E)[:E] for layer in flat]).astype(np.int64) \
            if L else np.zeros((0, E), dtype=np.int64)

    def select(self, rows: np.ndarray) -> Trace:
        """The sub-trace of the given token rows (a mask or indices), e.g. a train/held-out split."""
        def pick(a):
            return None if a is None else a[rows]
        return make_trace(
            self.experts[rows], pick(self.weights), num_experts=self.num_experts,
            token_ids=pick(self.token_ids), positions=pick(self.positions),
            sequence=pick(self.sequence), attention_ids=pick(self.attention_ids), loads=self.loads,
            speculation=pick(self.speculation), speculation_source=self.speculation_source,
        )


def require_routing(trace: Trace, purpose: str) -> None:
    """Refuse a loads-only trace for work that follows individual tokens across layers."""
    if trace.loads_only:
        raise UserError(
            f"{purpose} needs per-token routing, but this trace holds expert loads only (imported from "
            f"SGLang 'stat' dumps or TensorRT-LLM expert statistics); use a balance-only policy "
            f"(--policy eplb or contiguous), or record per-token routing (SGLang "
            f"--expert-distribution-recorder-mode per_token, or 'moeplan trace')")


def loads_trace(loads, top_k: int = 1, num_experts: int | None = None) -> Trace:
    """A loads-only trace from int [L, E] counts (see module doc); `top_k` is kept for reference."""
    loads = np.asarray(loads)
    if loads.ndim != 2:
        raise UserError(f"expert loads must have 2 dimensions [MoE layers, experts], got shape {loads.shape}")
    if top_k < 1:
        raise UserError(f"top-k must be at least 1, got {top_k}")
    return make_trace(np.zeros((0, loads.shape[0], top_k), dtype=np.int32), num_experts=num_experts, loads=loads)


INT32_MAX = int(np.iinfo(np.int32).max)
INT64_MAX = int(np.iinfo(np.int64).max)
# The dtype each integer array is stored as in memory, and the values it may hold. Ids are
# checked against these bounds in their file's own dtype, before any cast, so an int64 id of
# 2**32 + 3 is an error and never wraps to 3.
STORED_DTYPE = {"experts": np.int32, "positions": np.int32, "sequence": np.int32,
                "token_ids": np.int64, "attention_ids": np.int64, "loads": np.int64, "speculation": np.int32}
VALUE_BOUNDS = {"experts": (-1, INT32_MAX - 1), "positions": (0, INT32_MAX), "sequence": (0, INT32_MAX),
                "token_ids": (0, INT64_MAX), "attention_ids": (-1, INT64_MAX), "loads": (-INT64_MAX - 1, INT64_MAX),
                "speculation": (-1, INT32_MAX - 1)}
MAX_EXPERTS = 1 << 14  # per MoE layer; 40x the largest published MoE (384 routed experts)
ANALYSIS_BUDGET_BYTES = 4 << 30  # the most one derived table (e.g. [L-1, E, E] transition counts) may take


def memory_budget_bytes() -> int:
    """Half of this machine's physical memory: the most one trace (or one analysis of it) may claim."""
    try:
        return int(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")) // 2
    except (ValueError, OSError, AttributeError):
        return 8 << 30


def check_int_values(name: str, arr: np.ndarray) -> None:
    """Refuse integer values outside `VALUE_BOUNDS[name]`, compared in the array's own dtype."""
    lo, hi = VALUE_BOUNDS[name]
    if not arr.size:
        return
    low, high = int(arr.min()), int(arr.max())
    if low < lo:
        hint = "; use -1 for 'no expert'" if name == "experts" else ""
        raise UserError(f"trace array '{name}' holds {low}, below {lo} (the smallest allowed value){hint}")
    if high > hi:
        raise UserError(f"trace array '{name}' holds {high}, above {hi} (the largest allowed value); "
                        "the ids are corrupt or from another format")


def _int_array(name: str, value, ndim: int) -> np.ndarray:
    arr = np.asarray(value)
    if arr.ndim != ndim:
        raise UserError(f"trace array '{name}' must have {ndim} dimensions, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise UserError(f"trace array '{name}' must hold integers, got dtype {arr.dtype}")
    check_int_values(name, arr)
    return arr.astype(STORED_DTYPE[name])


def check_trace_shape(num_tokens: int, num_layers: int, top_k: int, num_experts: int) -> None:
    """Refuse, before allocating, a trace [T, L, K] (ids and weights, 8 bytes an entry) that would not
    fit in memory, or whose expert count the analyses cannot hold."""
    need = num_tokens * num_layers * top_k * 8
    if need > memory_budget_bytes():
        raise UserError(f"a trace of {num_tokens} tokens x {num_layers} layers x top-{top_k} needs {need / 2**30:.1f} GiB, "
                        "more than half of this machine's memory; use fewer tokens or layers")
    check_trace_size(num_layers, num_experts)


def check_trace_size(num_layers: int, num_experts: int) -> None:
    """Refuse an expert count the analyses cannot hold: [L-1, E, E] transition counts must fit."""
    if num_experts > MAX_EXPERTS:
        raise UserError(f"trace declares {num_experts} experts per layer; moeplan plans at most {MAX_EXPERTS} "
                        "(check 'num_experts' and the largest expert id)")
    need = max(num_layers - 1, 1) * num_experts * num_experts * 8
    budget = min(memory_budget_bytes(), ANALYSIS_BUDGET_BYTES)
    if need > budget:
        raise UserError(f"a trace of {num_layers} MoE layers x {num_experts} experts needs {need / 2**30:.1f} GiB "
                        f"for its affinity analysis (at most {budget / 2**30:.0f} GiB); trace fewer layers or experts")


def make_trace(
    experts,
    weights=None,
    *,
    num_experts: int | None = None,
    token_ids=None,
    positions=None,
    sequence=None,
    attention_ids=None,
    loads=None,
    speculation=None,
    speculation_source: str | None = None,
) -> Trace:
    """Build a `Trace`, validating every array; raises `UserError` naming the first problem."""
    experts = _int_array("experts", experts, 3)
    T, L, K = experts.shape
    if L == 0 or K == 0:
        raise UserError(f"trace array 'experts' has shape {experts.shape}: it needs at least one MoE layer and one choice")
    if experts.size and experts.min() < -1:
        raise UserError("trace array 'experts' holds ids below -1; use -1 for 'no expert'")
    max_id = int(experts.max()) if experts.size else -1
    if loads is not None:
        loads = _int_array("loads", loads, 2)
        if T:
            raise UserError(f"a trace with 'loads' is loads-only and must have no tokens in 'experts', got {T}")
        if loads.shape[0] != L:
            raise UserError(f"trace array 'loads' has {loads.shape[0]} MoE layers but 'experts' has {L}")
        if loads.size and loads.min() < 0:
            raise UserError("trace array 'loads' holds negative counts")
        if num_experts is None:
            num_experts = loads.shape[1]
        elif loads.shape[1] != int(num_experts):
            raise UserError(f"trace array 'loads' has {loads.shape[1]} experts per layer but 'num_experts' is {num_experts}")
    if num_experts is None:
        num_experts = max(max_id + 1, 1)
    num_experts = int(num_experts)
    if num_experts <= 0:
        raise UserError(f"trace 'num_experts' must be positive, got {num_experts}")
    if max_id >= num_experts:
        layer = int(np.argwhere(experts >= num_experts)[0][1])
        raise UserError(
            f"trace holds expert id {max_id} at MoE layer {layer} but the model has "
            f"{num_experts} experts per layer (ids must be < {num_experts}); was it traced from another model?"
        )
    check_trace_size(L, num_experts)
    if weights is None:
        weights = np.where(experts >= 0, np.float32(1.0 / K), np.float32(0.0))
    weights = np.asarray(weights)
    if weights.shape != experts.shape:
        raise UserError(f"trace array 'weights' has shape {weights.shape}, expected {experts.shape} like 'experts'")
    if not np.issubdtype(weights.dtype, np.floating):
        raise UserError(f"trace array 'weights' must hold floats, got dtype {weights.dtype}")
    weights = weights.astype(np.float32)
    if not np.all(np.isfinite(weights)):
        raise UserError("trace array 'weights' holds NaN or infinite values")

    extras = {}
    for name, value in (("token_ids", token_ids), ("positions", positions), ("sequence", sequence)):
        if value is None:
            extras[name] = None
            continue
        arr = _int_array(name, value, 1)
        if arr.shape[0] != T:
            raise UserError(f"trace array '{name}' has {arr.shape[0]} entries but 'experts' has {T} tokens")
        extras[name] = arr
    if attention_ids is not None:
        attention_ids = _int_array("attention_ids", attention_ids, 2)
        if attention_ids.shape != (T, L):
            raise UserError(f"trace array 'attention_ids' has shape {attention_ids.shape}, expected {(T, L)}")

    speculation, speculation_source = _speculation(speculation, speculation_source, T, L, K, num_experts)
    if K > num_experts:
        raise UserError(f"trace chooses top-{K} experts per token but has only {num_experts} experts per layer "
                        "(its 'num_experts', else its largest id + 1); top-k cannot exceed the expert count")
    arrays = [experts, weights, attention_ids, loads, speculation, *extras.values()]
    for arr in arrays:
        if arr is not None:
            arr.setflags(write=False)
    return Trace(experts=experts, weights=weights, num_experts=num_experts, attention_ids=attention_ids, loads=loads,
                 speculation=speculation, speculation_source=speculation_source, **extras)


def _speculation(speculation, source, T: int, L: int, K: int, num_experts: int) -> tuple:
    """(speculation int32 [T, L, D, K] or None, its source name or None), validated."""
    if speculation is None:
        if source is not None:
            raise UserError(f"trace names a speculation source ('{source}') but holds no 'speculation' array")
        return None, None
    if source not in SPECULATION_SOURCES:
        raise UserError(f"trace speculation source {source!r} is not one of {', '.join(SPECULATION_SOURCES)}")
    speculation = _int_array("speculation", speculation, 4)
    if speculation.shape[0] != T or speculation.shape[1] != L or speculation.shape[3] != K or speculation.shape[2] < 1:
        raise UserError(f"trace array 'speculation' has shape {speculation.shape}, expected ({T}, {L}, D >= 1, {K}) "
                        "like 'experts' with a distance axis")
    if speculation.size and int(speculation.max()) >= num_experts:
        raise UserError(f"trace array 'speculation' holds expert id {int(speculation.max())} but the model has "
                        f"{num_experts} experts per layer")
    return speculation, source


NPY_SUFFIX = ".npy"


def _member_header(archive: zipfile.ZipFile, info: zipfile.ZipInfo, path: Path):
    """(shape, dtype) from a member's .npy header, checked against the bytes the member holds."""
    name = info.filename[:-len(NPY_SUFFIX)]
    with archive.open(info) as fh:
        try:
            major, _ = np.lib.format.read_magic(fh)
            read_header = np.lib.format.read_array_header_1_0 if major == 1 else np.lib.format.read_array_header_2_0
            shape, _, dtype = read_header(fh, max_header_size=10000)
            header_len = fh.tell()
        except (ValueError, TypeError, SyntaxError, EOFError, OSError) as exc:
            raise UserError(f"trace file '{path}': array '{name}' has a malformed .npy header ({exc}); re-record the trace") from None
    if dtype.hasobject or dtype.kind not in "biuf":
        raise UserError(f"trace file '{path}': array '{name}' has dtype {dtype}; traces hold only numbers")
    count = 1
    for dim in shape:
        count *= int(dim)
    if count * dtype.itemsize != info.file_size - header_len:
        raise UserError(f"trace file '{path}': array '{name}' declares shape {shape} ({count * dtype.itemsize} bytes) "
                        f"but holds {info.file_size - header_len} bytes; the file is corrupt, re-record it")
    return count * dtype.itemsize


def read_npz_arrays(path: Path, budget: int | None = None) -> dict:
    """Every array of a `.npz`, each header validated against its data and the total against memory
    before anything is allocated; raises `UserError` for anything else."""
    if not zipfile.is_zipfile(path):
        raise UserError(f"trace file '{path}' is not a readable .npz archive (a plain .npy or another file renamed?); "
                        "write traces with 'moeplan trace' or numpy.savez")
    try:
        with zipfile.ZipFile(path) as archive:
            members = [i for i in archive.infolist() if not i.is_dir()]
            odd = [i.filename for i in members if not i.filename.endswith(NPY_SUFFIX)]
            if odd:
                raise UserError(f"trace file '{path}' holds {odd[0]!r}, not a .npy array; it is not a moeplan trace")
            total = sum(_member_header(archive, info, path) for info in members)
            if total > (memory_budget_bytes() if budget is None else budget):
                raise UserError(f"trace file '{path}' unpacks to {total / 2**30:.1f} GiB, more than half of this "
                                "machine's memory; split the trace or plan on a larger machine")
            arrays = {}
            for info in members:
                with archive.open(info) as fh:
                    arrays[info.filename[:-len(NPY_SUFFIX)]] = np.lib.format.read_array(fh, allow_pickle=False)
            return arrays
    except (OSError, ValueError, zipfile.BadZipFile, EOFError, NotImplementedError, RuntimeError) as exc:
        raise UserError(f"trace file '{path}' is not a readable .npz archive ({exc.__class__.__name__}); "
                        "re-record it with 'moeplan trace'") from None


def _int_scalar(path: Path, name: str, value) -> int:
    arr = np.asarray(value)
    if arr.ndim != 0 or not np.issubdtype(arr.dtype, np.integer):
        raise UserError(f"trace file '{path}': '{name}' must be an integer scalar, got dtype {arr.dtype} shape {arr.shape}")
    if int(arr) > INT32_MAX or int(arr) < -INT32_MAX:
        raise UserError(f"trace file '{path}': '{name}' is {int(arr)}, out of range")
    return int(arr)


def load_trace(path: str | os.PathLike) -> Trace:
    """Read and validate a trace file."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"trace file '{path}' does not exist; record one with 'moeplan trace MODEL --data TEXT --out {path}'")
    arrays = read_npz_arrays(path)
    if "experts" not in arrays:
        raise UserError(f"trace file '{path}' has no 'experts' array; it is not a moeplan routing trace")
    version = _int_scalar(path, "version", arrays.pop("version", 1))
    if version not in READ_VERSIONS:
        raise UserError(f"trace file '{path}' is format version {version}; this moeplan reads versions "
                        f"{', '.join(map(str, READ_VERSIONS))}")
    num_experts = arrays.pop("num_experts", None)
    if num_experts is not None:
        num_experts = _int_scalar(path, "num_experts", num_experts)
    source = arrays.pop("speculation_source", None)
    if source is not None:
        code = _int_scalar(path, "speculation_source", source)
        if not 0 <= code < len(SPECULATION_SOURCES):
            raise UserError(f"trace file '{path}': 'speculation_source' is {code}, not one of 0..{len(SPECULATION_SOURCES) - 1}")
        source = SPECULATION_SOURCES[code]
    known = {"experts", "weights", "token_ids", "positions", "sequence", "attention_ids", "loads"}
    if version >= 2:
        known.add("speculation")
    unknown = sorted(set(arrays) - known)
    if unknown:
        raise UserError(f"trace file '{path}' (version {version}) has unknown arrays {unknown}; expected only "
                        f"{sorted(known | {'num_experts', 'version'} | ({'speculation_source'} if version >= 2 else set()))}")
    try:
        trace = make_trace(num_experts=num_experts, speculation_source=source, **arrays)
    except UserError as exc:
        raise UserError(f"trace file '{path}': {exc}") from None
    check_has_tokens(trace, f"trace file '{path}'")
    return trace


def check_has_tokens(trace: Trace, source: str) -> None:
    """A trace with no token tells the planner nothing; refuse it where traces are read (a loads-only
    trace has no tokens by design: it must count at least one assignment)."""
    if trace.loads_only:
        if not trace.loads.sum():
            raise UserError(f"{source} counts 0 expert assignments; import statistics from a run that served tokens")
        return
    if trace.num_tokens == 0:
        raise UserError(f"{source} holds 0 tokens; record or import a trace with at least one token")


def save_trace(trace: Trace, path: str | os.PathLike) -> None:
    """Write a trace atomically; optional arrays that are absent are not written. A trace without
    speculation is written as version 1, byte for byte as before version 2 existed."""
    arrays = {
        "version": np.int64(TRACE_VERSION if trace.speculation is not None else 1),
        "num_experts": np.int64(trace.num_experts),
        "experts": trace.experts,
        "weights": trace.weights,
    }
    for name in (*OPTIONAL_PER_TOKEN, "attention_ids", "loads", "speculation"):
        value = getattr(trace, name)
        if value is not None:
            arrays[name] = value
    if trace.speculation is not None:
        arrays["speculation_source"] = np.int64(SPECULATION_SOURCES.index(trace.speculation_source))
    with atomic_path(path, kind="trace") as tmp:
        _write_npz_deterministic(tmp, arrays)


def _write_npz_deterministic(path: Path, arrays: dict) -> None:
    """Like `np.savez_compressed`, but with fixed zip timestamps so equal traces are equal bytes."""
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        for name in sorted(arrays):
            info = zipfile.ZipInfo(f"{name}.npy", date_time=(1980, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_DEFLATED
            with archive.open(info, "w", force_zip64=True) as member:
                np.lib.format.write_array(member, np.asarray(arrays[name]), allow_pickle=False)


def trace_file_sha256(path: str | os.PathLike) -> str:
    """sha256 of a trace file's bytes: the one trace identifier every plan records (`trace_sha256`).
    Trace files are written byte-deterministically, so equal traces give equal digests."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()
