"""Helpers of tests/e2e/test_caller_loop.py that other test files use
too, kept here so that no test file imports another."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import trio

from harness import PYTHON, structured, text_of

TURN_TIMEOUT = 60.0
LOOP_AGENT = [PYTHON, str(Path(__file__).with_name("loop_agent.py")), "{mcp_config}"]
INSTANCE = "box1"


def tool(name: str, **extra: Any) -> dict[str, Any]:
    return {"name": name, "description": f"{name} on the host",
            "inputSchema": {"type": "object", "properties": {"n": {"type": "integer"}}}, **extra}


def script(*steps: list[tuple[str, dict]]) -> str:
    """The loop agent's message: each step a list of (published tool name, arguments) called at once."""
    return json.dumps({"steps": [[{"tool": name, "arguments": args} for name, args in step] for step in steps]})


IDLE = script()


class LoopCaller:
    """A caller acting on tool results only: each call returns the structured result, or
    `{"error": text}` for a tool error; a 2026-07-28 HTTP caller's owner_key is passed back."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self.owner_key: str | None = None

    async def call(self, name: str, **arguments: Any) -> dict[str, Any]:
        if self.owner_key is not None:
            arguments.setdefault("owner_key", self.owner_key)
        with trio.fail_after(TURN_TIMEOUT):
            result = await self.client.call_tool(name, arguments)
        if result.is_error:
            return {"error": text_of(result)}
        data = structured(result)
        if data.get("owner_key"):
            self.owner_key = data["owner_key"]
        return data

    async def message(self, session_id: str, message: str, tools: list[dict] | None = None, **extra: Any) -> dict:
        args: dict[str, Any] = {"instance": INSTANCE, "session_id": session_id, "message": message, **extra}
        if tools is not None:
            args["context"] = {"caller_id": "myapp", "caller_tools": tools}
        return await self.call("session_message", **args)

    async def answer(self, session_id: str, request_id: str, **answer: Any) -> dict:
        return await self.call("caller_tool_response", session_id=session_id, request_id=request_id, **answer)


def ends_with(stop: dict, reason: str) -> dict:
    assert stop.get("stop_reason") == reason, stop
    return stop


async def one_answered_call(caller: LoopCaller) -> dict:
    """The loop once, in session s7: requires_action with the arguments as soon as the agent
    calls, the answer with wait, then end_turn; returns the end_turn stop."""
    first = ends_with(await caller.message(
        "s7", script([("myapp_send_notification", {"n": 7})]), [tool("send_notification")], wait=30,
    ), "requires_action")
    [a] = first["pending"]
    assert a["arguments"] == {"n": 7}
    return ends_with(await caller.answer("s7", a["request_id"], result={"status": "sent"}, wait=30), "end_turn")
