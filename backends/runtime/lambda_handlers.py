"""AWS Lambda entry points of a Lambda bundle: `dense_handler` and `expert_handler`.

Why this shape: every function is told by its environment who it is (MOEPLAN_SPEC, JSON) and
where its weights are (MOEPLAN_BUCKET, MOEPLAN_WEIGHTS: its own S3 prefix, the only one its IAM
role may read). Activations move through the `intermediates/<request>/` prefix (S3 methods) or in
the invoke payload (direct method: the dense function that routes a layer invokes that layer's
expert functions itself, boto3 `lambda.invoke`, and combines their answers). Storage and
invocation are plain boto3 calls, so the same code runs on AWS and against local endpoints
(AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL_LAMBDA). Weights are loaded once per container.

Dense event: {"request", "segment"}; returns {"request", "active": {"L<l>E<e>R<r>": 1, ...}} naming
the expert replicas the state machine must run next (S3 methods). Expert event (S3 methods):
{"request"}; (direct): {"request", "rows": base64 tensor file} -> {"out": base64 tensor file}.
"""
from __future__ import annotations

import base64
import json
import os
from concurrent.futures import ThreadPoolExecutor

import torch

from . import lambda_ops as ops

_CACHE = {}
IO = {"get_bytes": 0, "put_bytes": 0, "gets": 0, "puts": 0}  # storage traffic of this process (read by local runs)
ACCESS = []  # (operation, key) of this invocation, so a local run can check them against the IAM policy


def prewarm() -> None:
    """Create the boto3 clients and run one tiny op, as a container's init would (the local zygote
    calls this once before forking, so functions do not each pay botocore's model loading)."""
    import boto3

    _CACHE["s3"] = boto3.client("s3")
    _CACHE["lambda"] = boto3.client("lambda")
    with torch.no_grad():
        ops.expert_ffn({"p.w_gate.weight": torch.ones(2, 2), "p.w_up.weight": torch.ones(2, 2),
                        "p.w_down.weight": torch.ones(2, 2)}, "p", ops.from_bytes(ops.to_bytes({"r": torch.ones(1, 2)}))["r"])


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


def _weights() -> tuple:
    """(tensors, model config) from this function's own weight prefix, loaded once."""
    if "weights" not in _CACHE:
        prefix = os.environ["MOEPLAN_WEIGHTS"]
        tensors = {k: v.float() for k, v in ops.from_bytes(_get(prefix + "weights.safetensors")).items()}
        _CACHE["weights"] = (tensors, json.loads(_get(prefix + "config.json")))
    return _CACHE["weights"]


def _key(request: str, name: str) -> str:
    if not request or "/" in request or ".." in request:
        raise ValueError(f"bad request id {request!r}")
    return f"intermediates/{request}/{name}"


def _tag(layer: int, expert: int, replica: int) -> str:
    return f"L{layer}E{expert}R{replica}"


def dense_handler(event, context=None):
    """Run this slice's units of one segment: gather the previous MoE layer, compute, scatter the next."""
    torch.set_num_threads(int(os.environ.get("MOEPLAN_THREADS", "1")))
    spec = _spec()
    w, config = _weights()
    request, segment = str(event["request"]), int(event["segment"])
    part = next(p for p in spec["segments"] if p["segment"] == segment)
    state = ops.from_bytes(_get(_key(request, part["read"])))
    gather = part.get("gather")
    if gather is not None:  # S3 method: the experts of the previous layer wrote their outputs
        replicas = {int(e): int(g) for e, g in gather["replicas"].items()}
        outputs = {}
        for e, g in replicas.items():
            for r, (tok, _) in enumerate(ops.assignment(state["route_ids"], e, g)):
                if tok.numel():
                    outputs[(e, r)] = ops.from_bytes(_get(_key(request, f"layer-{gather['layer']:03d}/{_tag(gather['layer'], e, r)}.out")))["y"]
        ops.combine(state, outputs, replicas)
    with torch.no_grad():
        for unit in part["units"]:
            ops.run_unit(unit, w, state, config)
    active = {}
    scatter = part.get("scatter")
    if scatter is not None:
        layer, replicas = int(scatter["layer"]), {int(e): int(g) for e, g in scatter["replicas"].items()}
        jobs = []
        for e, g in sorted(replicas.items()):
            for r, (tok, _) in enumerate(ops.assignment(state["route_ids"], e, g)):
                if tok.numel():
                    jobs.append((e, r, state["h"][tok]))
        if scatter["method"] == "direct":
            outputs = _invoke_direct(request, scatter, jobs)
            ops.combine(state, outputs, replicas)
        else:
            for e, r, rows in jobs:
                tag = _tag(layer, e, r)
                _put(_key(request, f"layer-{layer:03d}/{tag}.in"), ops.to_bytes({"rows": rows}))
                active[tag] = 1
    _put(_key(request, part["write"]), ops.to_bytes(state))
    return {"request": request, "active": active}


def _invoke_direct(request: str, scatter: dict, jobs: list) -> dict:
    """Invoke each expert replica with its rows in the payload; split rows that exceed the payload limit."""
    import boto3

    if "lambda" not in _CACHE:
        _CACHE["lambda"] = boto3.client("lambda")
    client = _CACHE["lambda"]
    limit = int(scatter["payload_limit"])
    names = scatter["functions"]

    def call(job):
        e, r, rows = job
        pieces, start = [], 0
        while start < rows.shape[0]:
            n = rows.shape[0] - start
            while True:
                body = json.dumps({"request": request, "rows": base64.b64encode(ops.to_bytes({"rows": rows[start:start + n]})).decode()})
                if len(body) <= limit or n == 1:
                    break
                n = max(1, n // 2)
            name = f"{os.environ['MOEPLAN_STACK']}-{names[_tag(int(scatter['layer']), e, r)]}"
            reply = client.invoke(FunctionName=name, Payload=body.encode())
            if reply.get("FunctionError"):
                raise RuntimeError(f"expert {e} replica {r} failed: {reply['Payload'].read()[:300]!r}")
            out = json.loads(reply["Payload"].read())
            pieces.append(ops.from_bytes(base64.b64decode(out["out"]))["y"])
            start += n
        return (e, r), torch.cat(pieces)

    with ThreadPoolExecutor(max_workers=max(1, min(8, len(jobs)))) as pool:
        return dict(pool.map(call, jobs))


def expert_handler(event, context=None):
    """One expert replica: read its rows (S3 or payload), run the SwiGLU expert, answer the same way."""
    torch.set_num_threads(int(os.environ.get("MOEPLAN_THREADS", "1")))
    spec = _spec()
    w, _ = _weights()
    prefix = f"blocks.{spec['layer']}.moe.experts.{spec['expert']}"
    request = str(event["request"])
    if "rows" in event:
        rows = ops.from_bytes(base64.b64decode(event["rows"]))["rows"]
    else:
        rows = ops.from_bytes(_get(_key(request, f"layer-{spec['layer']:03d}/{spec['tag']}.in")))["rows"]
    beta = int(spec.get("beta") or 0)
    with torch.no_grad():
        if spec["method"] == "pipelined_s3" and beta > 0:  # minibatches of beta rows
            y = torch.cat([ops.expert_ffn(w, prefix, rows[i:i + beta]) for i in range(0, rows.shape[0], beta)])
        else:
            y = ops.expert_ffn(w, prefix, rows)
    if "rows" in event:
        return {"out": base64.b64encode(ops.to_bytes({"y": y})).decode()}
    _put(_key(request, f"layer-{spec['layer']:03d}/{spec['tag']}.out"), ops.to_bytes({"y": y}))
    return {"request": request}
