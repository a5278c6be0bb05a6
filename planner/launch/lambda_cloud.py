"""Local stand-ins for S3, Lambda and Step Functions that a Lambda bundle's unchanged handlers talk
to through boto3.

Why: verification and `moeplan serve` must exercise the deployed code paths - boto3 S3 calls, boto3
`lambda.invoke` for direct scatter-gather, the front's `StartSyncExecution`, one process per
function, payload limits - without AWS. S3 is moto's server on 127.0.0.1 (random port); Lambda's
Invoke API and Step Functions' StartSyncExecution are a small HTTP server on 127.0.0.1: an invoke is
forwarded to the function's own process (forked by `runtime.lambda_.worker`), enforcing the payload
limit on requests and responses; an execution runs the template's own definition (`lambda_asl.py`).
Functions come from template.yaml itself: memory, environment (Ref / Fn::Sub resolved for a stack
named `local`; `Ref: Pipeline` is the local state machine's ARN, other parameters from `parameters`),
module and handler from the Dockerfile CMD. Every invocation is recorded: function, measured
seconds, planned memory, payload and storage bytes and requests (`bill` prices them as AWS
would); every S3 key a function used is checked against the prefixes its IAM policy in the
template allows.
"""
from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import yaml

from moeplan.runtime.lambda_.worker import recv, send

STACK = "local"
BUCKET = "moeplan-local"
INVOKE_PATH = re.compile(r"^/2015-03-31/functions/([^/]+)/invocations$")


class CloudError(Exception):
    """A function failed, a payload exceeded the limit, or the bundle cannot run locally."""


STATE_MACHINE_ARN = f"arn:aws:states:us-east-1:000000000000:stateMachine:{STACK}-pipeline"


@dataclass
class Function:
    logical_id: str
    name: str
    handler: str
    module: str
    memory_mb: int
    env: dict
    may_get: tuple = ()   # S3 key patterns (IAM wildcards: * any run of characters, ? one) its policy lets it read
    may_put: tuple = ()   # ... and write

    def allowed(self, op: str, key: str) -> bool:
        return any(_iam_match(p, key) for p in (self.may_get if op == "get" else self.may_put))


def _iam_match(pattern: str, key: str) -> bool:
    """IAM resource matching: `*` matches any characters (slashes too), `?` exactly one."""
    regex = "".join(".*" if c == "*" else "." if c == "?" else re.escape(c) for c in pattern)
    return re.fullmatch(regex, key, flags=re.DOTALL) is not None


def _policy_prefixes(props: dict, action: str) -> tuple:
    """Key patterns of the `${Bucket.Arn}/<pattern>` resources granted `action` by the function's policies."""
    out = []
    for policy in props.get("Policies", []):
        for st in policy.get("Statement", []) if isinstance(policy, dict) else []:
            resources = st.get("Resource")
            for res in resources if isinstance(resources, list) else [resources]:
                sub = res.get("Fn::Sub") if isinstance(res, dict) else None
                if st.get("Effect") == "Allow" and action in st.get("Action", []) and isinstance(sub, str) \
                        and sub.startswith("${Bucket.Arn}/"):
                    out.append(sub[len("${Bucket.Arn}/"):])
    return tuple(sorted(out))


@dataclass
class Invocation:
    function: str
    kind: str
    seconds: float
    memory_mb: int
    request_bytes: int
    response_bytes: int
    io: dict = field(default_factory=dict)


def _resolve(value, refs: dict):
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and list(value) == ["Ref"]:
        if value["Ref"] not in refs:
            raise CloudError(f"cannot resolve Ref {value['Ref']!r} locally")
        return refs[value["Ref"]]
    if isinstance(value, dict) and list(value) == ["Fn::Sub"]:
        return value["Fn::Sub"].replace("${AWS::StackName}", STACK)
    raise CloudError(f"cannot resolve {value!r} locally")


