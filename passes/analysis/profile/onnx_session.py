"""Profile an ONNX MoE model with onnxruntime's session profiler, per IR unit.

Why: an ONNX import has no torch modules to time one by one, but onnxruntime records every node's
kernel time. Each node is attributed to the unit (dense stage or expert) whose weights it reads
(initializer names are the torch parameter names, e.g. `blocks.0.moe.experts.3.w_up.weight`);
nodes that read no weight inherit the unit of the node that produced their first input, so
softmaxes and activations follow their matmuls. Graph optimisations are disabled so that node
names survive. Experts: a full-model run routes tokens x k / E tokens to an expert on average,
so each expert unit gets its layer's summed expert time split evenly at that token count.
Memory is not per node in onnxruntime: intermediate bytes are estimated from the IR (marked).
"""
from __future__ import annotations

import json
import math
import os
import statistics
import tempfile
from pathlib import Path

import numpy as np

from moeplan.core.errors import UserError

SEQ_LEN = 128
REPS = 3


def _unit_of_param(name: str, units_by_prefix: list) -> str | None:
    for prefix, unit in units_by_prefix:
        if name == prefix or name.startswith(prefix + "."):
            return unit
    return None


def node_units(model, units) -> dict:
    """ONNX node name -> unit name, by the weights each node reads (see module docstring)."""
    by_prefix = []
    for u in units:
        if u.kind == "expert":
            stage, _, idx = u.name.rpartition(".expert")
            by_prefix.append((f"{stage}.experts.{idx}", u.name))
        elif not u.name.endswith(".router"):
            by_prefix.append((u.name, u.name))
        else:
            by_prefix.append((u.name[: -len(".router")] + ".gate", u.name))
    by_prefix.sort(key=lambda p: -len(p[0]))  # longest prefix first
    inits = {i.name for i in model.graph.initializer}
    producer_unit, out = {}, {}
    for node in model.graph.node:
        unit = None
        for name in node.input:
            if name in inits:
                unit = _unit_of_param(name, by_prefix)
                if unit:
                    break
        if unit is None:
            for name in node.input:
                if name in producer_unit:
                    unit = producer_unit[name]
                    break
        if unit is not None:
            out[node.name] = unit
            for o in node.output:
                producer_unit[o] = unit
    return out


def measure_onnx(onnx_path: str, ir, units, tokens_grid, threads) -> list:
    """Rows like `operators.measure`, from onnxruntime's per-node kernel times."""
    import onnx
    import onnxruntime as ort

    model = onnx.load(str(onnx_path), load_external_data=False)
    mapping = node_units(model, units)
    unit_info = {u.name: u for u in units}
    top_k = {f"layer{s.moe_index}": (s.top_k, s.num_experts) for s in ir.moe_stages}
    inp = model.graph.input[0].name
    rows = []
    for tokens in tokens_grid:
        s = min(tokens, SEQ_LEN)
        b = math.ceil(tokens / s)
        real = b * s
        ids = np.random.default_rng(tokens).integers(0, max(ir.vocab_size, 1), size=(b, s), dtype=np.int64)
        for th in threads:
            per_unit = {}
            with tempfile.TemporaryDirectory() as tmp:
                opts = ort.SessionOptions()
                opts.intra_op_num_threads = int(th)
                opts.inter_op_num_threads = 1
                opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
                opts.enable_profiling = True
                opts.profile_file_prefix = os.path.join(tmp, "ort")
                try:
                    sess = ort.InferenceSession(str(onnx_path), opts, providers=["CPUExecutionProvider"])
                    for _ in range(REPS + 1):
                        sess.run(None, {inp: ids})
                    trace_file = sess.end_profiling()
                except Exception as exc:  # onnxruntime raises its own exception types
                    raise UserError(f"onnxruntime cannot run '{onnx_path}' for profiling ({exc.__class__.__name__}); check the model runs with onnxruntime") from None
                events = json.loads(Path(trace_file).read_text())
            runs = {}
            run_idx = -1
            for ev in events:
                if ev.get("cat") == "Session" and ev.get("name") == "model_run":
                    run_idx += 1
                if ev.get("cat") != "Node" or not ev.get("name", "").endswith("_kernel_time"):
                    continue
                node = ev["name"][: -len("_kernel_time")]
                unit = mapping.get(node)
                if unit is not None:
                    runs.setdefault(unit, []).append(ev["dur"] * 1e-6)
            for unit, durs in runs.items():
                # durations of REPS+1 runs interleaved; the median run total is robust to load
                per_unit[unit] = statistics.median(_per_run(durs, REPS + 1))
            expert_layers = {}
            for unit, secs in per_unit.items():
                u = unit_info[unit]
                if u.kind == "expert":
                    expert_layers.setdefault(u.group, 0.0)
                    expert_layers[u.group] += secs
            for u in units:
                if u.kind == "expert":
                    total = expert_layers.get(u.group)
                    if not total:
                        continue
                    k, _ = top_k[u.group]
                    secs = total / (real * k) * tokens  # the layer's per routed token time
                elif u.name in per_unit:
                    secs = per_unit[u.name] * tokens / real
                else:
                    continue
                rows.append({"unit": u.name, "kind": u.kind, "group": u.group, "flops_per_token": int(u.flops_per_token),
                             "param_bytes": int(u.param_bytes), "tokens": int(tokens), "threads": int(th),
                             "seconds": float(max(secs, 1e-7)), "peak_bytes": float(_estimated_bytes(u, tokens, ir)),
                             "estimated": False, "memory_estimated": True, "source": "onnxruntime"})
    return rows


def _per_run(durs, runs):
    """Split a unit's node durations (in run order) into equal per-run chunks and sum each."""
    n = len(durs) // runs
    if n == 0:
        return [sum(durs)]
    return [sum(durs[i * n:(i + 1) * n]) for i in range(runs)][1:]  # drop the warm-up run


def _estimated_bytes(u, tokens, ir) -> float:
    """fp32 intermediates: an expert holds ~ its inner width x 3 per token, a dense stage ~ 4 x hidden."""
    hidden = max(ir.hidden_size, 1)
    if u.kind == "expert":
        inner = u.param_bytes / 4 / hidden / 3 if u.param_bytes else hidden
        return tokens * 4.0 * (3 * inner + hidden)
    return tokens * 4.0 * 4 * hidden
