"""The command-line server around `OublietteServer.serve`: signals, the ready line, the stdio caller.

What runs — the relay, the HTTP and metrics listeners, the configured toolsets — is the
library's (`OublietteServer.serve` starts everything its `ServerConfig` names); this shell adds
only what a program needs: stopping on SIGTERM/SIGINT, announcing where it listens (the ready
line, and `serving.json` in the data directory for `status` and `tail`), and serving the caller
on stdio.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import sys
from typing import Awaitable, Callable

import trio

from oubliette_runtime.gc_freeze import freeze_startup_heap

from ..core.pending_requests import SERVER_SHUTDOWN
from .app import OublietteServer, ServingAddresses
from .config import ServerConfig
from .serving_file import ServingRecord, keep_serving_file

log = logging.getLogger("oubliette.server")

SHUTDOWN_DRAIN_SECONDS = 2.0
READY_PREFIX = "oubliette-server ready "


def announce_ready(bound: ServingAddresses) -> None:
    """One machine-readable stderr line once every listener is bound (stdout carries MCP)."""
    ready: dict[str, object] = {"relay": bound.relay, "http": bound.http}
    if bound.metrics:
        ready["metrics"] = bound.metrics
    print(READY_PREFIX + json.dumps(ready), file=sys.stderr, flush=True)
    notify_systemd("READY=1")


def notify_systemd(state: str) -> None:
    """Tell the service manager `state` (`READY=1`, `STOPPING=1`) when it asked to be told.

    Why: a `Type=notify` unit (deploy/oubliette-server.service) starts what depends on the server
    only once it is ready, without polling a probe. systemd's protocol is one datagram to the
    socket in `$NOTIFY_SOCKET` (`@` names the abstract namespace); the send never waits, and a
    failure is logged, never fatal. Without the variable it does nothing.
    """
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return
    target = "\0" + address[1:] if address.startswith("@") else address
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as notify:
            notify.setblocking(False)
            notify.sendto(state.encode(), target)
    except OSError as exc:
        log.warning("could not tell the service manager %s at NOTIFY_SOCKET %s: %s", state, address, exc)


async def stop_on_signals(
    cancel_scope: trio.CancelScope, received: list[int],
    drain: Callable[[float], Awaitable[None]] | None = None, grace: float = SHUTDOWN_DRAIN_SECONDS,
) -> None:
    """SIGTERM/SIGINT end the server cleanly: listeners close, started guests are stopped, the store closes.

    First the relay and HTTP requests in flight may send their answers (`drain`, at most `grace` seconds,
    as hypercorn's `graceful_timeout`; the same drain a stdio hang-up gets); a second signal
    ends the wait at once. The first signal is appended to `received`, so the program can exit
    with its status. The cancel carries `SERVER_SHUTDOWN`: a request it ends records the shutdown.
    """
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for signum in signals:
            log.info("received %s; shutting down", signal.Signals(signum).name)
            notify_systemd("STOPPING=1")
            received.append(signum)
            break
        if drain is not None:
            async with trio.open_nursery() as draining:
                draining.start_soon(_drain_then_stop, drain, grace, draining.cancel_scope)
                async for again in signals:
                    log.info("received %s again; stopping now", signal.Signals(again).name)
                    draining.cancel_scope.cancel()
        cancel_scope.cancel(reason=SERVER_SHUTDOWN)  # what a request it ends records (not the agent's cancel)


async def reload_on_sighup(reload: Callable[[], object]) -> None:
    """SIGHUP reads the policy files again (`PolicyGate.reload`; docs/POLICY.md), as daemons reload their config."""
    with trio.open_signal_receiver(signal.SIGHUP) as signals:
        async for _ in signals:
            log.info("received SIGHUP; reloading the policy files")
            reload()


async def _drain_then_stop(drain: Callable[[float], Awaitable[None]], grace: float, scope: trio.CancelScope) -> None:
    """Wait for the drain (bounded by `grace`), then end the wait for a second signal."""
    with trio.move_on_after(grace):
        await drain(grace)
    scope.cancel()


async def run_server(config: ServerConfig, *, stdio: bool = True) -> int | None:
    """Serve until the stdio caller disconnects, or forever when HTTP listeners are up.

    Returns the signal (SIGTERM, SIGINT) that stopped the server, or None when its caller left.
    """
    app = OublietteServer(config)
    received: list[int] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(stop_on_signals, nursery.cancel_scope, received, app.drain)
        nursery.start_soon(reload_on_sighup, app.policy.reload)
        bound = await nursery.start(app.serve)
        # Before the ready line, so `status` run once the server is ready finds it (serving_file.py).
        await nursery.start(keep_serving_file, config.data_dir, ServingRecord(
            pid=os.getpid(), server=app.server_id, relay=bound.relay, http=bound.http, metrics=bound.metrics,
            instances=sorted(config.instances)))
        announce_ready(bound)
        freeze_startup_heap()  # start-up is done: no collection walks its objects again (oubliette_runtime/gc_freeze.py)
        if stdio:
            await _serve_the_stdio_caller(app, config, nursery)
    return received[0] if received else None


async def _serve_the_stdio_caller(app: OublietteServer, config: ServerConfig, nursery: trio.Nursery) -> None:
    """The stdio caller until it leaves; then the server stops, unless HTTP listeners keep serving."""
    log.info("serving the caller on stdio; relay at %s", config.relay_address)
    await app.serve_stdio_caller()
    if config.http:
        log.info("the stdio caller disconnected; HTTP listeners keep serving")
        return
    log.info("stdio caller disconnected; shutting down")
    await app.drain(SHUTDOWN_DRAIN_SECONDS)
    nursery.cancel_scope.cancel(reason=SERVER_SHUTDOWN)
