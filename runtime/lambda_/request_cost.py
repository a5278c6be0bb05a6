"""What one generation request costs on a Lambda deployment: billed GB-s, request charges, latency.

Why in the runtime, dependency-free: the deployed front function states this prediction in every
response (runtime/lambda_/front.py) and `moeplan simulate` computes it from plan.json; both must run
the very same code on the very same spec (`predicted.request_cost`, built by
passes/optimize/serverless/request_spec.py from the plan's facts), as the offload simulator and the
ranks share the runtime's offload/ modules. Only the standard library.

The generation of `new` tokens after a `prompt`-token prompt (B sequences), two ways:
* "kv" (the bundle's way): one execution; step 0 runs the prompt's B x prompt rows, each later step
  B rows (one token per sequence) attending to the K/V the dense functions kept; a part writes its
  K/V delta inside the state file it writes anyway, except at the last step;
* "recompute" (the former way): `new` executions, the i-th the forward of all B x (prompt + i) rows.
Per forward step, in state-machine order, each dense part is one invocation billed for: warm start
(+ its weights from S3 under the paper's accounting, `weights_per_invocation`), reading its input
state (S3: one latency + bytes), reading the previous S3-method layer's expert outputs (one GET per
invoked replica), its compute at the step's token count (the profile's per-part seconds, log-
interpolated between grid points), writing expert inputs (one PUT per invoked replica; direct
method: invoking them and waiting for the slowest), and its output state (+ K/V bytes). Expert
replicas follow serverless/billing.py's replica times (Eqs. 3-11, warm start without the weights'
download unless `weights_per_invocation`). Expected loads: expert i gets d = T k s_i rows of a
T-token step (s_i its planned share), is invoked with probability p = 1 - (1 - k s_i)^T, then
with d / p rows over min(replicas, ceil(d / p)) replicas. `cold_kv`: every decode step of a
part that keeps K/V reads all earlier deltas (one GET each) instead of finding them in memory.
Dollars by the one billing rule (charges.py). Latency: the parts' and the S3-method layers' times in sequence (Step Functions' own transition
time is not modelled); it bills the front function (which waits for the synchronous execution)
and the EXPRESS execution (per 100 ms, 64 MB chunks). Attention's context-dependent work in decode
steps is not in the profile and not modelled.
"""
from __future__ import annotations

import math

from .charges import billed_gb_seconds, charges_usd, express_gb_seconds, request_charges_usd

SPEC_VERSION = 1


def _interp_per_token(grid: list, values: list, tokens: float) -> float:
    """values[i] are totals at grid[i] tokens; per-token time is interpolated in log tokens (flat outside)."""
    per = [v / g for v, g in zip(values, grid)]
    x = math.log(max(tokens, 1.0))
    xs = [math.log(g) for g in grid]
    if x <= xs[0]:
        return per[0]
    if x >= xs[-1]:
        return per[-1]
    for i in range(1, len(xs)):
        if x <= xs[i]:
            f = (x - xs[i - 1]) / (xs[i] - xs[i - 1])
            return per[i - 1] + f * (per[i] - per[i - 1])
    return per[-1]


def _expert_u(layer: dict, memory_mb: float, tokens: float) -> float:
    """Per-token expert compute at a memory size (serverless/billing.py LayerFacts.u)."""
    v = min(memory_mb / layer["mb_per_vcpu"], layer["max_vcpus"])
    grid = layer["tokens_grid"]
    best = None
    for t, row in zip(layer["threads"], layer["s_per_token"]):
        per = _interp_per_token(grid, [r * g for r, g in zip(row, grid)], tokens) * max(1.0, t / v)
        best = per if best is None else min(best, per)
    return best


def _replica_seconds(p: dict, layer: dict, memory_mb: float, rows: float, weights: bool) -> float:
    """t^rep of one replica for `rows` rows (serverless/billing.py replica_time)."""
    bs, bf, dl = p["s3_bandwidth_bytes_per_s"], p["f2f_bandwidth_bytes_per_s"], p["s3_latency_s"]
    head = p["warm_start_s"] + ((layer["param_bytes"] / bs + dl) if weights else 0.0)
    method, d_in, d_out = layer["method"], layer["d_in"], layer["d_out"]
    if method == "pipelined_s3":
        b = max(min(float(layer["beta"]), rows), 1.0)
        step = dl + b * max(d_in / bs + _expert_u(layer, memory_mb, b), d_out / bs)
        return head + dl + b * d_out / bs + math.ceil(rows / b) * step
    u = _expert_u(layer, memory_mb, rows)
    if method == "s3":
        return head + 2 * dl + rows * ((d_in + d_out) / bs + u)
    return head + rows * (d_out / bf + u)


def _expert_loads(layer: dict, tokens: float) -> list:
    """Per expert: (probability it is invoked, replicas invoked, rows per replica) for a T-token step."""
    k = layer["top_k"]
    out = []
    for x in layer["experts"]:
        pick = min(1.0, k * x["share"])
        prob = 1.0 if pick >= 1.0 else -math.expm1(tokens * math.log1p(-pick)) if pick > 0 and tokens > 0 else 0.0
        if prob <= 0.0:  # (also where pick is too small for the probability to be told from 0)
            out.append((0.0, 0, 0))
            continue
        rows = tokens * pick / prob
        g = max(1, min(int(x["replicas"]), math.ceil(rows - 1e-9)))
        out.append((prob, g, math.ceil(rows / g - 1e-9)))
    return out