def read_template(root: Path, bucket: str = BUCKET, parameters: dict | None = None) -> tuple:
    """(functions by logical id, state machine definition, substitutions -> logical id)."""
    doc = yaml.safe_load((root / "template.yaml").read_text())
    refs = {"Bucket": bucket, "AWS::StackName": STACK, "Pipeline": STATE_MACHINE_ARN}
    refs.update({k: str((parameters or {}).get(k, p.get("Default", ""))) for k, p in (doc.get("Parameters") or {}).items()})
    functions, machine = {}, None
    for lid, res in doc["Resources"].items():
        if res["Type"] == "AWS::Serverless::Function":
            props = res["Properties"]
            dockerfile = root / "functions" / res["Metadata"]["Dockerfile"]
            cmd = re.search(r'^CMD \["runtime\.lambda_\.(\w+)\.(\w+)"\]', dockerfile.read_text(), re.M)
            if cmd is None:
                raise CloudError(f"{dockerfile} has no runtime.lambda_.<module>.<handler> CMD")
            env = {k: _resolve(v, refs) for k, v in props["Environment"]["Variables"].items()}
            functions[lid] = Function(lid, _resolve(props["FunctionName"], refs), cmd.group(2), cmd.group(1),
                                      int(props["MemorySize"]), env,
                                      _policy_prefixes(props, "s3:GetObject"), _policy_prefixes(props, "s3:PutObject"))
        elif res["Type"] == "AWS::Serverless::StateMachine":
            machine = res["Properties"]
    subs = {k: v["Fn::GetAtt"][0] for k, v in machine["DefinitionSubstitutions"].items()}
    return functions, machine["Definition"], subs


