"""The HTTP server on rank 0: uvicorn + starlette around openai_service.py, in the rank's main thread.

Why uvicorn + starlette: both are small, pure-Python, widely deployed and kept (they are what
vLLM's and SGLang's OpenAI servers run on, through FastAPI), speak HTTP/1.1 keep-alive and
chunked streaming, and starlette's StreamingResponse notices a client that goes away mid-stream
(it listens for `http.disconnect` and cancels the stream), which is what frees a batch slot.
FastAPI's validation layer is not needed: requests are checked by api_request.py, which the
Lambda front reuses without any framework.

`run_http` is what the rank entry point (`runtime/serve.py --serve`) calls on rank 0, in the main
thread, while the engine loop runs in rank 0's engine process (`engine_process.py`). It binds the port at once, prints exactly
one line `serving on http://HOST:PORT` when the socket listens and the engine is healthy, and owns
SIGTERM/SIGINT on rank 0:
* first signal: `client.drain()`; /health and new requests answer 503; the requests in flight
  finish; when the engine is idle and every response is written, return 0;
* second signal: return 1 at once;
* the engine turns unhealthy (a rank died): /health and new requests answer 503 (for at least
  `linger_s`, so that probes see it), the open responses get their error (at most `grace_s`),
  return 1 so that a supervisor restarts the service.
The caller stops the other ranks and exits with the returned code.
"""
from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os
import signal
import socket
import sys
import time
from pathlib import Path

from .api_errors import ApiError
from .openai_service import MAX_BODY_BYTES, Answer, OpenAIService
from .served_model import ServedModel

# A development hook, not shipped: MOEPLAN_PROFILER names a Python file (benchmarks/stack_sampler.py) whose
# `start_from_env()` rank 0 calls before serving; what it returns is stopped (`.stop()`) when serving ends.
PROFILER_ENV = "MOEPLAN_PROFILER"
PROFILE_ENV = "MOEPLAN_PROFILE"  # the file it writes (rank 0's engine process writes FILE.engine)
METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]


def run_http(client, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
             model_dir: Path | None = None, model_name: str | None = None, poll_s: float = 0.2,
             grace_s: float = 3.0) -> int:
    """Serve until a signal or an engine failure; returns the process exit code (see module doc)."""
    try:
        sock = bind(host, port)
    except OSError as exc:
        print(f"error: cannot listen on {host}:{port} ({exc.strerror or exc}); choose another --port or --host",
              file=sys.stderr, flush=True)
        return 2
    served = ServedModel.from_model_dir(Path(model_dir), model_name or client.model_name)
    service = OpenAIService(client, served, api_key)
    sampler = start_profiler()  # benchmarks/serving.py: rank 0's stacks
    try:
        return asyncio.run(_serve(service, sock, poll_s, grace_s))
    finally:
        if sampler is not None:
            sampler.stop()


def start_profiler():
    """The profiler MOEPLAN_PROFILER's file starts (see PROFILER_ENV), or None when the variable is unset."""
    path = os.environ.get(PROFILER_ENV)
    if not path:
        return None
    spec = importlib.util.spec_from_file_location("moeplan_profiler", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.start_from_env()


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket (port 0: any free port); IPv6 when the host is an IPv6 address."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.create_server((host, int(port)), family=family, backlog=2048)
    sock.setblocking(False)
    return sock


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _uvicorn_server(app):
    """uvicorn's Server without its own signal handlers (run_http owns SIGTERM/SIGINT)."""
    import uvicorn

    class Quiet(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            yield

    return Quiet(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                                timeout_graceful_shutdown=5, timeout_keep_alive=5))


async def _serve(service: OpenAIService, sock: socket.socket, poll_s: float, grace_s: float,
                 linger_s: float = 1.5) -> int:
    server = _uvicorn_server(asgi_app(service))
    loop = asyncio.get_running_loop()
    signals = []

    def on_signal(sig):
        signals.append(sig)
        if len(signals) == 1:
            service.draining = True
            service.client.drain()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    serving = asyncio.ensure_future(server.serve(sockets=[sock]))
    announced, failed_at, code = False, None, None
    try:
        while code is None:
            await asyncio.sleep(poll_s)
            if serving.done():  # uvicorn stopped by itself (it should not): an error
                code = 1
                break
            healthy = service.client.healthy()
            if not announced and server.started and healthy:
                print(f"serving on {url_of(sock)}", flush=True)
                announced = True
            if len(signals) > 1:
                code = 1
            elif not healthy and announced:
                failed_at = failed_at or time.monotonic()
                service.draining = True
                waited = time.monotonic() - failed_at
                if (service.open_answers == 0 and waited >= linger_s) or waited > grace_s:
                    code = 1
            elif signals and service.client.idle() and service.open_answers == 0:
                code = 0
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        server.should_exit = True
        server.force_exit = code != 0
        with contextlib.suppress(Exception):
            await asyncio.wait_for(serving, 10)
    return code


def asgi_app(service: OpenAIService):
    """The starlette app: every path goes to the service; streams close their generation when done
    or when the client goes away."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
    from starlette.routing import Route

    class ClosingStream(StreamingResponse):
        def __init__(self, answer: Answer):
            super().__init__(answer.chunks, status_code=answer.status, headers=_stream_headers(answer),
                             media_type=answer.media_type)
            self.answer = answer

        async def __call__(self, scope, receive, send):
            try:
                await super().__call__(scope, receive, send)
            finally:
                self.answer.close()

    async def endpoint(request):
        body = await _read_body(request)
        headers = {k.lower(): v for k, v in request.headers.items()}
        if body is None:
            error = ApiError(413, f"the request body is larger than {MAX_BODY_BYTES} bytes")
            service.metrics.request_refused(413)
            answer = Answer(413, error.body())
        else:
            work = asyncio.ensure_future(service.handle(request.method, request.url.path, headers, body))
            gone = asyncio.ensure_future(_disconnected(request))
            done, _ = await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
            gone.cancel()
            if work not in done:  # the client left before the answer: stop generating for it
                work.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await work
                return Response(status_code=499)
            answer = work.result()
        if answer.chunks is not None:
            return ClosingStream(answer)
        answer.close()
        if isinstance(answer.body, str):
            return PlainTextResponse(answer.body, status_code=answer.status, headers=answer.headers,
                                     media_type=answer.media_type)
        return JSONResponse(answer.body, status_code=answer.status, headers=answer.headers)

    return Starlette(routes=[Route("/{path:path}", endpoint, methods=METHODS)])


def _stream_headers(answer: Answer) -> dict:
    return dict(answer.headers, **{"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _read_body(request):
    """The body, or None past MAX_BODY_BYTES (read no further)."""
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


async def _disconnected(request) -> None:
    """Returns when the client closes its connection (after the body has been read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