class _Bill:
    def __init__(self, p: dict):
        self.p, self.gb_s, self.invocations, self.puts, self.gets = p, 0.0, 0.0, 0.0, 0.0

    def invoke(self, seconds: float, memory_mb: float, times: float = 1.0) -> None:
        self.gb_s += times * billed_gb_seconds(seconds, memory_mb, self.p["billing_granularity_s"])
        self.invocations += times


def _forward(spec: dict, bill: _Bill, tokens: int, past: int, step: int, writes_kv: bool, o: dict) -> float:
    """Bill one forward step of `tokens` rows (all sequences) attending to `past` earlier columns; its latency."""
    p = spec["platform"]
    bs, dl = p["s3_bandwidth_bytes_per_s"], p["s3_latency_s"]
    weights, cold = o["weights_per_invocation"], o["cold_kv"]
    loads = {i: _expert_loads(layer, tokens) for i, layer in enumerate(spec["layers"])}
    latency = 0.0
    for part in spec["parts"]:
        t = p["warm_start_s"] + ((part["param_bytes"] / bs + dl) if weights else 0.0)
        if part["reads_state"]:
            t += dl + tokens * part["in_bytes_per_token"] / bs
            bill.gets += 1
        gather = part.get("gather")
        if gather is not None:
            layer = spec["layers"][gather]
            for prob, g, rows in loads[gather]:
                t += prob * g * (dl + rows * layer["d_out"] / bs)
                bill.gets += prob * g
        t += tokens * _interp_per_token(spec["grid"], part["seconds"], tokens)
        if cold and step > 0 and part["kv_bytes_per_token"] > 0:
            t += step * dl + past * part["kv_bytes_per_token"] / bs
            bill.gets += step
        scatter = part.get("scatter")
        if scatter is not None:
            layer = spec["layers"][scatter]
            if layer["method"] == "direct":
                wait = 0.0
                for x, (prob, g, rows) in zip(layer["experts"], loads[scatter]):
                    if prob > 0:
                        rep = _replica_seconds(p, layer, x["memory_mb"], rows, weights)
                        bill.invoke(rep, x["memory_mb"], prob * g)
                        wait = max(wait, rows * layer["d_in"] / p["f2f_bandwidth_bytes_per_s"] + rep)
                t += wait
            else:
                for prob, g, rows in loads[scatter]:
                    t += prob * g * (dl + rows * layer["d_in"] / bs)
                    bill.puts += prob * g
        out_bytes = tokens * (0 if part["logits"] else part["out_bytes_per_token"])
        kv_bytes = tokens * part["kv_bytes_per_token"] if writes_kv else 0
        if not part["logits"] or kv_bytes:
            t += dl + (out_bytes + kv_bytes) / bs
            bill.puts += 1
        bill.invoke(t, part["memory_mb"])
        latency += t
        if scatter is not None and spec["layers"][scatter]["method"] != "direct":
            layer, slowest = spec["layers"][scatter], 0.0
            for x, (prob, g, rows) in zip(layer["experts"], loads[scatter]):
                if prob > 0:
                    rep = _replica_seconds(p, layer, x["memory_mb"], rows, weights)
                    bill.invoke(rep, x["memory_mb"], prob * g)
                    bill.gets += prob * g
                    bill.puts += prob * g
                    slowest = max(slowest, rep)
            latency += slowest
    return latency


def request_cost(spec: dict, prompt_tokens: int, new_tokens: int, sequences: int = 1, mode: str = "kv",
                 weights_per_invocation: bool = False, cold_kv: bool = False) -> dict:
    """Billed Lambda GB-s, request counts, dollars and latency of one generation request."""
    if spec.get("version") != SPEC_VERSION:
        raise ValueError(f"request cost spec version {spec.get('version')!r}; this code reads {SPEC_VERSION}")
    if mode not in ("kv", "recompute"):
        raise ValueError(f"mode must be 'kv' or 'recompute', got {mode!r}")
    P, n, B = int(prompt_tokens), int(new_tokens), int(sequences)
    if P < 1 or n < 1 or B < 1:
        raise ValueError("prompt_tokens, new_tokens and sequences must be at least 1")
    p = spec["platform"]
    o = {"weights_per_invocation": bool(weights_per_invocation), "cold_kv": bool(cold_kv) and mode == "kv"}
    bill = _Bill(p)
    if mode == "kv":
        steps = [_forward(spec, bill, B * P if t == 0 else B, 0 if t == 0 else P + t - 1, t, t + 1 < n, o) for t in range(n)]
        executions = [sum(steps)]
    else:  # execution i: the whole sequence so far, one token out
        executions = [_forward(spec, bill, B * (P + i), 0, 0, False, o) for i in range(n)]
    latency = sum(executions)
    front = spec["front"]
    functions_gb_s = bill.gb_s
    bill.invoke(front["seconds"] + latency, front["memory_mb"])
    express_gb_s = express_gb_seconds(executions, p)
    executions = len(executions)
    usd = charges_usd({**p, "http_request_price": spec.get("http_request_price", 0.0)}, gb_s=bill.gb_s,
                      invocations=bill.invocations, s3_puts=bill.puts, s3_gets=bill.gets, executions=executions,
                      express_gb_s=express_gb_s, http_requests=1)
    return {"mode": mode, "prompt_tokens": P, "new_tokens": n, "sequences": B, "executions": executions,
            "lambda_gb_s": bill.gb_s, "front_gb_s": bill.gb_s - functions_gb_s, "lambda_invocations": bill.invocations,
            "s3_puts": bill.puts, "s3_gets": bill.gets, "express_gb_s": express_gb_s, "latency_s": latency, "usd": usd,
            "request_charges_usd": request_charges_usd(usd, executions, p)}
