"""Shared by the serving tests: start a server process and wait for its `serving on` line, talk to it
with the real `openai` client or raw HTTP, read its /metrics, stop it."""
from __future__ import annotations

import http.client
import json
import os
import queue
import signal
import subprocess
import threading
import time
from urllib.parse import urlparse


class ServerProcess:
    """A process that prints `serving on http://HOST:PORT` when ready; its other output is kept."""

    def __init__(self, cmd: list, cwd=None, env=None, ready_timeout_s: float = 120.0):
        self.cmd = cmd
        self.proc = subprocess.Popen(cmd, cwd=cwd, env=dict(os.environ, **(env or {})), stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, start_new_session=True)
        self.lines: queue.Queue = queue.Queue()
        self.stdout: list = []
        self.stderr: list = []
        threading.Thread(target=self._pump, args=(self.proc.stdout, self.stdout, True), daemon=True).start()
        threading.Thread(target=self._pump, args=(self.proc.stderr, self.stderr, False), daemon=True).start()
        self.url = self._wait_ready(ready_timeout_s)

    def _pump(self, stream, keep: list, announce: bool):
        for line in stream:
            keep.append(line)
            if announce:
                self.lines.put(line)
        if announce:
            self.lines.put(None)

    def _wait_ready(self, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                break
            if line is None:
                break
            if line.startswith("serving on "):
                return line.split()[-1].strip()
        self.kill()
        raise AssertionError(f"{self.cmd} did not print 'serving on' (exit {self.proc.poll()}):\n"
                             f"{''.join(self.stdout)[-3000:]}\n{''.join(self.stderr)[-6000:]}")

    @property
    def host_port(self) -> tuple:
        u = urlparse(self.url)
        return u.hostname, u.port

    def signal(self, sig=signal.SIGTERM) -> None:
        self.proc.send_signal(sig)

    def wait(self, timeout_s: float) -> int:
        return self.proc.wait(timeout=timeout_s)

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=30)

    def output(self) -> str:
        return "".join(self.stdout) + "".join(self.stderr)


def client(server: ServerProcess, api_key: str = "none", **kw):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key=api_key, max_retries=0, **kw)


def async_client(url: str, api_key: str = "none", **kw):
    import openai

    return openai.AsyncOpenAI(base_url=url + "/v1", api_key=api_key, max_retries=0, **kw)


def raw(server: ServerProcess, method: str, path: str, body=None, headers=None, timeout_s: float = 30.0) -> tuple:
    """(status, headers, body text) of one plain HTTP request."""
    host, port = server.host_port
    conn = http.client.HTTPConnection(host, port, timeout=timeout_s)
    data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
    conn.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
    resp = conn.getresponse()
    out = resp.status, dict(resp.getheaders()), resp.read().decode("utf-8", errors="replace")
    conn.close()
    return out


def metrics(server: ServerProcess) -> dict:
    """{(sample name, sorted label items without model_name): value} from /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    status, _, text = raw(server, "GET", "/metrics")
    assert status == 200
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name")))] = s.value
    return out


def wait_for(predicate, timeout_s: float, what: str, step_s: float = 0.05):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(step_s)
    raise AssertionError(f"not within {timeout_s} s: {what}")


def check_drain(server: ServerProcess, c, model: str, in_flight: dict, timeout_s: float = 30.0) -> None:
    """SIGTERM while one request (`in_flight`: completions.create arguments, max_tokens included)
    runs: /health and a new request answer 503, the request finishes whole, the server exits 0."""
    import openai

    done = {}
    t = threading.Thread(target=lambda: done.update(r=c.completions.create(model=model, **in_flight)))
    t.start()
    wait_for(lambda: metrics(server)[("moeplan_requests_running", ())] == 1, 10, "the request runs")
    server.signal(signal.SIGTERM)
    wait_for(lambda: raw(server, "GET", "/health")[0] == 503, 5, "/health answers 503 while draining")
    try:
        c.completions.create(model=model, prompt="x", max_tokens=2)
        raise AssertionError("a request was admitted while draining")
    except openai.InternalServerError as err:
        assert err.status_code == 503
    t.join(timeout_s)
    assert done["r"].usage.completion_tokens == in_flight["max_tokens"] and done["r"].choices[0].finish_reason == "length"
    assert server.wait(timeout_s) == 0
