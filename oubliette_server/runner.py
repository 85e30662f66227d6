"""Run the command-line server: relay listener plus the stdio caller."""

from __future__ import annotations

import logging

import trio

from .app import OublietteServer
from .caller_mcp import serve_stdio_caller
from .config import ServerConfig

log = logging.getLogger("oubliette.server")

SHUTDOWN_DRAIN_SECONDS = 2.0


async def run_server(config: ServerConfig) -> None:
    """Serve until the stdio caller disconnects (the process belongs to it)."""
    app = OublietteServer(config)
    async with trio.open_nursery() as nursery:
        await nursery.start(app.serve)
        log.info("serving the caller on stdio; relay at %s", config.relay_address)
        await serve_stdio_caller(app)
        log.info("stdio caller disconnected; shutting down")
        await app.drain(SHUTDOWN_DRAIN_SECONDS)
        nursery.cancel_scope.cancel()
