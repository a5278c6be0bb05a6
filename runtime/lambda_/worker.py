"""Local stand-in for Lambda containers: one process per function, forked from a warm zygote.

Why: a local run must execute every handler in its own process (its own memory, environment and
boto3 clients, state only through storage or payloads, as on Lambda), but a bundle has a hundred
functions and each fresh Python + torch start costs seconds. The zygote imports torch and the
handlers once and forks a child per function; the child keeps its weights between invocations
like a warm container and serves one invocation at a time on a 127.0.0.1 socket.

Zygote protocol (JSON lines on stdin/stdout): {"spawn": name, "module": "handlers", "handler":
"dense_handler", "env": {}} -> {"name", "pid", "port"}; {"exit": true} ends every child. Invocation protocol (per connection):
8-byte length + JSON event -> 8-byte length + JSON {"ok", "result" | "error", "seconds"}, where
`seconds` is the handler's own wall time (the billed duration), `io` its storage traffic and
`access` the (operation, key) pairs it used.
"""
from __future__ import annotations

import importlib
import json
import os
import signal
import socket
import struct
import sys
import time
import traceback


def send(sock, payload: bytes) -> None:
    sock.sendall(struct.pack("<Q", len(payload)) + payload)


def recv(sock) -> bytes:
    head = _exact(sock, 8)
    return _exact(sock, struct.unpack("<Q", head)[0])


def _exact(sock, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(1 << 20, n - len(buf)))
        if not chunk:
            raise ConnectionError("connection closed")
        buf += chunk
    return bytes(buf)


def _serve(module, handler_name: str, listener) -> None:
    handler = getattr(module, handler_name)
    while True:
        conn, _ = listener.accept()
        with conn:
            try:
                event = json.loads(recv(conn))
            except (ConnectionError, ValueError):
                continue
            io, access = getattr(module, "IO", {}), getattr(module, "ACCESS", [])
            for k in io:
                io[k] = 0
            del access[:]
            start = time.perf_counter()
            try:
                reply = {"ok": True, "result": handler(event, None)}
            except Exception as exc:  # reported to the caller, as Lambda's FunctionError
                reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-2000:]}
            reply["seconds"] = time.perf_counter() - start
            reply["io"] = dict(io)
            reply["access"] = list(access)
            send(conn, json.dumps(reply).encode())


def zygote() -> int:
    import torch

    from . import handlers

    torch.set_num_threads(1)
    handlers.prewarm()
    children = []
    out = sys.stdout
    for line in sys.stdin:
        msg = json.loads(line)
        if msg.get("exit"):
            break
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        port = listener.getsockname()[1]
        pid = os.fork()
        if pid == 0:  # the function's own process
            os.dup2(2, 1)
            os.environ.update(msg["env"])
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            try:
                _serve(importlib.import_module(f"{__package__}.{msg.get('module', 'handlers')}"), msg["handler"], listener)
            finally:
                os._exit(0)
        listener.close()
        children.append(pid)
        out.write(json.dumps({"name": msg["spawn"], "pid": pid, "port": port}) + "\n")
        out.flush()
    for pid in children:
        try:
            os.kill(pid, signal.SIGTERM)
            os.waitpid(pid, 0)
        except OSError:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(zygote())
