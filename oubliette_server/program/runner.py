"""Run the command-line server: relay listener, HTTP listeners, and the stdio caller."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import sys
from typing import Awaitable, Callable

import trio

from protocol.gc_freeze import freeze_startup_heap

from ..features.toolsets.from_config import register_from_config
from .app import OublietteServer
from .config import ServerConfig

log = logging.getLogger("oubliette.server")

SHUTDOWN_DRAIN_SECONDS = 2.0
READY_PREFIX = "oubliette-server ready "


def announce_ready(relay: str, http: list[str], metrics: list[str] | None = None) -> None:
    """One machine-readable stderr line once every listener is bound (stdout carries MCP)."""
    ready: dict[str, object] = {"relay": relay, "http": http}
    if metrics:
        ready["metrics"] = metrics
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

    First the relay requests in flight may send their answers (`drain`, at most `grace` seconds,
    as hypercorn's `graceful_timeout`; the same drain a stdio hang-up gets); a second signal
    ends the wait at once. The first signal is appended to `received`, so the program can exit
    with its status.
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
        cancel_scope.cancel()


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
        await nursery.start(app.serve)
        if config.toolsets or config.allowlists:
            await register_from_config(app, config.toolsets, config.allowlists)
        http_urls: list[str] = []
        metrics_urls: list[str] = []
        if config.http or config.metrics:
            api = app.http_api()
            if config.http:
                http_urls = await nursery.start(api.serve, config.http)
                log.info("HTTP listening on %s", ", ".join(http_urls))
            if config.metrics:
                metrics_urls = await nursery.start(api.serve_metrics, config.metrics)
                log.info("metrics (no token) listening on %s", ", ".join(metrics_urls))
        announce_ready(config.relay_address, http_urls, metrics_urls)
        freeze_startup_heap()  # start-up is done: no collection walks its objects again (protocol/gc_freeze.py)
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
    nursery.cancel_scope.cancel()
