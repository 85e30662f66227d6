"""oubliette-server's line router (oubliette_server/doors/caller_api/stdio.py): the stdio caller's
lines answered beside the MCP SDK, against the SDK itself.

The server's parity test runs the real programs twice, with `OUBLIETTE_FAST_PATH` on and off,
drives the same caller lines through the server's stdio (both protocol eras, ping, lists, answers
to an agent's relayed calls: ok, error, late, unknown, bad params, progress, cancels and malformed
lines) and compares every response and every event line the caller got, in order.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, AsyncIterator

import trio
from contextlib import asynccontextmanager

from harness import PYTHON, Deployment, HandMcp
from parity import masked

TIMEOUT = 20
TOOL = {"name": "echo", "description": "Echo", "inputSchema": {"type": "object", "properties": {"x": {"type": "integer"}}}}
#: The 2026-07-28 per-request envelope of a raw caller.
ENVELOPE = {"io.modelcontextprotocol/protocolVersion": "2026-07-28",
            "io.modelcontextprotocol/clientInfo": {"name": "raw", "version": "1"},
            "io.modelcontextprotocol/clientCapabilities": {}}


class Lines(HandMcp):
    """A peer speaking MCP line by line, with bounded waits."""

    async def receive(self) -> dict[str, Any]:
        with trio.fail_after(TIMEOUT):
            return await super().receive()

    async def event(self, kind: str, seen: list[str]) -> dict[str, Any]:
        """The next caller event of `kind` (by request id) not in `seen`, read from the lines."""
        while True:
            for message in self.received:
                event = message.get("params", {}).get("data", {}) if message.get("method") == "notifications/message" else {}
                if event.get("type") == kind and event.get("request_id") not in seen:
                    seen.append(event["request_id"])
                    return event
            await self.receive()


def request(request_id: Any, method: str, params: Any = None) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": request_id, "method": method, **({} if params is None else {"params": params})}


def tool_call(request_id: Any, name: str, arguments: Any, **params: Any) -> dict[str, Any]:
    return request(request_id, "tools/call", {"name": name, "arguments": arguments, **params})


@asynccontextmanager
async def process(argv: list[str], env: dict[str, str], log: Path) -> AsyncIterator[Lines]:
    with log.open("w") as stderr:
        proc = await trio.lowlevel.open_process(argv, stdin=-1, stdout=-1, stderr=stderr, env=env)
        try:
            yield Lines(proc)
        finally:
            proc.kill()
            with trio.CancelScope(shield=True):
                await proc.wait()


async def handshake_caller(deployment: Deployment, caller: Lines, session: str, tmp: Path, fast: bool) -> None:
    """A handshake-era caller answering a real agent's relayed calls in every way there is."""
    await caller.send(request(0, "initialize", {"protocolVersion": "2025-06-18", "capabilities": {},
                                                "clientInfo": {"name": "raw", "version": "1"}}))
    await caller.response(0)
    await caller.send({"jsonrpc": "2.0", "method": "notifications/initialized"})
    await caller.send(request("p", "ping"))
    await caller.response("p")
    await caller.send(request("list", "tools/list"))
    await caller.response("list")
    await caller.send(tool_call(1, "session_message", {
        "instance": "box1", "session_id": session, "message": "hi", "context": {"caller_id": "app", "caller_tools": [TOOL]}}))
    await caller.response(1)
    env = {**os.environ, "OUBLIETTE_FAST_PATH": "1", **deployment.client_env("box1", f"mcp:{session}")}
    async with process([PYTHON, "-m", "oubliette_client"], env, tmp / f"client-{fast}.log") as agent:
        await agent.send(request(0, "initialize", {"protocolVersion": "2025-06-18", "capabilities": {},
                                                   "clientInfo": {"name": "agent", "version": "1"}}))
        await agent.response(0)
        await agent.send({"jsonrpc": "2.0", "method": "notifications/initialized"})
        seen: list[str] = []
        pending = []
        for n in range(3):
            await agent.send(tool_call(10 + n, "app_echo", {"x": n}))
            pending.append((await caller.event("caller_tool_request", seen))["request_id"])
        answers: list[tuple[Any, str, Any]] = [
            (21, "caller_tool_response", {"session_id": session, "request_id": pending[0], "result": {"echo": 1}}),
            (22, "caller_tool_response", {"session_id": session, "request_id": pending[1], "error": "no such thing"}),
            (23, "caller_tool_response", {"session_id": session, "request_id": pending[0], "result": {}}),  # late
            (24, "caller_tool_response", {"session_id": session, "request_id": "ctr-0000", "result": {}}),  # unknown
            (25, "caller_tool_response", {"request_id": pending[2], "result": {}}),  # no session
            (26, "caller_tool_response", [1]),  # arguments not an object: the SDK's
            (27, 5, {}),  # a name not a string: the SDK's
            (28, "caller_tool_progress", {"session_id": session, "request_id": pending[2], "progress": 1, "total": 2}),
            (29, "caller_tool_response", {"session_id": session, "request_id": pending[2], "result": 3, "wait": False}),
            (30, "no_such_tool", {}),
        ]
        for request_id, name, arguments in answers:
            await caller.send(tool_call(request_id, name, arguments))
            await caller.response(request_id)
        for n in range(3):
            await agent.response(10 + n)
    await caller.send({"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": 29}})  # answered
    await caller.send({"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": 999}})  # unknown
    for line, request_id in (("not json\n", None), ('{"jsonrpc": "2.0", "id": 41, "method": "tools/call", "params": \n', None),
                             (request(42, "resources/list"), 42), (request(43, "ping", {"x": 1}), 43),
                             (tool_call(44, "caller_tool_response", {}, _meta=ENVELOPE), 44),
                             (tool_call(45, "caller_tool_response", {}, _meta={"progressToken": 1, "other": "x"}), 45)):
        await caller.send(line)
        if request_id is not None:  # the SDK answers no line it cannot read: the next answer shows it
            await caller.response(request_id)
    await caller.send(request("end", "ping"))
    await caller.response("end")


