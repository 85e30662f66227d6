"""Helpers of tests/server/doors/test_relay.py that other test files use
too, kept here so that no test file imports another."""

from __future__ import annotations

from typing import Any

import attrs

from harness import EVENT_TIMEOUT, EventLog, RawRelay, structured, text_of

INSTANCE = "box1"
SESSION = "s1"
SESSION_KEY = f"mcp:{SESSION}"
PROTOCOL = "oubliette-relay/1"


def hello_params(token: str, session: str | None = SESSION_KEY, protocol: str = PROTOCOL) -> dict[str, Any]:
    params: dict[str, Any] = {"protocol": protocol, "role": "client", "instance": INSTANCE, "token": token}
    if session is not None:
        params["session"] = session
    return params


async def handshake(raw: RawRelay, token: str, session: str | None = SESSION_KEY) -> tuple[list[dict], dict]:
    """Send `hello`; return (the messages that came before its response, the response)."""
    await raw.send({"jsonrpc": "2.0", "id": 0, "method": "hello", "params": hello_params(token, session)})
    before: list[dict] = []
    while True:
        message = await raw.receive(EVENT_TIMEOUT)
        assert message is not None, f"connection closed during hello (after {before})"
        if message.get("id") == 0 and "method" not in message:
            return before, message
        before.append(message)


def caller_tool_request(request_id: Any, arguments: dict[str, Any], tool: str = "send_notification") -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": request_id, "method": "caller_tool", "params": {"tool": tool, "arguments": arguments}}


async def response_to(raw: RawRelay, request_id: Any) -> dict[str, Any]:
    """The response to `request_id` (notifications in between are skipped)."""
    while True:
        message = await raw.receive(EVENT_TIMEOUT)
        assert message is not None, f"connection closed before the response to {request_id!r}"
        if "method" not in message:
            assert message.get("id") == request_id, f"expected the response to {request_id!r}, got {message}"
            return message


@attrs.define
class Env:
    """The caller side of a running server, and the instance's token."""

    caller: Any
    events: EventLog
    token: str

    async def wait_request(self, arguments: dict[str, Any]) -> dict[str, Any]:
        return await self.events.wait_for(
            lambda e: e.get("type") == "caller_tool_request" and e.get("arguments") == arguments
        )

    async def answer(self, request: dict[str, Any], result: Any) -> None:
        reply = await self.caller.call_tool("caller_tool_response", {
            "session_id": request["session_id"], "request_id": request["request_id"], "result": result,
        })
        assert not reply.is_error, text_of(reply)
        assert structured(reply) == {"resolved": True}

    async def relay_call(self, raw: RawRelay, request_id: Any, label: str) -> None:
        """A whole caller tool call over `raw`: request, caller answers, the response has its result."""
        arguments = {"message": label}
        await raw.send(caller_tool_request(request_id, arguments))
        request = await self.wait_request(arguments)
        await self.answer(request, {"echo": label})
        assert await response_to(raw, request_id) == {
            "jsonrpc": "2.0", "id": request_id, "result": {"result": {"echo": label}},
        }
