"""Fewer messages per relayed call: the answering caller is not sent its own answer.

The `caller_tool_result` frame is still stored and still pushed to every other sink of the
session; the caller that answered gets it as an event only with `context.echo_own_answers`.
"""

from __future__ import annotations

from typing import Any

import pytest
import trio

from harness import Deployment, EventLog, structured, text_of

pytestmark = pytest.mark.in_process

INSTANCE = "box1"
SESSION = "s1"
NOTIFY = {
    "name": "send_notification",
    "description": "Send notification",
    "inputSchema": {"type": "object", "properties": {"message": {"type": "string"}}},
}


class RecordingSink:
    """Another follower of the session (as a 2026-07-28 waiting request's sink is)."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []

    def push(self, event: dict) -> None:
        """Keep the event."""
        self.events.append(event)


async def answered_call(deployment: Deployment, caller: Any, events: EventLog, echo: bool | None) -> tuple[str, RecordingSink]:
    """Declare (with `echo_own_answers` if not None), follow the session with a second sink, let the
    agent call and answer it; then send one more message, whose event comes after any echo would.
    Returns the request id and the second sink."""
    context: dict[str, Any] = {"caller_id": "myapp", "caller_tools": [NOTIFY]}
    if echo is not None:
        context["echo_own_answers"] = echo
    declared = await caller.call_tool("session_message", {
        "instance": INSTANCE, "session_id": SESSION, "message": "hi", "context": context,
    })
    assert not declared.is_error, text_of(declared)
    other = RecordingSink()
    deployment.app.sessions.get(INSTANCE, "mcp", SESSION).sinks.add(other)
    async with deployment.agent(INSTANCE, f"mcp:{SESSION}") as agent:
        async with trio.open_nursery() as nursery:
            results: list[Any] = []

            async def call() -> None:
                results.append(await agent.call_tool("myapp_send_notification", {"message": "x"}))

            nursery.start_soon(call)
            request = await events.wait_type("caller_tool_request")
            reply = await caller.call_tool("caller_tool_response", {
                "session_id": SESSION, "request_id": request["request_id"], "result": {"ok": True},
            })
            assert structured(reply) == {"resolved": True}
        assert results[0].structured_content == {"ok": True}
    later = await caller.call_tool("session_message", {"instance": INSTANCE, "session_id": SESSION, "message": "later"})
    await events.wait_type("user.message", msg_id=structured(later)["msg_id"])
    return request["request_id"], other


def results_for(events: list[dict[str, Any]], request_id: str) -> list[dict[str, Any]]:
    return [e for e in events if e.get("type") == "caller_tool_result" and e.get("request_id") == request_id]


async def test_the_answering_caller_gets_no_echo_of_its_answer(deployment: Deployment) -> None:
    async with deployment.caller() as (caller, events):
        request_id, other = await answered_call(deployment, caller, events, echo=None)
        stored = await caller.call_tool("session_events", {
            "session_id": SESSION, "instance": INSTANCE, "types": ["caller_tool_result"],
        })
    assert results_for(events.events, request_id) == [], "the caller was sent its own answer back"
    assert len(results_for(other.events, request_id)) == 1, "another follower of the session gets every frame"
    frames = [f for f in structured(stored)["frames"] if f["payload"]["request_id"] == request_id]
    assert len(frames) == 1 and frames[0]["payload"]["result"] == {"ok": True}, "the frame is in the log"


async def test_echo_own_answers_sends_the_result_event_back(deployment: Deployment) -> None:
    async with deployment.caller() as (caller, events):
        request_id, other = await answered_call(deployment, caller, events, echo=True)
    [echoed] = results_for(events.events, request_id)
    assert echoed["result"] == {"ok": True}
    assert len(results_for(other.events, request_id)) == 1
