"""The demo: a caller declares a tool, the agent in a "sandbox" calls it, the call comes back.

It starts, all on this machine:
  1. `oubliette-server` as the caller's stdio MCP server (this script is the caller, using the MCP SDK),
  2. a guest runtime, `oubliette-client run -- <demo agent>`, standing in for the sandbox,
  3. then sends a message asking the agent to call `myapp_send_notification({"message": "hello"})`
     with `wait`: the wait stops with `requires_action` and the request, the caller runs the tool
     and answers with `caller_tool_response` and `wait`, which returns the turn's end. Only tool
     results drive it, as for a model; the events printed alongside are an addition for programs.

Run:  python examples/demo.py
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import trio
from mcp import Client
from mcp.client.stdio import StdioServerParameters

CALLER_TOOLS = [{
    "name": "send_notification",
    "description": "Send a notification to the user of myapp",
    "inputSchema": {"type": "object", "properties": {"message": {"type": "string"}}, "required": ["message"]},
}]
MESSAGE = 'Please call myapp_send_notification {"message": "hello"}'


def say(who: str, text: str) -> None:
    print(f"[{who:>6}] {text}", flush=True)


async def demo(workdir: Path) -> int:
    data_dir, relay = workdir / "data", f"unix:{workdir / 'relay.sock'}"
    token = subprocess.run(
        [sys.executable, "-m", "oubliette_server", "token", "demo", "--data-dir", str(data_dir)],
        check=True, capture_output=True, text=True,
    ).stdout.strip()
    events: trio.MemorySendChannel[dict[str, Any]]
    events, incoming = trio.open_memory_channel[dict[str, Any]](100)

    async def on_log(params: Any) -> None:
        if params.logger == "oubliette" and isinstance(params.data, dict):
            await events.send(params.data)

    server = StdioServerParameters(
        command=sys.executable,
        args=["-m", "oubliette_server", "--relay", relay, "--data-dir", str(data_dir), "--log-level", "WARNING"],
    )
    async with Client(server, mode="legacy", logging_callback=on_log) as caller:
        say("caller", "started oubliette-server")
        guest = await trio.lowlevel.open_process(
            [sys.executable, "-m", "oubliette_client", "run", "--relay", relay, "--instance", "demo",
             "--token", token, "--log-level", "WARNING", "--",
             sys.executable, "-m", "oubliette_client.demo_agent", "--mcp-config", "{mcp_config}"],
        )
        say("caller", "started the guest runtime for instance 'demo' (the demo agent stands in for an LLM)")
        try:
            async with trio.open_nursery() as nursery:

                async def show_events() -> None:
                    async for event in incoming:
                        if event["type"] == "assistant.delta":
                            say("agent", event.get("text", ""))
                        elif event["type"] != "user.message":
                            say("event", event["type"])

                nursery.start_soon(show_events)
                say("caller", f"session_message: {MESSAGE}")
                with trio.fail_after(60):
                    reply = await caller.call_tool("session_message", {
                        "instance": "demo", "message": MESSAGE, "wait": True,
                        "context": {"caller_id": "myapp", "caller_tools": CALLER_TOOLS},
                    })
                    outcome = reply.structured_content or {}
                    while outcome.get("stop_reason") == "requires_action":
                        for request in outcome["pending"]:
                            say("stop", f"requires_action: caller_tool_request {request['tool']}"
                                        f"({json.dumps(request['arguments'])}) request_id={request['request_id']}")
                            say("caller", f"running send_notification: {request['arguments'].get('message')!r}")
                            reply = await caller.call_tool("caller_tool_response", {
                                "session_id": outcome["session_id"], "request_id": request["request_id"],
                                "result": {"status": "sent"}, "wait": True,
                            })
                            outcome = {"session_id": outcome["session_id"], **(reply.structured_content or {})}
                nursery.cancel_scope.cancel()
            say("caller", f"turn ended: {outcome.get('stop_reason')}")
            print("\nAgent's final answer:\n" + str(outcome.get("text", "")), flush=True)
            ok = outcome.get("stop_reason") == "end_turn" and "returned" in str(outcome.get("text"))
            return 0 if ok else 1
        finally:
            guest.terminate()
            with trio.CancelScope(shield=True):
                await guest.wait()


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="oubliette-demo-") as tmp:
        return trio.run(demo, Path(tmp))


if __name__ == "__main__":
    sys.exit(main())