async def modern_caller(caller: Lines, session: str) -> None:
    """A 2026-07-28 caller (every request enveloped), then the handshake on its connection."""
    await caller.send(request(1, "tools/list", {"_meta": ENVELOPE}))
    await caller.response(1)
    await caller.send(tool_call(2, "caller_tool_response", {"session_id": session, "request_id": "ctr-0000", "result": {}},
                                _meta=ENVELOPE))
    await caller.response(2)
    await caller.send(request(3, "initialize", {"protocolVersion": "2025-06-18", "capabilities": {},
                                                "clientInfo": {"name": "raw", "version": "1"}}))
    await caller.response(3)


async def caller_lines(deployment: Deployment, era: str, fast: bool, tmp: Path) -> tuple[list[Any], list[Any], int]:
    """The responses and the events (each in order) a caller of `era` got, and how many calls the router took."""
    session = f"s-{'on' if fast else 'off'}"
    log = tmp / f"server-{era}-{fast}.log"
    params = deployment.server_parameters("--log-level", "DEBUG")
    env = {**os.environ, "OUBLIETTE_FAST_PATH": "1" if fast else "0"}
    async with process([params.command, *params.args], env, log) as caller:
        if era == "handshake":
            await handshake_caller(deployment, caller, session, tmp, fast)
        else:
            await modern_caller(caller, session)
    responses = [masked(m) for m in caller.received if "method" not in m]
    events = [masked(m) for m in caller.received if "method" in m]
    return responses, events, log.read_text().count("taken off the SDK's path")


async def test_the_caller_gets_the_same_lines_from_the_router_and_from_the_sdk(deployment: Deployment, tmp_path: Path) -> None:
    """The server's parity test: the same caller lines with `OUBLIETTE_FAST_PATH` off (the SDK
    answers every line and sends every event) and on (the router answers a handshake-era caller's
    plain answers and progress, and writes its events) give the caller the same responses and the
    same events, each in the same order (what differs between two runs — ids, seq, times — masked)."""
    for era in ("handshake", "2026-07-28"):
        off_responses, off_events, off_took = await caller_lines(deployment, era, False, tmp_path)
        on_responses, on_events, on_took = await caller_lines(deployment, era, True, tmp_path)
        assert on_responses == off_responses, (era, [(a, b) for a, b in zip(on_responses, off_responses) if a != b])
        assert on_events == off_events, era
        assert off_took == 0
        # handshake era: answers 21-25, 28, 29 and 45 (a `_meta` beside the token is a plain call's too)
        assert on_took == (8 if era == "handshake" else 0), era
    assert [r["id"] for r in on_responses] == [1, 2, 3]
