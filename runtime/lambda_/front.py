"""The front function of a Lambda bundle: the OpenAI API over the bundle's state machine.

Why a function in front: a client sends the same `/v1/completions` or `/v1/chat/completions`
request it sends to the torchrun service (`serving/openai_service.py` does all of the API: request
checks, chat template, stop strings, response and error shapes, SSE, /metrics); this file only
puts that service behind a Lambda Function URL or an API Gateway HTTP API (payload format 2.0
events, the same for both) and gives it an engine that runs each request as one synchronous
EXPRESS execution (`StartSyncExecution`): the execution's input is the prompt's ids and the
sampling settings (`decode.initial_state`), its output the generated ids.

Limits, checked before a request starts (400, OpenAI-shaped, naming what fits): the entry's time
limit (API Gateway HTTP API: 30 s; Function URL: the 5 minutes of an EXPRESS execution) against the
plan's predicted latency of this prompt and max_tokens, and the 256 KB input of a Step Functions
execution. A request the state machine fails is a 503.

Cost: every generation answer carries the billed GB-s, request charges and dollars the plan's cost
model predicts for it (`request_cost.py`, the module `moeplan simulate` runs, on the spec in
request_cost.json: `moeplan simulate plan.json --prompt-tokens P --new-tokens N` prints the same),
in `X-Moeplan-*` headers (the dollars by charge, Lambda duration and requests, S3 requests, the
EXPRESS execution and the HTTP API's fee, in X-Moeplan-Cost-Breakdown-Usd) and summed in /metrics (per container on AWS; one process locally).
Streaming answers arrive whole (the execution returns all tokens at once; BUFFERED invoke mode).
Environment: MOEPLAN_STATE_MACHINE (ARN), MOEPLAN_API_KEY (empty: no key); front.json beside the
runtime: model_name, max_context, time_limit_s. No torch: the image is small.
"""
from __future__ import annotations

import asyncio
import base64
import json
import os
import re
import threading
import time
from pathlib import Path

from .state import initial_state
from .request_cost import request_cost
from ..serving import contract as C
from ..serving.openai_service import OpenAIService
from ..serving.prometheus import _family
from ..serving.served_model import ServedModel

RUNTIME = Path(__file__).resolve().parents[1]  # the runtime package (this file is runtime/lambda_/front.py)
STATE_LIMIT_BYTES = 256 * 1024  # a Step Functions execution's input and state
COST_HEADERS = ("x-moeplan-billed-gb-seconds", "x-moeplan-request-charges-usd", "x-moeplan-predicted-cost-usd",
                "x-moeplan-forward-steps", "x-moeplan-prompt-tokens")
BREAKDOWN_HEADER = "x-moeplan-cost-breakdown-usd"  # charge=dollars; ... (charges.py's names), the total's parts
_SERVICE = {}


