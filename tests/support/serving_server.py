"""Helpers of tests/server/doors/test_session_keys.py that other test files use
too, kept here so that no test file imports another."""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

import trio
from in_process_calls import InProcess

from harness import Deployment, EmbeddedHttpServer
from oubliette_server.program.app import OublietteServer

INSTANCE = "box1"


class Served:
    """One in-process server with an HTTP listener: its app, an HTTP client side, and caller tools."""

    def __init__(self, app: OublietteServer, http: EmbeddedHttpServer, nursery: trio.Nursery) -> None:
        self.app = app
        self.http = http
        self.callers = InProcess(app, nursery)

    async def held_and_stored(self) -> tuple[int, int]:
        """(sessions held in memory, the instance's last seq): what a refusal must leave alone."""
        return len(self.app.sessions.all()), await self.app.store.last_seq(INSTANCE)


@asynccontextmanager
async def serving(deployment: Deployment, **settings: Any) -> AsyncIterator[Served]:
    async with deployment.embedded(http=["127.0.0.1:0"], instances={INSTANCE: {}}, **settings) as embedded:
        yield Served(embedded.app, EmbeddedHttpServer(deployment, embedded.app, embedded.urls[0]), embedded.nursery)