class LocalCloud:
    """moto S3 + a Lambda Invoke endpoint + one process per function, all on 127.0.0.1."""

    def __init__(self, root: Path, payload_limit: int, parameters: dict | None = None):
        import logging

        try:
            from moto.server import ThreadedMotoServer
        except ImportError:
            from moeplan.core.errors import UserError

            raise UserError("running a Lambda bundle locally needs boto3 and moto: pip install 'moeplan[lambda]'") from None

        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no line per S3 request
        self.root, self.payload_limit = Path(root), int(payload_limit)
        self.functions, self.definition, self.subs = read_template(self.root, parameters=parameters)
        self.executions = []  # (name, status, seconds, state transitions) of StartSyncExecution calls
        self.by_name = {f.name: f for f in self.functions.values()}
        self.invocations, self.lock = [], threading.Lock()
        self.client_io = {"get_bytes": 0, "put_bytes": 0, "gets": 0, "puts": 0}
        self._procs, self._ports, self._fn_locks = {}, {}, {lid: threading.Lock() for lid in self.functions}
        self.s3_server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self.s3_server.start()
        self.s3_url = "http://{}:{}".format(*self.s3_server.get_host_and_port())
        self.http = ThreadingHTTPServer(("127.0.0.1", 0), _handler_for(self))
        self.http.daemon_threads = True
        threading.Thread(target=self.http.serve_forever, daemon=True).start()
        self.lambda_url = f"http://127.0.0.1:{self.http.server_address[1]}"
        self.env = {"AWS_ACCESS_KEY_ID": "local", "AWS_SECRET_ACCESS_KEY": "local", "AWS_DEFAULT_REGION": "us-east-1",
                    "AWS_ENDPOINT_URL_S3": self.s3_url, "AWS_ENDPOINT_URL_LAMBDA": self.lambda_url,
                    "AWS_ENDPOINT_URL_SFN": self.lambda_url}
        import boto3

        self.s3 = boto3.client("s3", endpoint_url=self.s3_url, region_name="us-east-1",
                               aws_access_key_id="local", aws_secret_access_key="local")
        self.s3.create_bucket(Bucket=BUCKET)
        env = dict(os.environ, **self.env, PYTHONDONTWRITEBYTECODE="1", OMP_NUM_THREADS="1")
        env.pop("PYTHONPATH", None)  # the handlers run from the bundle's own functions/runtime
        self.zygote = subprocess.Popen([sys.executable, "-m", "runtime.lambda_.worker"], cwd=self.root / "functions",
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self._zlock = threading.Lock()

    # -- storage, from the client's side ----------------------------------------------------
    def put(self, key: str, data: bytes) -> None:
        self.s3.put_object(Bucket=BUCKET, Key=key, Body=data)
        self.client_io["put_bytes"] += len(data)
        self.client_io["puts"] += 1

    def get(self, key: str) -> bytes:
        data = self.s3.get_object(Bucket=BUCKET, Key=key)["Body"].read()
        self.client_io["get_bytes"] += len(data)
        self.client_io["gets"] += 1
        return data

    def upload_weights(self) -> int:
        """`aws s3 sync weights/ s3://bucket/weights/`; returns bytes uploaded (deployment, not per request)."""
        total = 0
        for path in sorted((self.root / "weights").rglob("*")):
            if path.is_file():
                data = path.read_bytes()
                self.s3.put_object(Bucket=BUCKET, Key=path.relative_to(self.root).as_posix(), Body=data)
                total += len(data)
        return total

    # -- functions --------------------------------------------------------------------------
    def _port(self, fn: Function) -> int:
        with self._zlock:
            if fn.logical_id not in self._ports:
                self.zygote.stdin.write(json.dumps({"spawn": fn.logical_id, "module": fn.module, "handler": fn.handler,
                                                    "env": fn.env}) + "\n")
                self.zygote.stdin.flush()
                line = self.zygote.stdout.readline()
                if not line:
                    raise CloudError("the local function host exited; see its stderr")
                reply = json.loads(line)
                self._procs[fn.logical_id], self._ports[fn.logical_id] = reply["pid"], reply["port"]
            return self._ports[fn.logical_id]

    def invoke(self, logical_id: str, payload: dict) -> dict:
        """Invoke a function with a JSON payload; the payload limit holds both ways."""
        fn = self.functions[logical_id]
        body = json.dumps(payload).encode()
        if len(body) > self.payload_limit:
            raise CloudError(f"request to {logical_id} is {len(body)} bytes, over the {self.payload_limit}-byte payload limit")
        with self._fn_locks[logical_id]:  # one container per function: one invocation at a time
            port = self._port(fn)
            with socket.create_connection(("127.0.0.1", port)) as sock:
                send(sock, body)
                raw = recv(sock)
        reply = json.loads(raw)
        result = json.dumps(reply.get("result")).encode()
        with self.lock:
            self.invocations.append(Invocation(logical_id, _kind(fn), float(reply["seconds"]),
                                               fn.memory_mb, len(body), len(result), reply.get("io", {})))
        if not reply["ok"]:
            raise CloudError(f"function {logical_id} failed: {reply['error']}")
        for op, key in reply.get("access", []):  # the local S3 does not enforce IAM: check here
            if not fn.allowed(op, key):
                raise CloudError(f"function {logical_id} used {op} on '{key}', which its IAM policy does not allow")
        if len(result) > self.payload_limit:
            raise CloudError(f"response of {logical_id} is {len(result)} bytes, over the {self.payload_limit}-byte payload limit")
        return reply["result"]

    def start_sync_execution(self, request: dict) -> dict:
        """Step Functions' StartSyncExecution on the template's definition (SUCCEEDED or FAILED)."""
        from moeplan.planner.launch.lambda_asl import ASLError, Machine

        if request.get("stateMachineArn") != STATE_MACHINE_ARN:
            raise CloudError(f"state machine {request.get('stateMachineArn')!r} does not exist here")
        name = str(request.get("name") or f"execution-{len(self.executions)}")
        machine = Machine(self.definition, self.subs, self.invoke)
        start, started = time.perf_counter(), time.time()
        reply = {"executionArn": f"{STATE_MACHINE_ARN.replace(':stateMachine:', ':express:')}:{name}",
                 "stateMachineArn": STATE_MACHINE_ARN, "name": name, "startDate": started}
        try:
            output = machine.run(json.loads(request.get("input") or "{}"))
            reply.update(status="SUCCEEDED", output=json.dumps(output))
        except (CloudError, ASLError) as exc:
            reply.update(status="FAILED", error="States.TaskFailed", cause=str(exc)[:1000])
        reply["stopDate"] = time.time()
        with self.lock:
            self.executions.append((name, reply["status"], time.perf_counter() - start, machine.transitions))
        return reply

    def bill(self, prices: dict, execution_seconds=None, http_requests: int = 0) -> dict:
        """What AWS would charge for the work recorded since `invocations` was last cleared, by the one
        billing rule (runtime/lambda_/charges.py): every invocation's measured seconds at its planned
        memory, the functions' S3 requests (not the client's uploads and reads), and the executions
        (`execution_seconds`: their measured lengths; default: the StartSyncExecution calls recorded).
        `prices`: the platform's keys (plan.json's inputs.facts.platform)."""
        from moeplan.runtime.lambda_.charges import billed_gb_seconds, charges_usd, express_gb_seconds

        with self.lock:
            inv = list(self.invocations)
            seconds = [e[2] for e in self.executions] if execution_seconds is None else list(execution_seconds)
        gb_s = sum(billed_gb_seconds(i.seconds, i.memory_mb, float(prices["billing_granularity_s"])) for i in inv)
        puts, gets = sum(i.io.get("puts", 0) for i in inv), sum(i.io.get("gets", 0) for i in inv)
        express_gb_s = express_gb_seconds(seconds, prices)
        usd = charges_usd(prices, gb_s=gb_s, invocations=len(inv), s3_puts=puts, s3_gets=gets, executions=len(seconds),
                          express_gb_s=express_gb_s, http_requests=http_requests)
        return {"lambda_gb_s": gb_s, "lambda_invocations": len(inv), "s3_puts": puts, "s3_gets": gets,
                "executions": len(seconds), "express_gb_s": express_gb_s, "usd": usd}

    def close(self) -> None:
        try:
            if self.zygote.poll() is None:
                self.zygote.stdin.write(json.dumps({"exit": True}) + "\n")
                self.zygote.stdin.flush()
                self.zygote.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired, ValueError):
            self.zygote.kill()
        self.http.shutdown()
        self.s3_server.stop()