class LambdaEngine:
    """EngineClient over StartSyncExecution: a request runs to its end in one execution."""

    def __init__(self, model_name: str, max_context: int, state_machine: str, spec: dict, time_limit_s: float, sfn):
        self.model_name, self.max_context, self.state_machine = model_name, int(max_context), state_machine
        self.spec, self.time_limit_s, self.sfn = spec, float(time_limit_s), sfn
        self.lock = threading.Lock()
        self.running, self.draining, self.cancelled = 0, False, set()
        self.costs = {}   # request id -> predicted cost, read once by the answer
        self.totals = {"gb_s": 0.0, "request_charges_usd": 0.0, "usd": 0.0, "steps": 0, "requests": 0}

    # --- EngineClient ---------------------------------------------------------------------------
    def submit(self, request: C.GenerationRequest, sink) -> None:
        if self.draining:
            raise C.Unavailable("the front is shutting down")
        prompt = len(request.prompt_ids)
        if prompt + request.max_tokens > self.max_context:
            raise C.RequestTooLong(f"the prompt has {prompt} tokens and max_tokens is {request.max_tokens}, together more "
                                   f"than this deployment's context of {self.max_context} tokens")
        latency = request_cost(self.spec, prompt, request.max_tokens)["latency_s"]
        if latency > self.time_limit_s:
            fit = self.tokens_within_limit(prompt)
            hint = f"lower max_tokens to at most {fit}" if fit else "shorten the prompt"
            raise C.RequestTooLong(f"{request.max_tokens} tokens after a {prompt}-token prompt are predicted to take "
                                   f"{latency:.1f} s, over the {self.time_limit_s:g} s this deployment's HTTP entry waits; {hint}")
        doc = json.dumps(initial_state(request.request_id, [list(request.prompt_ids)], _gen(request)), separators=(",", ":"))
        if len(doc) > STATE_LIMIT_BYTES // 2:  # the output holds the prompt's length in tokens too
            raise C.RequestTooLong(f"the prompt's {prompt} ids make a {len(doc)}-byte execution input; a Step Functions "
                                   f"execution holds {STATE_LIMIT_BYTES} bytes with its output: shorten the prompt")
        with self.lock:
            self.running += 1
        threading.Thread(target=self._run, args=(request, doc, sink), daemon=True).start()

    def cancel(self, request_id: str) -> None:
        """The execution cannot be stopped mid-way (StopExecution is for STANDARD machines): its
        tokens are dropped; it is billed to its end, as the cost headers say."""
        with self.lock:
            self.cancelled.add(request_id)

    def healthy(self) -> bool:
        return True

    def drain(self) -> None:
        self.draining = True

    def idle(self) -> bool:
        return self.running == 0

    def metrics(self) -> dict:
        return {"running": self.running, "waiting": 0, "steps": self.totals["steps"]}

    # --- the execution ------------------------------------------------------------------------
    def tokens_within_limit(self, prompt: int) -> int:
        """The most new tokens whose predicted latency after `prompt` tokens fits the time limit."""
        lo, hi = 0, max(0, self.max_context - prompt)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if request_cost(self.spec, prompt, mid)["latency_s"] <= self.time_limit_s:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _run(self, request: C.GenerationRequest, doc: str, sink) -> None:
        rid = request.request_id
        try:
            reply = self.sfn.start_sync_execution(stateMachineArn=self.state_machine, name=_execution_name(rid), input=doc)
            if reply.get("status") != "SUCCEEDED":
                raise RuntimeError(f"the execution {reply.get('status', 'failed').lower()}: "
                                   f"{reply.get('error', '')} {str(reply.get('cause', ''))[:300]}".strip())
            out = json.loads(reply["output"])
            tokens, finish, steps = list(out["tokens"][0]), out["finished"][0], int(out["step"])
        except Exception as exc:  # the answer is a 503 with the reason; the front keeps serving
            self._finish(rid)
            sink(C.TokenEvent(rid, -1, C.FINISH_ERROR, error=str(exc)[:500], time_s=time.monotonic()))
            return
        cost = request_cost(self.spec, len(request.prompt_ids), steps)
        with self.lock:
            self.costs[rid] = cost
            self.totals["gb_s"] += cost["lambda_gb_s"]
            self.totals["request_charges_usd"] += cost["request_charges_usd"]
            self.totals["usd"] += cost["usd"]["total"]
            self.totals["steps"] += steps
            self.totals["requests"] += 1
            dropped = rid in self.cancelled
        self._finish(rid)
        if dropped:
            return
        now = time.monotonic()
        for i, t in enumerate(tokens):
            sink(C.TokenEvent(rid, int(t), finish if i + 1 == len(tokens) and finish == C.FINISH_LENGTH else None, time_s=now))
        if not tokens or finish != C.FINISH_LENGTH:
            sink(C.TokenEvent(rid, -1, finish or C.FINISH_STOP, time_s=now))

    def _finish(self, rid: str) -> None:
        with self.lock:
            self.running -= 1
            self.cancelled.discard(rid)

    def cost_headers(self, request_id: str | None) -> dict:
        cost = self.costs.pop(request_id, None) if request_id else None
        if cost is None:
            return {}
        values = (cost["lambda_gb_s"], cost["request_charges_usd"], cost["usd"]["total"], cost["new_tokens"],
                  cost["prompt_tokens"])
        out = {name: repr(v) if isinstance(v, float) else str(v) for name, v in zip(COST_HEADERS, values)}
        out[BREAKDOWN_HEADER] = "; ".join(f"{k}={v!r}" for k, v in cost["usd"].items() if k != "total")
        return out

    def cost_metrics(self, labels: dict) -> str:
        out = []
        for name, key, help_ in (("predicted_billed_gb_seconds_total", "gb_s", "Lambda GB-s the plan's cost model predicts"),
                                 ("predicted_request_charges_usd_total", "request_charges_usd",
                                  "Request charges (Lambda, S3, Step Functions, API) predicted"),
                                 ("predicted_cost_usd_total", "usd", "Dollars predicted for the requests served"),
                                 ("forward_steps_total", "steps", "Forward steps the executions ran"),
                                 ("executions_total", "requests", "Executions that returned tokens")):
            _family(out, name, "counter", help_ + " (this container).", [({}, self.totals[key])], labels)
        return "\n".join(out) + "\n"


