"""Malformed inputs for the CLI fuzz suite (issue 17), shared by tests/test_fuzz_cli.py (short, in
CI) and benchmarks/fuzz.py (long, counts printed).

Every case writes its input files, runs one real `moeplan` command in-process (click's runner,
the same `main` the console script calls) and must end in one of two ways:
- exit 0 with valid output (the written trace/placement loads, the printed JSON parses);
- exit 2 with exactly one `error: ...` line and no output file.
Never a traceback, never another exit code, never a changed input file.
"""
from __future__ import annotations

import copy
import hashlib
import io
import json
import math
import traceback
from pathlib import Path

import numpy as np
from click.testing import CliRunner
from hypothesis import strategies as st

from moeplan.planner.cli import main

OK, REFUSED = "ok", "refused"


class FuzzFailure(AssertionError):
    """A case that broke the contract; the message names the command and what went wrong."""


def _digest(path: Path):
    if path.is_dir():
        return {p.relative_to(path).as_posix(): _digest(p) for p in sorted(path.rglob("*")) if p.is_file()}
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.exists() else None


def invoke(args: list):
    """`moeplan ARGS` in this process; click's Result (exit_code, output, exception)."""
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=True)


def run_case(args: list, inputs: list, out: Path | None = None, check_output=None) -> str:
    """Run `moeplan ARGS`; returns OK or REFUSED, raises FuzzFailure otherwise."""
    args = [str(a) for a in args]
    before = {str(p): _digest(Path(p)) for p in inputs}
    result = invoke(args)
    after = {str(p): _digest(Path(p)) for p in inputs}
    where = "moeplan " + " ".join(args)
    if before != after:
        raise FuzzFailure(f"{where}: changed an input file")
    exc = result.exception
    if exc is not None and not isinstance(exc, SystemExit):
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))[-1500:]
        raise FuzzFailure(f"{where}: traceback\n{tb}")
    lines = [l for l in result.output.splitlines() if l.strip()]
    if result.exit_code == 2:
        if len(lines) != 1 or not lines[0].startswith("error: "):
            raise FuzzFailure(f"{where}: exit 2 must print one 'error:' line, got {result.output[-600:]!r}")
        if out is not None and Path(out).exists():
            raise FuzzFailure(f"{where}: refused but wrote {out}")
        return REFUSED
    if result.exit_code != 0:
        raise FuzzFailure(f"{where}: exit {result.exit_code}: {result.output[-600:]!r}")
    if check_output is not None:
        try:
            check_output(result.output)
        except Exception as err:
            raise FuzzFailure(f"{where}: exit 0 but the output is not valid: {err!r}") from None
    return OK


# --------------------------------------------------------------------------------- values

EVIL_SCALARS = [0, 1, 2, 3, -1, -2, 7, 8, 2**31 - 1, 2**31, 2**32 + 3, 2**63 - 1, 2**63, -2**63, 10**400,
                0.5, -0.0, 1e308, 1e-308, math.nan, math.inf, -math.inf, True, False, None, "", "x", "1", "\x00",
                "é" * 3, [], {}, [1, 2], {"a": 1}]
evil_json = st.recursive(st.sampled_from(EVIL_SCALARS) | st.integers() | st.floats() | st.text(max_size=6),
                         lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=4), children, max_size=3),
                         max_leaves=6)


def json_dumps_anything(value) -> str:
    """JSON text for any drawn value: NaN and infinities as Python writes them; 10**400 stays an integer."""
    return json.dumps(value, allow_nan=True)


@st.composite
def mutated_json(draw, doc, max_edits: int = 3):
    """A copy of `doc` with up to `max_edits` values replaced by evil ones or keys deleted."""
    doc = json.loads(json.dumps(doc))
    for _ in range(draw(st.integers(1, max_edits))):
        node, path = doc, []
        while isinstance(node, (dict, list)) and node and draw(st.booleans()):
            key = draw(st.sampled_from(sorted(node) if isinstance(node, dict) else list(range(len(node)))))
            path.append(key)
            node = node[key]
        if not path:
            if isinstance(doc, dict) and doc:
                path = [draw(st.sampled_from(sorted(doc)))]
            else:
                continue
        parent = doc
        for key in path[:-1]:
            parent = parent[key]
        if isinstance(parent, dict) and draw(st.integers(0, 4)) == 0:
            del parent[path[-1]]
        else:
            parent[path[-1]] = copy.deepcopy(draw(evil_json))  # EVIL_SCALARS' lists and dicts are shared
    return doc


