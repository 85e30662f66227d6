"""A scripted agent for tests/e2e/test_caller_loop.py, tests/e2e/test_approval_flows.py and the PostgreSQL
tests, run by the guest runtime (not an LLM).

The message on stdin is JSON: `{"steps": [[{"tool": NAME, "arguments": {...}}, ...], ...]}`,
optionally with `"client_args": [...]` (extra flags for its oubliette-client, e.g.
`--progress-interval`). Steps run one after the other; the calls of one step run at the same
time (an agent that issues several tool calls at once). Each outcome is printed as one line,
`NAME -> TEXT` or `NAME failed: TEXT`, so the turn's text (`assistant.done`) carries them.

A call with `"progress": true` puts a `progressToken` in the call's `_meta` and prints each
`notifications/progress` carrying that token at once as `NAME progress VALUE/TOTAL MESSAGE`, so
the caller sees them as `assistant.delta` frames while the call still waits.
`"cancel_on_progress": true` cancels the call when its first report arrives (an agent giving up
on a long wait): it sends `notifications/cancelled` for the request and prints `NAME cancelled`.

Why it speaks MCP's JSON-RPC lines itself instead of through the MCP SDK's client: this agent runs
once per turn, about 150 times in the whole suite, and importing the SDK costs ~0.6 s of CPU
each time (its pydantic models), a seventh of the suite's CPU. What the lines say is the
handshake-era exchange the SDK's `Client(mode="legacy")` makes (`initialize`,
`notifications/initialized`, `tools/list`, `tools/call` with `_meta.progressToken`,
`notifications/cancelled`); the SDK's client as an agent is driven by tests/support/harness.py's
`agent()` (tests/client/test_stdio_server.py and others) and the demo agent.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from typing import Any, Callable

import trio

PROTOCOL_VERSION = "2025-11-25"
#: The variables the MCP SDK's stdio client passes on to a server besides the config's `env`.
INHERITED_ENV = ("HOME", "LOGNAME", "PATH", "SHELL", "TERM", "USER")
#: How long the server may take to exit after its stdin closes before it is killed (the SDK's wait).
EXIT_WAIT = 2.0


class McpError(Exception):
    """A JSON-RPC error answer."""


class StdioMcpClient:
    """One MCP session over a server process's stdin/stdout: requests by id, progress by token."""

    def __init__(self, process: trio.Process) -> None:
        self.process = process
        self._ids = itertools.count(1)
        self._answers: dict[int, tuple[trio.Event, list[dict[str, Any]]]] = {}
        self._progress: dict[int, Callable[[dict[str, Any]], None]] = {}
        self._write_lock = trio.Lock()

    async def send(self, message: dict[str, Any]) -> None:
        assert self.process.stdin is not None
        async with self._write_lock:
            await self.process.stdin.send_all((json.dumps(message) + "\n").encode())

    async def read_lines(self) -> None:
        """Route each line of the server's stdout: answers to their request, progress to its call."""
        assert self.process.stdout is not None
        buffer = b""
        async for chunk in self.process.stdout:
            buffer += chunk
            *lines, buffer = buffer.split(b"\n")
            for line in lines:
                if line.strip():
                    await self._route(json.loads(line))
        for event, _ in self._answers.values():
            event.set()  # the server went away: every waiting request ends (with no answer)

    async def _route(self, message: dict[str, Any]) -> None:
        if "method" not in message:
            waiting = self._answers.get(message.get("id"))  # type: ignore[arg-type]
            if waiting is not None:
                waiting[1].append(message)
                waiting[0].set()
        elif message["method"] == "notifications/progress":
            on_progress = self._progress.get(message.get("params", {}).get("progressToken"))
            if on_progress is not None:
                on_progress(message["params"])
        elif "id" in message:  # a request to the agent: none is expected, and none is served
            await self.send({"jsonrpc": "2.0", "id": message["id"],
                             "error": {"code": -32601, "message": f"method not found: {message['method']}"}})

    async def request(
        self, method: str, params: dict[str, Any], on_progress: Callable[[dict[str, Any]], None] | None = None,
    ) -> dict[str, Any]:
        """The result of `method`; a cancelled wait tells the server (`notifications/cancelled`)."""
        request_id = next(self._ids)
        if on_progress is not None:
            params = {**params, "_meta": {"progressToken": request_id}}
            self._progress[request_id] = on_progress
        event, answer = trio.Event(), []
        self._answers[request_id] = (event, answer)
        try:
            await self.send({"jsonrpc": "2.0", "id": request_id, "method": method, "params": params})
            await event.wait()
        except trio.Cancelled:
            with trio.CancelScope(shield=True), trio.move_on_after(EXIT_WAIT):
                await self.send({"jsonrpc": "2.0", "method": "notifications/cancelled",
                                 "params": {"requestId": request_id, "reason": "cancelled by the agent"}})
            raise
        finally:
            del self._answers[request_id]
            self._progress.pop(request_id, None)
        if not answer:
            raise McpError(f"{method}: the server closed its stdout without answering")
        if "error" in answer[0]:
            raise McpError(f"{method}: {answer[0]['error'].get('message')}")
        return answer[0]["result"]


