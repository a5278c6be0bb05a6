"""`moeplan serve LAMBDA_BUNDLE`: the bundle's OpenAI API on this machine, over the local cloud.

Why: a client test must send the very request it would send to AWS. The local HTTP server plays
the Function URL (or HTTP API; both hand the front a payload format 2.0 event): it turns each HTTP
request into that event, invokes the bundle's own front function (its own process, as every
function of the local cloud: `local_cloud.py`), whose boto3 `StartSyncExecution` runs the
template's state machine against the local S3 and Lambda endpoints, and writes back the front's
status, headers and body. Nothing of the API is answered here: errors, /metrics and the cost
headers are the front's. Like one Lambda container, the front answers one request at a time.
Limits as AWS applies them before the front sees a request: a request body over the 6 MB
invocation payload is refused with 413 (AWS's own message, not the OpenAI shape: the front never
runs), and a front that fails answers 502.
"""
from __future__ import annotations

import base64
import json
import signal
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlsplit

from moeplan.planner.launch.lambda_cloud import CloudError, LocalCloud
from moeplan.planner.launch.lambda_run import check_files, check_library
from moeplan.core.errors import UserError

FRONT = "Front"


def serve_lambda(bundle: str, host: str, port: int, api_key: str | None, ready) -> int:
    """Serve until SIGINT or SIGTERM; `ready(url)` is called once requests are answered. Returns 0."""
    root = Path(bundle)
    plan = check_files(root)
    if plan.get("target") != "lambda":
        raise UserError(f"'{root}' is not a lambda bundle")
    check_library(plan)
    limit = int(plan["inputs"]["facts"]["platform"]["payload_limit_bytes"])
    try:
        server = ThreadingHTTPServer((host, port), _handler(None, limit))
    except OSError as exc:
        raise UserError(f"cannot listen on {host}:{port} ({exc.strerror or exc}); choose another --port or --host") from None
    cloud = LocalCloud(root, limit, parameters={"ApiKey": api_key or ""})
    if FRONT not in cloud.functions:
        cloud.close()
        server.server_close()
        raise UserError(f"'{root}' has no front function; recompile it with this moeplan")
    try:
        cloud.upload_weights()
        server.RequestHandlerClass = _handler(cloud, limit)
        stop = threading.Event()

        def on_signal(sig, frame):
            if not stop.is_set():
                stop.set()
                threading.Thread(target=server.shutdown, daemon=True).start()

        previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            ready(f"http://{host}:{server.server_address[1]}")
            server.serve_forever(poll_interval=0.5)
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
    finally:
        server.server_close()  # waits for the requests in flight
        cloud.close()
    return 0


def function_url_event(method: str, target: str, headers: dict, body: bytes, client: str) -> dict:
    """What a Function URL (payload format 2.0) hands the front for one HTTP request."""
    parts = urlsplit(target)
    try:
        text, encoded = body.decode("utf-8"), False
    except UnicodeDecodeError:
        text, encoded = base64.b64encode(body).decode(), True
    return {"version": "2.0", "routeKey": "$default", "rawPath": parts.path or "/", "rawQueryString": parts.query,
            "headers": {k.lower(): v for k, v in headers.items()},
            "requestContext": {"http": {"method": method, "path": parts.path or "/", "protocol": "HTTP/1.1",
                                        "sourceIp": client}},
            "body": text, "isBase64Encoded": encoded}


def _handler(cloud: LocalCloud | None, limit: int):
    class FunctionUrl(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def _any(self):
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            event = function_url_event(self.command, self.path, dict(self.headers.items()), body, self.client_address[0])
            if len(json.dumps(event)) > limit:
                return self._send(413, {"content-type": "application/json"},
                                  json.dumps({"Message": f"Request must be smaller than {limit} bytes for the "
                                                         "InvokeFunction operation"}))
            try:
                answer = cloud.invoke(FRONT, event)
            except CloudError:
                return self._send(502, {"content-type": "application/json"}, json.dumps({"Message": "Internal Server Error"}))
            text = answer.get("body") or ""
            data = base64.b64decode(text) if answer.get("isBase64Encoded") else text.encode("utf-8")
            return self._send(int(answer.get("statusCode", 200)), answer.get("headers") or {}, data)

        do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = _any

        def _send(self, status: int, headers: dict, data):
            data = data.encode("utf-8") if isinstance(data, str) else data
            self.send_response(status)
            for k, v in headers.items():
                if k.lower() not in ("content-length", "connection"):
                    self.send_header(k, v)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    return FunctionUrl