@st.composite
def corrupted_bytes(draw, data: bytes):
    """`data` truncated, with bytes flipped, or unchanged."""
    how = draw(st.sampled_from(["same", "truncate", "flip", "garbage"]))
    if how == "truncate" and data:
        return data[:draw(st.integers(0, len(data) - 1))]
    if how == "flip" and data:
        b = bytearray(data)
        for _ in range(draw(st.integers(1, 4))):
            b[draw(st.integers(0, len(b) - 1))] ^= draw(st.integers(1, 255))
        return bytes(b)
    if how == "garbage":
        return draw(st.binary(max_size=64))
    return data


# --------------------------------------------------------------------------------- traces

INT_DTYPES = [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64]
ALL_DTYPES = INT_DTYPES + [np.float16, np.float32, np.float64, np.bool_]


@st.composite
def array(draw, shape, dtype=None, low=-2, high=9):
    """An array of `shape`: values in [low, high] most of the time, else raw bytes (any bit pattern)."""
    dtype = np.dtype(dtype if dtype is not None else draw(st.sampled_from(ALL_DTYPES)))
    n = int(np.prod(shape, dtype=np.int64))
    if draw(st.integers(0, 5)) > 0:
        values = draw(st.lists(st.integers(low, high), min_size=n, max_size=n))
        with np.errstate(all="ignore"):
            return np.array(values, dtype=np.int64).astype(dtype).reshape(shape)
    raw = draw(st.binary(min_size=n * dtype.itemsize, max_size=n * dtype.itemsize))
    return np.frombuffer(raw, dtype=dtype).reshape(shape).copy()


@st.composite
def trace_arrays(draw):
    """The arrays of a trace file: about half plausible (valid or nearly), the rest with wrong
    dtypes, shapes, ranges and scalars mixed in."""
    plausible = draw(st.booleans())
    if plausible:
        T, L, K = draw(st.integers(1, 6)), draw(st.integers(1, 3)), draw(st.integers(1, 2))
    else:
        T, L, K = draw(st.integers(0, 6)), draw(st.integers(0, 3)), draw(st.integers(0, 3))
    well_shaped = plausible or draw(st.booleans())
    shape = (T, L, K) if well_shaped else tuple(draw(st.lists(st.integers(0, 4), max_size=4)))
    dtype = draw(st.sampled_from(INT_DTYPES if well_shaped else ALL_DTYPES))
    arrays = {"experts": draw(array(shape, dtype, low=-1 if plausible else -2, high=5 if plausible else 9))}
    if draw(st.booleans()):
        arrays["weights"] = draw(array(shape if well_shaped else (T,), np.float32, low=0, high=1))
    for name, extra_shape in (("token_ids", (T,)), ("positions", (T,)), ("sequence", (T,)), ("attention_ids", (T, L))):
        if draw(st.integers(0, 3)) == 0:
            good = plausible or draw(st.booleans())
            arrays[name] = draw(array(extra_shape if good else (T + 1,), np.int64 if good else None,
                                      low=0 if good else -2, high=9))
    if draw(st.integers(0, 2)) == 0:
        value = draw(st.sampled_from([8, 6, 0, 1, 4, -3, 2**40, 2**31, 2**64 - 1] if not plausible else [6, 8]))
        dtype = np.uint64 if value > 2**63 else draw(st.sampled_from([np.int64, np.float64] + ([np.uint64] if value >= 0 else [])))
        arrays["num_experts"] = np.asarray(value, dtype=dtype)
    if not plausible and draw(st.integers(0, 4)) == 0:
        arrays["version"] = np.asarray(draw(st.sampled_from([1, 2, 0])), dtype=draw(st.sampled_from([np.int64, np.float64])))
    if not plausible and draw(st.integers(0, 6)) == 0:
        arrays["surprise"] = np.zeros(2)
    return arrays


