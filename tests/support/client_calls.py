"""Helpers of tests/client/test_stdio_server.py that other test files use
too, kept here so that no test file imports another."""

from __future__ import annotations

from typing import Any

from harness import structured, text_of

NOTIFY_SCHEMA = {
    "type": "object",
    "properties": {"message": {"type": "string"}, "urgent": {"type": "boolean"}},
    "required": ["message"],
}
NOTIFY = {"name": "send_notification", "description": "Send notification", "inputSchema": NOTIFY_SCHEMA}


async def declare(caller: Any, instance: str, session_id: str, tools: list[dict], caller_id: str = "myapp") -> dict:
    result = await caller.call_tool("session_message", {
        "instance": instance, "session_id": session_id, "message": "hi",
        "context": {"caller_id": caller_id, "caller_tools": tools},
    })
    assert not result.is_error, text_of(result)
    return structured(result)


async def respond(caller: Any, session_id: str, request_id: str, **answer: Any) -> Any:
    return await caller.call_tool("caller_tool_response", {"session_id": session_id, "request_id": request_id, **answer})
