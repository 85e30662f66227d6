"""Helpers of tests/server/features/test_approvals.py that other test files use
too, kept here so that no test file imports another."""

from __future__ import annotations

from typing import Any

import trio

from in_process_calls import INSTANCE, SESSION, InProcess

from harness import EVENT_TIMEOUT, Deployment, EventLog
from oubliette_client.relay_link import RelayLink
from oubliette_server.core.callers import CallerConnection
from protocol import RelayError

DELETE = {
    "name": "delete_file",
    "description": "Delete a file on the host",
    "inputSchema": {
        "type": "object",
        "properties": {"path": {"type": "string", "pattern": "^/tmp/"}},
        "required": ["path"],
    },
    "requires_approval": True,
}


async def gated_session(proc: InProcess, deployment: Deployment, tools: list[dict] | None = None) -> tuple[CallerConnection, EventLog, RelayLink]:
    owner, events = proc.open_caller()
    await proc.declare(owner, tools or [DELETE])
    link = await proc.connect_agent(deployment)
    return owner, events, link


async def answer(proc: InProcess, caller: CallerConnection, **fields: Any) -> Any:
    return await proc.call(caller, "approval_response", {"session_id": SESSION, **fields})


async def stored(proc: InProcess, type_: str) -> list[dict[str, Any]]:
    from oubliette_server.store.sqlite import FrameQuery

    return [f.to_event() for f in await proc.server.store.query(INSTANCE, FrameQuery(session_id=SESSION, types=(type_,), limit=200))]


class AgentCall:
    """One `caller_tool` request of the agent, in flight in the test's nursery."""

    def __init__(
        self, nursery: trio.Nursery, link: RelayLink, tool: str, arguments: dict[str, Any], timeout: float | None = None,
    ) -> None:
        self.result: Any = None
        self.error: RelayError | None = None
        self.finished = trio.Event()
        self.scope = trio.CancelScope()
        nursery.start_soon(self._run, link, tool, arguments, timeout)

    async def _run(self, link: RelayLink, tool: str, arguments: dict[str, Any], timeout: float | None) -> None:
        with self.scope:
            try:
                self.result = await link.request("caller_tool", {"tool": tool, "arguments": arguments}, timeout=timeout)
            except RelayError as err:
                self.error = err
        self.finished.set()

    async def outcome(self) -> Any:
        with trio.fail_after(EVENT_TIMEOUT):
            await self.finished.wait()
        return self
