"""Helpers of tests/protocol/test_peer.py that other test files use
too, kept here so that no test file imports another."""

from __future__ import annotations

from contextlib import asynccontextmanager
from types import SimpleNamespace
from typing import Any, AsyncIterator

import trio
import trio.testing

from harness import Deployment, EventLog, text_of

INSTANCE = "box1"


class RecordingMcpSession:
    """Stands in for a caller's MCP session: the events the server pushes to that caller."""

    def __init__(self) -> None:
        self.events = EventLog()

    async def send_notification(self, notification: Any, related_request_id: Any = None) -> None:
        await self.events.on_log(notification.params)


class InProcess:
    """The server embedded in the test's nursery, driven through its caller-facing tools."""

    def __init__(self, server: Any, nursery: trio.Nursery) -> None:

        self.server = server
        self.nursery = nursery
        self.tools = server.caller_api()

    def open_caller(self) -> tuple[Any, EventLog]:
        caller = self.server.open_caller("test")
        recorder = RecordingMcpSession()
        caller.mcp_session = recorder
        return caller, recorder.events

    async def declare(self, caller: Any, session_id: str, caller_id: str, tools: list[dict]) -> None:
        context = SimpleNamespace(protocol_version="2025-11-25", session=None, request_id=None)
        result = await self.tools.call(context, caller, "session_message", {
            "instance": INSTANCE, "session_id": session_id, "message": "hi",
            "context": {"caller_id": caller_id, "caller_tools": tools},
        })
        assert not result.is_error, text_of(result)


@asynccontextmanager
async def in_process(deployment: Deployment, **config: Any) -> AsyncIterator[InProcess]:
    async with deployment.embedded(**config) as embedded:
        yield InProcess(embedded.app, embedded.nursery)
