"""Fault tests: kill -9 of the agent's own `oubliette-client` mid-call, with the real programs.

(Killing the guest runtime and the server mid-call is in test_orphans.py, killing an HTTP caller in
test_ownership.py, a caller that disconnects in test_caller_tool_relay.py.)

The agent here speaks MCP to `oubliette-client` by hand over its stdin/stdout, so the test holds
the client's process and can SIGKILL it while a caller tool call is in flight. What must hold:
the caller hears at once that the request was withdrawn, a late answer is refused (nothing is
resolved twice), and the log has exactly one request and one outcome for it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from typing import Any

import trio

from harness import Deployment, HandMcp, structured, text_of

KILL_BOUND = 5.0
"""How soon after SIGKILL of the client the caller must be told the request was cancelled."""

NOTIFY = {"name": "send_notification", "inputSchema": {"type": "object", "properties": {"message": {"type": "string"}}}}


async def test_killing_the_agents_client_mid_call_withdraws_the_request_at_once(deployment: Deployment) -> None:
    async with deployment.caller() as (caller, events):
        declared = await caller.call_tool("session_message", {
            "instance": "box1", "session_id": "k1", "message": "hi",
            "context": {"caller_id": "myapp", "caller_tools": [NOTIFY]},
        })
        assert not declared.is_error, text_of(declared)
        process = await trio.lowlevel.open_process(
            [sys.executable, "-m", "oubliette_client", "--relay", deployment.relay, "--instance", "box1",
             "--token", deployment.token("box1"), "--session", "mcp:k1"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        )
        try:
            agent = HandMcp(process)
            with trio.fail_after(30):
                await agent.send({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
                    "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "hand", "version": "1"},
                }})
                assert "result" in await agent.response(1)
                await agent.send({"jsonrpc": "2.0", "method": "notifications/initialized"})
                await agent.send({"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": {
                    "name": "myapp_send_notification", "arguments": {"message": "hello"},
                }})
                request = await events.wait_type("caller_tool_request", tool="send_notification")
            process.kill()
            killed_at = time.monotonic()
            cancelled = await events.wait_type("caller_tool_cancelled", request_id=request["request_id"], timeout=KILL_BOUND)
            took = time.monotonic() - killed_at
        finally:
            process.kill()
            with trio.CancelScope(shield=True):
                await process.wait()
        assert took < KILL_BOUND, f"the caller heard of it {took:.1f} s after the kill"
        assert cancelled["reason"] == "cancelled by the agent"

        late = await caller.call_tool("caller_tool_response", {
            "session_id": "k1", "request_id": request["request_id"], "result": {"status": "sent"},
        })
        assert late.is_error and "no longer pending" in text_of(late), text_of(late)

        frames = structured(await caller.call_tool("session_events", {
            "session_id": "k1", "types": ["caller_tool_request", "caller_tool_result", "caller_tool_cancelled"],
        }))["frames"]
        assert [(f["type"], f["payload"]["request_id"]) for f in frames] == [
            ("caller_tool_request", request["request_id"]), ("caller_tool_cancelled", request["request_id"]),
        ], "one request, one outcome, nothing resolved twice"
