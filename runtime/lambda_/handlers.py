"""AWS Lambda entry points of a Lambda bundle: `dense_handler` and `expert_handler`.

Why this shape: every function is told by its environment who it is (MOEPLAN_SPEC, JSON) and
where its weights are (MOEPLAN_BUCKET, MOEPLAN_WEIGHTS: its own S3 prefix, the only one its IAM
role may read). Activations move through the `intermediates/<request>/` prefix (S3 methods) or in
the invoke payload (direct method: the dense function that routes a layer invokes that layer's
expert functions itself, boto3 `lambda.invoke`, and combines their answers). Storage and
invocation are plain boto3 calls, so the same code runs on AWS and against local endpoints
(AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL_LAMBDA). Weights are loaded once per container. The model
is the library's own (`model.py`, built from `model/` beside the runtime in the image).

One Step Functions execution generates a request's tokens: the state machine loops over the
segments once per step (`decode.py`: the execution's state, the rows of a step, the next
tokens), and each dense part reuses the K/V of earlier steps (`kv.py`: the container's
memory, else the deltas every part writes inside its state file). Keys: intermediates/<request>/
t<step>/state-NNN (a part's output), .../layer-LLL/<replica tag>.in|.out (S3 methods).

Dense event: {"state": the execution's state, "segment"}; returns the execution's next state, its
`active` naming the expert replicas the state machine must run next (S3 methods). Expert event (S3
methods): {"request", "step"}; (direct): {"request", "step", "rows": base64 tensor file} -> {"out":
base64 tensor file}. An expert's input file holds `rows` [m, D] and gate weights `w` [m]; its
output `y` [m, D] is weighted.
"""
from __future__ import annotations

import base64
import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from . import decode
from . import kv
from . import wire
from .model import DenseShare, ExpertShare, build, model_dir_of

_CACHE = {}
IO = {"get_bytes": 0, "put_bytes": 0, "gets": 0, "puts": 0}  # storage traffic of this process (read by local runs)
ACCESS = []  # (operation, key) of this invocation, so a local run can check them against the IAM policy
MODEL_DIR = model_dir_of(Path(__file__).resolve().parents[1])  # functions/model/ in the image, beside runtime/


def prewarm() -> None:
    """Create the boto3 clients and import the model's library code, as a container's init would
    (the local zygote calls this once before forking, so functions do not each pay for it)."""
    import boto3

    _CACHE["s3"] = boto3.client("s3")
    _CACHE["lambda"] = boto3.client("lambda")
    build(MODEL_DIR, device="meta")


def _spec() -> dict:
    return json.loads(os.environ["MOEPLAN_SPEC"])


def _s3():
    if "s3" not in _CACHE:
        import boto3

        _CACHE["s3"] = boto3.client("s3")
    return _CACHE["s3"]


def _get(key: str) -> bytes:
    data = _s3().get_object(Bucket=os.environ["MOEPLAN_BUCKET"], Key=key)["Body"].read()
    IO["get_bytes"] += len(data)
    IO["gets"] += 1
    ACCESS.append(("get", key))
    return data


def _put(key: str, data: bytes) -> None:
    _s3().put_object(Bucket=os.environ["MOEPLAN_BUCKET"], Key=key, Body=data)
    IO["put_bytes"] += len(data)
    IO["puts"] += 1
    ACCESS.append(("put", key))


def _share(make):
    """This function's share of the model, built once per container from its own weight prefix."""
    if "share" not in _CACHE:
        prefix = os.environ["MOEPLAN_WEIGHTS"]
        tensors = {k: v.float() for k, v in wire.from_bytes(_get(prefix + "weights.safetensors")).items()}
        _CACHE["share"] = make(tensors)
    return _CACHE["share"]


def _key(request: str, step: int, name: str) -> str:
    """S3 key of one step's file: intermediates/<request>/t<step>/<name>."""
    if not request or "/" in request or ".." in request:
        raise ValueError(f"bad request id {request!r}")
    return f"intermediates/{request}/t{int(step):05d}/{name}"


def _tag(layer: int, expert: int, replica: int) -> str:
    return f"L{layer}E{expert}R{replica}"


def _kv_store() -> kv.Store:
    if "kv" not in _CACHE:
        _CACHE["kv"] = kv.Store(int(_spec().get("kv_budget_bytes", 0)))
    return _CACHE["kv"]