def _kind(fn: Function) -> str:
    return fn.handler.replace("_handler", "") if fn.module == "handlers" else fn.module


def _handler_for(cloud: LocalCloud):
    class InvokeHandler(BaseHTTPRequestHandler):
        """Lambda's Invoke API (synchronous) and Step Functions' StartSyncExecution, as boto3 calls them."""

        def log_message(self, *args):
            pass

        def do_POST(self):
            m = INVOKE_PATH.match(self.path.split("?")[0])
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            target = self.headers.get("X-Amz-Target", "")
            if target.startswith("AWSStepFunctions."):
                if target != "AWSStepFunctions.StartSyncExecution":
                    return self._reply(400, {"__type": "UnknownOperationException", "message": target}, {})
                try:
                    return self._reply(200, cloud.start_sync_execution(json.loads(body or b"{}")), {})
                except CloudError as exc:
                    return self._reply(400, {"__type": "StateMachineDoesNotExist", "message": str(exc)}, {})
            fn = cloud.by_name.get(m.group(1)) if m else None
            if fn is None:
                return self._reply(404, {"Type": "User", "message": f"Function not found: {self.path}"},
                                   {"x-amzn-ErrorType": "ResourceNotFoundException"})
            if len(body) > cloud.payload_limit:
                return self._reply(413, {"Type": "User", "message": f"Request must be smaller than {cloud.payload_limit} bytes"},
                                   {"x-amzn-ErrorType": "RequestTooLargeException"})
            try:
                result = cloud.invoke(fn.logical_id, json.loads(body or b"{}"))
            except CloudError as exc:
                return self._reply(200, {"errorMessage": str(exc), "errorType": "Unhandled"}, {"X-Amz-Function-Error": "Unhandled"})
            return self._reply(200, result, {})

        def _reply(self, status, doc, headers):
            data = json.dumps(doc).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            for k, v in headers.items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(data)

    return InvokeHandler
