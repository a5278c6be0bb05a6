"""`moeplan serve BUNDLE`: run a bundle's inference service locally (the OpenAI-compatible HTTP API on
rank 0 over continuous batching; docs/serving.md). A Lambda bundle is served by its own front
function over the local cloud instead (`planner/launch/lambda_serve.py`, docs/serverless.md).

The bundle is checked as `run` checks it (manifest, shards, world size, referenced checkpoint, and
its signature with --trusted-key), then its ranks start under torchrun (`planner/launch/
torchrun_serve.py`). stdout carries exactly one line, `serving on http://HOST:PORT`, once the service
answers; everything the ranks print goes to stderr. SIGINT and SIGTERM are passed to the ranks,
which stop admitting (503), finish the requests in flight and exit 0; a second one stops them at
once. A service that fails (a rank died) exits non-zero with one `error:` line, so a supervisor
restarts it.
"""
from __future__ import annotations

import signal
import socket
import sys
import threading
from pathlib import Path

import click

from moeplan.core import cli_types as T
from moeplan.core.errors import UserError
from moeplan.planner.launch.open_bundle import open_bundle

READY = "serving on "


@click.command("serve")
@click.argument("bundle", type=click.Path())
@click.option("--host", default="127.0.0.1", show_default=True, help="address rank 0 listens on (0.0.0.0: every interface)")
@click.option("--port", type=T.BoundedInt(low=0, high=65535), default=8000, show_default=True,
              help="port rank 0 listens on (0: any free port, printed in the ready line)")
@click.option("--nproc", type=T.POSITIVE_INT, default=None, help="ranks to launch (must equal the plan's world size)")
@click.option("--api-key", default=None, envvar="MOEPLAN_API_KEY", show_envvar=True,
              help="requests to /v1/ must carry 'Authorization: Bearer KEY' (401 otherwise)")
@click.option("--mode", type=click.Choice(["coherent", "standard"]), default=None,
              help="context-coherent or standard expert parallelism (default: the plan's communication mode)")
@click.option("--max-sequences", type=T.POSITIVE_INT, default=None,
              help="sequences running at once (default and upper bound: the plan's capacity)")
@click.option("--max-waiting", type=T.NON_NEGATIVE_INT, default=None,
              help="requests queued beyond the running ones before 429 (default 4 x max sequences)")
@click.option("--threads", type=T.POSITIVE_INT, default=None, help="torch threads per rank (default 1)")
@click.option("--trusted-key", type=click.Path(dir_okay=False), default=None,
              help="ed25519 public key (PEM): serve BUNDLE only if its manifest is signed by it (docs/security.md)")
def serve(bundle, host, port, nproc, api_key, mode, max_sequences, max_waiting, threads, trusted_key):
    """Serve BUNDLE's model over an OpenAI-compatible HTTP API until SIGINT or SIGTERM."""
    from moeplan.planner.launch.torchrun_serve import serve_command, start_service, stop_workers

    root = Path(bundle)
    if open_bundle(root, check_files=False).get("target") == "lambda":
        return _serve_lambda(root, host, port, api_key, trusted_key,
                             {"--nproc": nproc, "--mode": mode, "--max-sequences": max_sequences,
                              "--max-waiting": max_waiting, "--threads": threads})
    plan = open_bundle(root, nproc, trusted_key)  # checked as `run` checks it
    world = int(plan["topology"]["nodes"]) * int(plan["topology"]["gpus_per_node"])
    _check_port(host, port)
    proc = start_service(root, serve_command(world, host, port, mode, max_sequences, max_waiting, threads), api_key)
    state = {"ready": False, "signals": 0}
    stderr_lines: list = []
    forward = threading.Event()  # set once ready: from then on the ranks' stderr is passed through

    def on_signal(sig, frame):
        state["signals"] += 1
        stop_workers(proc, signal.SIGTERM)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        errs = threading.Thread(target=_pump_stderr, args=(proc, stderr_lines, forward), daemon=True)
        errs.start()
        for line in proc.stdout:
            if line.startswith(READY) and not state["ready"]:
                state["ready"] = True
                click.echo(line.rstrip("\n"))
                sys.stdout.flush()
                for kept in stderr_lines:
                    sys.stderr.write(kept)
                forward.set()
            else:
                sys.stderr.write(line)
        code = proc.wait()
        errs.join(5)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if proc.poll() is None:
            stop_workers(proc, signal.SIGKILL)
            proc.kill()
            proc.wait()
    if code == 0:
        return 0
    from moeplan.planner.launch.torchrun_launch import failure_reason

    reason = failure_reason("".join(stderr_lines))
    if not state["ready"] and not state["signals"]:
        raise UserError(f"the bundle's ranks failed before serving (exit {code}): {reason}")
    click.echo(f"error: the service stopped (exit {code}): {reason}", err=True)
    sys.exit(1)


def _serve_lambda(root: Path, host: str, port: int, api_key, trusted_key, rank_flags: dict) -> int:
    """Lambda bundles: the front function and state machine on the local cloud (planner/launch/lambda_serve.py)."""
    from moeplan.planner.launch.lambda_serve import serve_lambda

    given = [flag for flag, value in rank_flags.items() if value is not None]
    if given:
        raise UserError(f"{', '.join(given)} apply to torchrun and kubernetes bundles; a Lambda bundle's functions "
                        "are sized by its plan")
    open_bundle(root, trusted_key=trusted_key, check_files=False)  # its functions' files: checked by serve_lambda

    def ready(url: str) -> None:
        click.echo(READY + url)
        sys.stdout.flush()

    return serve_lambda(str(root), host, port, api_key, ready)


def _pump_stderr(proc, keep: list, forward: threading.Event) -> None:
    for line in proc.stderr:
        keep.append(line)
        if forward.is_set():
            sys.stderr.write(line)
            sys.stderr.flush()


def _check_port(host: str, port: int) -> None:
    """Fail with one line before any rank starts when the address cannot be listened on."""
    if port == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((host, port))
    except OSError as exc:
        raise UserError(f"cannot listen on {host}:{port} ({exc.strerror or exc}); choose another --port or --host") from None
