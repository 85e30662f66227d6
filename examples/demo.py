"""The demo: a caller declares a tool, the agent in a "sandbox" calls it, the call comes back.

It starts, all on this machine:
  1. `oubliette-server` as the caller's stdio MCP server (this script is the caller, using the MCP SDK),
  2. a guest runtime for instance `demo` (`GuestRuntime`, what `oubliette-client run` runs), in this
     process, whose agent command is the bundled demo agent (`oubliette-client demo-agent`),
  3. then sends a message asking the agent to call `myapp_send_notification({"message": "hello"})`
     with `wait`: the wait stops with `requires_action` and the request, the caller runs the tool
     and answers with `caller_tool_response` and `wait`, which returns the turn's end. Only tool
     results drive it, as for a model; the events printed alongside are an addition for programs.

The output is the same every run (the README shows it verbatim; tests/e2e/test_demo.py compares):
events arrive in an order that depends on timing (the agent's output lines and its tool call
race to the log), so the demo prints the steps of the flow in their causal order, waiting for
each event before it prints it, and leaves out ids that change between runs.

It runs as few Python processes as the flow needs (each spends about a second importing the
MCP SDK): this script, the server, the demo agent and the `oubliette-client` it spawns.

Run:  python examples/demo.py
"""

from __future__ import annotations

from oubliette_runtime.interrupts import INTERRUPTED, exception_leaves, exit_on_interrupt, raise_on_interrupt

exit_on_interrupt()  # Ctrl-C while the imports below load (a second): status 130, no traceback

import json  # noqa: E402
import logging  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Callable  # noqa: E402

import trio  # noqa: E402
from mcp import Client  # noqa: E402
from mcp.client.stdio import StdioServerParameters, stdio_client  # noqa: E402

from oubliette_client import GuestRuntime, RelaySettings  # noqa: E402
from oubliette_server.core.auth import TokenAuthority  # noqa: E402

CALLER_TOOLS = [{
    "name": "send_notification",
    "description": "Send a notification to the user of myapp",
    "inputSchema": {"type": "object", "properties": {"message": {"type": "string"}}, "required": ["message"]},
}]
MESSAGE = 'Please call myapp_send_notification {"message": "hello"}'
INSTANCE = "demo"
STEP_TIMEOUT = 60.0


def say(who: str, text: str) -> None:
    print(f"[{who:>6}] {text}", flush=True)


class Events:
    """The caller's events (`notifications/message` from the `oubliette` logger), awaitable in any order."""

    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []
        self._changed = trio.Event()

    async def on_log(self, params: Any) -> None:
        if params.logger == "oubliette" and isinstance(params.data, dict):
            self.seen.append(params.data)
            self._changed.set()
            self._changed = trio.Event()

    async def first(self, predicate: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
        """The first event, already seen or still to come, that satisfies `predicate`."""
        with trio.fail_after(STEP_TIMEOUT):
            while True:
                for event in self.seen:
                    if predicate(event):
                        return event
                await self._changed.wait()

    async def of_type(self, type_: str) -> dict[str, Any]:
        return await self.first(lambda event: event.get("type") == type_)


async def demo(workdir: Path) -> int:
    data_dir, relay = workdir / "data", f"unix:{workdir / 'relay.sock'}"
    # What `oubliette-server token demo --data-dir DIR` prints, without starting another Python.
    token = TokenAuthority.for_data_dir(data_dir).token_for(INSTANCE)
    events = Events()
    server = StdioServerParameters(
        command=sys.executable,
        args=["-m", "oubliette_server", "--relay", relay, "--data-dir", str(data_dir), "--log-level", "WARNING"],
    )
    guest = GuestRuntime(
        RelaySettings(relay=relay, instance=INSTANCE, token=token),
        [sys.executable, "-m", "oubliette_client", "demo-agent", "--mcp-config", "{mcp_config}"],
    )
    with open(workdir / "server.log", "w") as server_log:
        async with trio.open_nursery() as nursery, \
                Client(stdio_client(server, errlog=server_log), mode="legacy", logging_callback=events.on_log) as caller:
            nursery.start_soon(guest.run)
            with trio.fail_after(STEP_TIMEOUT):
                await guest.link.wait_connected()  # else a slow start could make the message `no_guest`
            say("caller", f"started oubliette-server and a guest runtime for instance '{INSTANCE}'")

            say("caller", f"session_message: {MESSAGE}")
            with trio.fail_after(STEP_TIMEOUT):
                reply = await caller.call_tool("session_message", {
                    "instance": INSTANCE, "message": MESSAGE, "wait": True,
                    "context": {"caller_id": "myapp", "caller_tools": CALLER_TOOLS},
                })
            outcome = reply.structured_content or {}
            presence = await events.of_type("status.presence")
            say("event", f"status.presence ({presence.get('state')})")
            while outcome.get("stop_reason") == "requires_action":
                session_id = outcome["session_id"]
                for request in outcome["pending"]:
                    await events.of_type("caller_tool_request")
                    say("event", f"caller_tool_request {request['tool']}({json.dumps(request['arguments'])})")
                    say("stop", f"requires_action: {request['tool']}({json.dumps(request['arguments'])})")
                    say("caller", 'caller_tool_response {"status": "sent"} (wait)')
                    with trio.fail_after(STEP_TIMEOUT):
                        reply = await caller.call_tool("caller_tool_response", {
                            "session_id": session_id, "request_id": request["request_id"],
                            "result": {"status": "sent"}, "wait": True,
                        })
                    outcome = {"session_id": session_id, **(reply.structured_content or {})}
            done = await events.of_type("assistant.done")
            say("event", "assistant.done")
            say("caller", f"turn ended: {outcome.get('stop_reason')}")
            print("\nAgent's final answer:\n" + str(done.get("text", "")).rstrip("\n"), flush=True)
            nursery.cancel_scope.cancel()
    ok = outcome.get("stop_reason") == "end_turn" and "returned" in str(outcome.get("text"))
    if not ok:
        print((workdir / "server.log").read_text(), file=sys.stderr)
    return 0 if ok else 1


def main() -> int:
    """Run the demo; a Ctrl-C stops it (the server, the guest runtime and its agent with it): one line, status 130."""
    raise_on_interrupt()  # from here Ctrl-C cancels the flow, so the temporary directory is removed
    # The in-process guest runtime shares this terminal: on Ctrl-C the server (same process group)
    # stops first, and the runtime's "cannot connect …; retrying" would follow. Errors still show.
    logging.getLogger("oubliette.client").setLevel(logging.ERROR)
    try:
        with tempfile.TemporaryDirectory(prefix="oubliette-demo-") as tmp:
            return trio.run(demo, Path(tmp))
    except BaseException as exc:
        # A Ctrl-C reaches the server too (one process group): the caller may meet its stdio
        # closing before its own KeyboardInterrupt lands. What follows a Ctrl-C is its doing.
        if not any(isinstance(leaf, KeyboardInterrupt) for leaf in exception_leaves(exc)):
            raise
        print("[caller] interrupted", file=sys.stderr)
        return INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