def dense_handler(event, context=None):
    """One step of one segment of a request's generation, with the library's model: build or read
    the step's rows, combine the previous MoE layer's expert outputs (S3: gathered here; direct:
    already in the state), run the part attending to this part's K/V from earlier steps
    (`kv`), then hand the next MoE layer's rows to its expert functions (S3 files, or
    direct invocation and combine), or, at the logits, pick every sequence's next token.
    Event: {"state": the execution's state, "segment"}; returns the execution's next state."""
    torch.set_num_threads(int(os.environ.get("MOEPLAN_THREADS", "1")))
    spec = _spec()
    share = _share(lambda w: DenseShare(MODEL_DIR, w))
    doc, segment = dict(event["state"]), int(event["segment"])
    request, step = str(doc["request"]), int(doc["step"])
    part = next(p for p in spec["segments"] if p["segment"] == segment)
    if part["start"]["at"] == "ids":
        state = decode.step_rows(doc)
        doc.pop("prompt", None)  # only the first step's first part reads it
    else:
        state = wire.from_bytes(_get(_key(request, step, part["read"])))
        state = {k: v for k, v in state.items() if not k.startswith(kv.KV_PREFIX)}
    routed = state.pop("routed", None)
    gather = part.get("gather")
    if gather is not None:  # S3 method: the experts of the previous layer wrote their outputs
        layer = int(gather["layer"])
        replicas = {int(e): int(g) for e, g in gather["replicas"].items()}
        outputs = {}
        for e, g in replicas.items():
            for r, (tok, _) in enumerate(wire.assignment(state["route_ids"], e, g)):
                if tok.numel():
                    key = _key(request, step, f"layer-{layer:03d}/{_tag(layer, e, r)}.out")
                    outputs[(e, r)] = wire.from_bytes(_get(key))["y"]
        routed = wire.routed_sum(state["route_ids"], outputs, replicas, state["x"].shape[1])
    store, part_key = _kv_store(), f"s{segment:03d}"
    keeps = bool(share.own_layers(part))  # a part without attention (the final norm and head) has no K/V
    past, append = store.load(request, part_key, step, lambda t: _read_kv(request, t, part["write"])) if keeps else ({}, {})
    try:
        state, routing, after, grow = share.run(state, part, routed, past)
    except Exception:
        store.forget(request, part_key)
        raise
    more = keeps and decode.has_next_step(doc)  # else nothing reads this part's K/V again
    tensors, meta = {}, {}
    if more:
        store.keep(request, part_key, step + 1, after, grow)
        tensors, meta = kv.to_file(kv.delta_of(after, grow, decode.rows_per_sequence(state)), grow)
    else:
        store.forget(request, part_key)
    doc["active"] = {}
    scatter = part.get("scatter")
    if scatter is not None:
        layer, replicas = int(scatter["layer"]), {int(e): int(g) for e, g in scatter["replicas"].items()}
        h, ids, weights = routing
        jobs = wire.expert_jobs(h, ids, weights, replicas)
        if scatter["method"] == "direct":
            state["routed"] = wire.routed_sum(ids, _invoke_direct(request, step, scatter, jobs), replicas, h.shape[1])
        else:
            for e, r, rows, w in jobs:
                tag = _tag(layer, e, r)
                _put(_key(request, step, f"layer-{layer:03d}/{tag}.in"), wire.to_bytes({"rows": rows, "w": w}))
                doc["active"][tag] = 1
    if part["stop"]["at"] == "logits":
        doc = decode.advance(doc, state)
        if not doc["gen"].get("keep_logits"):
            state = {}
    if state or tensors:
        _put(_key(request, step, part["write"]), wire.to_bytes({**state, **tensors}, {"kv": meta}))
    return doc


def _read_kv(request: str, step: int, name: str) -> tuple:
    """(delta, append) this part wrote at `step` (inside its state file), for a container without it."""
    data = _get(_key(request, step, name))
    return kv.from_file(wire.from_bytes(data), wire.meta_of(data).get("kv", {}))


def _invoke_direct(request: str, step: int, scatter: dict, jobs: list) -> dict:
    """Invoke each expert replica with its rows in the payload; split rows that exceed the payload limit."""
    import boto3

    if "lambda" not in _CACHE:
        _CACHE["lambda"] = boto3.client("lambda")
    client = _CACHE["lambda"]
    limit = int(scatter["payload_limit"])
    names = scatter["functions"]

    def call(job):
        e, r, rows, w = job
        pieces, start = [], 0
        while start < rows.shape[0]:
            n = rows.shape[0] - start
            while True:
                data = wire.to_bytes({"rows": rows[start:start + n], "w": w[start:start + n]})
                body = json.dumps({"request": request, "step": step, "rows": base64.b64encode(data).decode()})
                if len(body) <= limit or n == 1:
                    break
                n = max(1, n // 2)
            name = f"{os.environ['MOEPLAN_STACK']}-{names[_tag(int(scatter['layer']), e, r)]}"
            reply = client.invoke(FunctionName=name, Payload=body.encode())
            if reply.get("FunctionError"):
                raise RuntimeError(f"expert {e} replica {r} failed: {reply['Payload'].read()[:300]!r}")
            out = json.loads(reply["Payload"].read())
            pieces.append(wire.from_bytes(base64.b64decode(out["out"]))["y"])
            start += n
        return (e, r), torch.cat(pieces)

    with ThreadPoolExecutor(max_workers=max(1, min(8, len(jobs)))) as pool:
        return dict(pool.map(call, jobs))


def expert_handler(event, context=None):
    """One expert replica: read its rows and gate weights (S3 or payload), run the library's experts
    module on them, answer the weighted outputs the same way."""
    torch.set_num_threads(int(os.environ.get("MOEPLAN_THREADS", "1")))
    spec = _spec()
    share = _share(lambda w: ExpertShare(MODEL_DIR, w, int(spec["layer"]), int(spec["expert"])))
    request, step = str(event["request"]), int(event["step"])
    if "rows" in event:
        got = wire.from_bytes(base64.b64decode(event["rows"]))
    else:
        got = wire.from_bytes(_get(_key(request, step, f"layer-{spec['layer']:03d}/{spec['tag']}.in")))
    rows, w = got["rows"], got["w"]
    beta = int(spec.get("beta") or 0)
    if spec["method"] == "pipelined_s3" and beta > 0:  # minibatches of beta rows
        y = torch.cat([share.run(rows[i:i + beta], w[i:i + beta]) for i in range(0, rows.shape[0], beta)])
    else:
        y = share.run(rows, w)
    if "rows" in event:
        return {"out": base64.b64encode(wire.to_bytes({"y": y})).decode()}
    _put(_key(request, step, f"layer-{spec['layer']:03d}/{spec['tag']}.out"), wire.to_bytes({"y": y}))
    return {"request": request}