def _gen(request: C.GenerationRequest) -> dict:
    s = request.sampling
    seed = s.seed if s.seed is not None else int.from_bytes(os.urandom(6), "big")
    return {"max_tokens": int(request.max_tokens), "temperature": float(s.temperature), "top_p": float(s.top_p),
            "top_k": int(s.top_k), "seed": int(seed), "stop_token_ids": [int(t) for t in request.stop_token_ids],
            "keep_logits": False}


def _execution_name(request_id: str) -> str:
    """Execution names: at most 80 characters of letters, digits, '-' and '_'."""
    return re.sub(r"[^A-Za-z0-9_-]", "-", request_id)[:80]


def _sfn():
    import boto3
    from botocore.config import Config

    # StartSyncExecution goes to the `sync-states` host; a local endpoint has no such name
    local = bool(os.environ.get("AWS_ENDPOINT_URL_SFN"))
    return boto3.client("stepfunctions", config=Config(inject_host_prefix=not local, read_timeout=900,
                                                        retries={"max_attempts": 0}))


def service() -> tuple:
    """(OpenAIService, LambdaEngine) of this container, built once."""
    if "service" not in _SERVICE:
        spec = json.loads((RUNTIME.parent / "request_cost.json").read_text())
        settings = json.loads((RUNTIME.parent / "front.json").read_text())
        name = settings["model_name"]
        engine = LambdaEngine(name, int(settings["max_context"]), os.environ["MOEPLAN_STATE_MACHINE"], spec,
                              float(settings["time_limit_s"]), _sfn())
        served = ServedModel.from_model_dir(RUNTIME.parent / "model", name)
        _SERVICE["service"] = (OpenAIService(engine, served, api_key=os.environ.get("MOEPLAN_API_KEY") or None), engine)
    return _SERVICE["service"]


def handler(event, context=None):
    """A Function URL / HTTP API (payload format 2.0) event -> its HTTP response."""
    svc, engine = service()
    http = event.get("requestContext", {}).get("http", {})
    method, path = http.get("method", "GET"), event.get("rawPath") or http.get("path", "/")
    headers = {str(k).lower(): str(v) for k, v in (event.get("headers") or {}).items()}
    body = event.get("body") or ""
    body = base64.b64decode(body) if event.get("isBase64Encoded") else body.encode("utf-8")
    return asyncio.run(_answer(svc, engine, method, path, headers, body))


async def _answer(svc, engine: LambdaEngine, method: str, path: str, headers: dict, body: bytes) -> dict:
    answer = await svc.handle(method, path, headers, body)
    try:
        if answer.chunks is not None:
            text = b"".join([chunk async for chunk in answer.chunks]).decode("utf-8")
        elif isinstance(answer.body, (dict, list)):
            text = json.dumps(answer.body, separators=(",", ":"), ensure_ascii=False)
        else:
            text = str(answer.body)
    finally:
        answer.close()
    if path.rstrip("/") == "/metrics" and answer.status == 200:
        text += engine.cost_metrics(svc.metrics.labels)
    out_headers = {"content-type": answer.media_type, **{k.lower(): str(v) for k, v in answer.headers.items()}}
    if answer.generation is not None or (isinstance(answer.body, dict) and "usage" in answer.body):
        request_id = answer.generation.request.request_id if answer.generation is not None else answer.body.get("id")
        out_headers.update(engine.cost_headers(request_id))
    return {"statusCode": int(answer.status), "headers": out_headers, "body": text, "isBase64Encoded": False}
