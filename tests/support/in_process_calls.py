"""Helpers of tests/server/features/test_caller_tool_answers.py that other test files use
too, kept here so that no test file imports another."""

from __future__ import annotations

from contextlib import asynccontextmanager
from types import SimpleNamespace
from typing import Any, AsyncIterator

import trio
import trio.testing

from harness import EVENT_TIMEOUT, Deployment, EventLog, structured, text_of
from oubliette_client.relay_link import RelayLink
from oubliette_client.settings import RelaySettings
from oubliette_server.core.callers import CallerConnection
from oubliette_server.program.app import OublietteServer
from protocol import RelayError

INSTANCE = "box1"
SESSION = "s1"
NOTIFY = {
    "name": "send_notification",
    "description": "Send notification",
    "inputSchema": {"type": "object", "properties": {"message": {"type": "string"}}},
}


async def declare(caller: Any, session_id: str = SESSION, tools: list[dict] | None = None) -> None:
    result = await caller.call_tool("session_message", {
        "instance": INSTANCE, "session_id": session_id, "message": "hi",
        "context": {"caller_id": "myapp", "caller_tools": tools if tools is not None else [NOTIFY]},
    })
    assert not result.is_error, text_of(result)


async def result_frames(caller: Any, request_id: str) -> list[dict]:
    """The caller_tool_result frames stored for `request_id` (read back from the log)."""
    read = await caller.call_tool("session_events", {
        "session_id": SESSION, "instance": INSTANCE, "types": ["caller_tool_result"], "limit": 200,
    })
    assert not read.is_error, text_of(read)
    return [f for f in structured(read)["frames"] if f["payload"]["request_id"] == request_id]


@asynccontextmanager
async def agent_call_in_flight(deployment: Deployment, events: EventLog) -> AsyncIterator[tuple[dict, dict, trio.Event]]:
    """An agent's call of myapp_send_notification, waiting for the caller: (request event, outcome, finished)."""
    async with deployment.agent(INSTANCE, f"mcp:{SESSION}") as agent, trio.open_nursery() as nursery:
        outcome: dict[str, Any] = {}
        finished = trio.Event()

        async def call() -> None:
            outcome["result"] = await agent.call_tool("myapp_send_notification", {"message": "hi"})
            finished.set()

        nursery.start_soon(call)
        request = await events.wait_type("caller_tool_request")
        yield request, outcome, finished
        with trio.fail_after(EVENT_TIMEOUT):
            await finished.wait()


class RecordingMcpSession:
    """Stands in for a caller's MCP session: the events the server pushes to that caller."""

    def __init__(self) -> None:
        self.events = EventLog()

    async def send_notification(self, notification: Any, related_request_id: Any = None) -> None:
        await self.events.on_log(notification.params)


def call_context() -> Any:
    """What CallerApi needs of an MCP request context."""
    return SimpleNamespace(protocol_version="2025-11-25", session=None, request_id=None)


class InProcess:
    def __init__(self, server: OublietteServer, nursery: trio.Nursery) -> None:
        self.server = server
        self.nursery = nursery
        self.tools = server.caller_api()

    def open_caller(self) -> tuple[CallerConnection, EventLog]:
        caller = self.server.open_caller("test")
        recorder = RecordingMcpSession()
        caller.mcp_session = recorder
        return caller, recorder.events

    async def call(self, caller: CallerConnection, name: str, arguments: dict[str, Any]) -> Any:
        return await self.tools.call(call_context(), caller, name, arguments)

    async def declare(self, caller: CallerConnection, tools: list[dict]) -> None:
        result = await self.call(caller, "session_message", {
            "instance": INSTANCE, "session_id": SESSION, "message": "hi",
            "context": {"caller_id": "myapp", "caller_tools": tools},
        })
        assert not result.is_error, text_of(result)

    async def connect_agent(self, deployment: Deployment) -> RelayLink:
        """oubliette-client's relay link for the session, connected."""
        settings = RelaySettings(
            relay=deployment.relay, instance=INSTANCE,
            token=self.server.tokens.token_for(INSTANCE), session=f"mcp:{SESSION}",
        )
        link = RelayLink(settings, "client", _ignore_notification)
        self.nursery.start_soon(link.run)
        with trio.fail_after(EVENT_TIMEOUT):
            await link.wait_connected()
        return link


async def _ignore_notification(method: str, params: dict) -> None:
    pass


@asynccontextmanager
async def in_process(deployment: Deployment, **config: Any) -> AsyncIterator[InProcess]:
    async with deployment.embedded(**config) as embedded:
        yield InProcess(embedded.app, embedded.nursery)


def start_agent_call(nursery: trio.Nursery, link: RelayLink) -> tuple[dict[str, Any], trio.Event, trio.CancelScope]:
    outcome: dict[str, Any] = {}
    finished = trio.Event()
    scope = trio.CancelScope()

    async def call() -> None:
        with scope:
            try:
                outcome["result"] = await link.request(
                    "caller_tool", {"tool": "send_notification", "arguments": {"message": "hi"}},
                )
            except RelayError as err:
                outcome["error"] = err
        outcome["cancelled"] = scope.cancelled_caught
        finished.set()

    nursery.start_soon(call)
    return outcome, finished, scope