@st.composite
def trace_file_bytes(draw):
    buf = io.BytesIO()
    np.savez(buf, **draw(trace_arrays()))
    data = buf.getvalue()
    return draw(corrupted_bytes(data)) if draw(st.integers(0, 4)) == 0 else data


def check_placement_file(path):
    from moeplan.passes.optimize.placement.schema import load_placement

    return lambda output: load_placement(path)


def check_json_output(output: str):
    """The printed JSON: the whole output (inspect pretty-prints) or its last line (one object)."""
    try:
        json.loads(output)
    except ValueError:
        json.loads(output.strip().splitlines()[-1])


def check_trace_file(path):
    from moeplan.passes.analysis.trace.format import load_trace

    return lambda output: load_trace(path)


def trace_case(work: Path, data: bytes, command: str) -> str:
    """One trace file through `trace stats`, `place` (eplb or contiguous) or `place --evaluate`."""
    trace = work / "t.npz"
    trace.write_bytes(data)
    out = work / "placement.json"
    if command == "stats":
        return run_case(["trace", "stats", trace, "--json"], [trace], check_output=check_json_output)
    return run_case(["place", "--trace", trace, "--nodes", 1, "--gpus-per-node", 2, "--policy", command,
                     "--out", out, "--json"], [trace], out, check_placement_file(out))


# ------------------------------------------------------------------------------ JSONL logs

@st.composite
def routing_log_bytes(draw):
    """A vLLM-style routing log: a grid of good records, some mutated, some lines garbage."""
    K = draw(st.integers(1, 3))
    lines = []
    for problem in range(draw(st.integers(0, 2))):
        for token in range(draw(st.integers(1, 3))):
            for layer in range(draw(st.integers(1, 2))):
                experts = draw(st.lists(st.integers(-1, 7), min_size=K, max_size=K))
                record = {"problem_id": problem, "layer": layer, "token_idx": token, "experts": experts,
                          "gating_probs": [round(1.0 / (i + 1), 3) for i in range(K)]}
                if draw(st.integers(0, 5)) == 0:
                    record = draw(mutated_json(record, 2))
                lines.append(json_dumps_anything(record))
    if draw(st.integers(0, 5)) == 0:
        lines.insert(draw(st.integers(0, len(lines))), draw(st.text(max_size=20)))
    data = "\n".join(lines).encode("utf-8", "surrogatepass")
    return draw(corrupted_bytes(data)) if draw(st.integers(0, 6)) == 0 else data


def jsonl_case(work: Path, data: bytes, num_experts) -> str:
    log = work / "log.jsonl"
    log.write_bytes(data)
    out = work / "t.npz"
    extra = [] if num_experts is None else ["--num-experts", num_experts]
    return run_case(["trace", "import", log, "--out", out, "--quiet", *extra], [log], out, check_trace_file(out))


# ------------------------------------------------------------------- placements and plans

def placement_case(work: Path, doc, trace: Path) -> str:
    path = work / "placement.json"
    path.write_text(json_dumps_anything(doc))
    return run_case(["place", "--evaluate", path, "--trace", trace, "--json"], [path, trace],
                    check_output=check_json_output)


def plan_case(work: Path, doc, trace: Path) -> str:
    path = work / "plan.json"
    path.write_text(json_dumps_anything(doc))
    return run_case(["simulate", path, "--trace", trace, "--json"], [path, trace], check_output=check_json_output)


# --------------------------------------------------------------------------------- configs

HF_CONFIG = {"model_type": "mixtral", "num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128,
             "num_attention_heads": 4, "num_key_value_heads": 4, "num_local_experts": 8, "num_experts_per_tok": 2,
             "vocab_size": 256}


def config_case(work: Path, data: bytes) -> str:
    model = work / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_bytes(data)
    return run_case(["inspect", model, "--json"], [model], check_output=check_json_output)


@st.composite
def config_bytes(draw):
    doc = draw(mutated_json(HF_CONFIG, 2))
    data = json_dumps_anything(doc).encode()
    return draw(corrupted_bytes(data)) if draw(st.integers(0, 5)) == 0 else data
