"""Helpers of tests/e2e/test_approval_flows.py that other test files use
too, kept here so that no test file imports another."""

from __future__ import annotations

from typing import Any

import trio
from loop_caller import TURN_TIMEOUT, LoopCaller

DELETE = {
    "name": "delete_file",
    "description": "Delete a file on the host",
    "inputSchema": {
        "type": "object", "properties": {"path": {"type": "string", "pattern": "^/tmp/"}}, "required": ["path"],
    },
    "requires_approval": True,
}
GATED = "myapp_delete_file"
BASH_INPUT = {"command": "rm -rf build", "description": "Remove the build output"}
PROMPT = {"tool_name": "Bash", "input": BASH_INPUT, "tool_use_id": "toolu_01AbC"}


async def frames(caller: LoopCaller, session_id: str, type_: str, count: int = 1, **match: Any) -> list[dict[str, Any]]:
    """The caller's own view through `session_events`: long-poll until `count` frames of `type_` whose
    payload has every `match` field; their payloads (with `seq`)."""
    found: list[dict[str, Any]] = []
    after = 0
    with trio.fail_after(TURN_TIMEOUT):
        while len(found) < count:
            read = await caller.call("session_events", session_id=session_id, types=[type_], after_seq=after, wait_ms=10_000)
            assert "error" not in read, read
            for frame in read["frames"]:
                payload = {"seq": frame["seq"], **frame["payload"]}
                if all(payload.get(k) == v for k, v in match.items()):
                    found.append(payload)
            if read["frames"]:
                after = read["frames"][-1]["seq"]
    return found


async def decide(caller: LoopCaller, session_id: str, **answer: Any) -> dict[str, Any]:
    return await caller.call("approval_response", session_id=session_id, **answer)


def call(tool_name: str, **options: Any) -> dict[str, Any]:
    """One scripted call of the loop agent with options (`progress`, `cancel_on_progress`)."""
    return {"tool": tool_name, **options}