def server_command(config_path: str) -> tuple[list[str], dict[str, str]]:
    """The command and environment of the one server in the guest runtime's MCP config."""
    with open(config_path) as handle:
        server = next(iter(json.load(handle)["mcpServers"].values()))
    env = {name: os.environ[name] for name in INHERITED_ENV if name in os.environ}
    return [server["command"], *server.get("args", [])], {**env, **(server.get("env") or {})}


async def main(config_path: str) -> None:
    script = json.loads(sys.stdin.read() or "{}")
    command, env = server_command(config_path)
    command += script.get("client_args", [])
    async with trio.open_nursery() as nursery:
        process = await trio.lowlevel.open_process(command, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        client = StdioMcpClient(process)
        nursery.start_soon(client.read_lines)
        await client.request("initialize", {
            "protocolVersion": PROTOCOL_VERSION, "capabilities": {},
            "clientInfo": {"name": "loop-agent", "version": "1"},
        })
        await client.send({"jsonrpc": "2.0", "method": "notifications/initialized"})
        await client.request("tools/list", {})
        for step in script.get("steps", []):
            async with trio.open_nursery() as calls:
                for call in step:
                    calls.start_soon(run_call, client, call)
        print("done", flush=True)
        await close(process)
        nursery.cancel_scope.cancel()


async def close(process: trio.Process) -> None:
    """Close the server's stdin and let it exit, as the SDK's stdio client does: SIGTERM after
    `EXIT_WAIT`, SIGKILL after as long again."""
    assert process.stdin is not None
    await process.stdin.aclose()
    for stop in (process.terminate, process.kill):
        with trio.move_on_after(EXIT_WAIT):
            await process.wait()
            return
        stop()
    await process.wait()


async def run_call(client: StdioMcpClient, call: dict[str, Any]) -> None:
    name, arguments = call["tool"], call.get("arguments", {})
    watch = bool(call.get("progress") or call.get("cancel_on_progress"))
    with trio.CancelScope() as scope:

        def on_progress(params: dict[str, Any]) -> None:
            total = params.get("total")
            print(f"{name} progress {params['progress']:g}/{'' if total is None else f'{total:g}'} "
                  f"{params.get('message') or ''}", flush=True)
            if call.get("cancel_on_progress"):
                scope.cancel()

        result = await client.request("tools/call", {"name": name, "arguments": arguments},
                                      on_progress if watch else None)
        text = " ".join(block.get("text", "") for block in result.get("content", []))
        print(f"{name} failed: {text}" if result.get("isError") else f"{name} -> {text}", flush=True)
    if scope.cancelled_caught:
        print(f"{name} cancelled", flush=True)


if __name__ == "__main__":
    trio.run(main, sys.argv[1])
