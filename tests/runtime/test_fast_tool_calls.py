"""The fast path for plain `tools/call` lines (oubliette_runtime/fast_tool_calls.py), on its own and in both programs.

The unit tests feed lines to `FastToolCalls` in the test's loop. The end-to-end tests run the
real programs twice, with the fast path on and off (`OUBLIETTE_FAST_CALLS=0`), and check that an
agent and a caller see the same lines either way, and that the path was taken only when on.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, AsyncIterator

import pytest
import trio
import trio.testing
from mcp import Client
from mcp.client.stdio import StdioServerParameters, stdio_client

from harness import PYTHON, Deployment, EventLog, HandMcp, structured, text_of
from oubliette_runtime.fast_tool_calls import FastToolCalls, fast_calls_enabled

TIMEOUT = 20


def call_line(request_id: Any = 7, name: str = "echo", arguments: Any = None, **extra: Any) -> str:
    params: dict[str, Any] = {"name": name, "arguments": {"x": 1} if arguments is None else arguments}
    params.update(extra.pop("params", {}))
    message = {"jsonrpc": "2.0", "id": request_id, "method": "tools/call", "params": params, **extra}
    return json.dumps(message) + "\n"


class Harness:
    """A `FastToolCalls` with a route for tool `echo` whose calls wait for `release`."""

    def __init__(self) -> None:
        self.written: list[dict[str, Any]] = []
        self.wrote = trio.Event()
        self.release = trio.Event()
        self.started: list[Any] = []
        self.fast = FastToolCalls(self.route, self.write)

    def route(self, name: str, arguments: dict[str, Any]) -> Any:
        if name != "echo":
            return None

        async def handle(token: Any, send_progress: Any) -> dict[str, Any]:
            self.started.append(token)
            if send_progress is not None:
                await send_progress(1, 2, "half")
            await self.release.wait()
            return {"content": [{"type": "text", "text": json.dumps(arguments)}], "isError": False}
        return handle

    async def write(self, text: str) -> None:
        assert text.endswith("\n") and text.count("\n") == 1
        self.written.append(json.loads(text))
        self.wrote.set()

    async def feed(self, *lines: str) -> list[str]:
        """The lines that went through to the SDK."""
        async def source() -> AsyncIterator[str]:
            for line in lines:
                yield line

        return [line async for line in self.fast.lines(source())]


async def test_a_plain_call_is_answered_here_and_not_passed_on() -> None:
    h = Harness()
    async with trio.open_nursery() as nursery:
        await nursery.start(h.fast.run)
        assert await h.feed(call_line(7)) == []
        h.release.set()
        with trio.fail_after(TIMEOUT):
            await h.wrote.wait()
        nursery.cancel_scope.cancel()
    assert h.written == [{"jsonrpc": "2.0", "id": 7, "result": {
        "content": [{"type": "text", "text": '{"x": 1}'}], "isError": False}}]
    assert h.fast.taken == 1


@pytest.mark.parametrize("line", [
    call_line(params={"_meta": {"progressToken": 1, "io.modelcontextprotocol/protocolVersion": "2026-07-28"}}),
    call_line(params={"task": {}}),
    call_line(extra_key=1),
    call_line(True),
    call_line(1.5),
    call_line(None),
    call_line(arguments=[1]),
    call_line(name="other"),
    call_line(params={"_meta": {"progressToken": True}}),
    json.dumps({"jsonrpc": "2.0", "method": "tools/call", "params": {"name": "echo"}}) + "\n",
    json.dumps({"jsonrpc": "1.0", "id": 1, "method": "tools/call", "params": {"name": "echo"}}) + "\n",
    json.dumps({"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {"name": "tools/call"}}) + "\n",
    '{"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": \n',
    '["tools/call"]\n',
    '{"method": "tools/call", "x": ' + "[" * 100_000 + "]" * 100_000 + "}\n",
    '{"method": "notifications/cancelled", "x": ' + "[" * 100_000 + "]" * 100_000 + "}\n",
], ids=["modern-meta", "extra-param", "extra-key", "bool-id", "float-id", "null-id", "array-arguments",
        "unrouted-tool", "bool-token", "notification", "wrong-jsonrpc", "other-method", "broken-json", "array",
        "deep-call", "deep-cancel"])
async def test_every_other_line_goes_to_the_sdk_unchanged(line: str) -> None:
    h = Harness()
    async with trio.open_nursery() as nursery:
        await nursery.start(h.fast.run)
        assert await h.feed(line) == [line]
        nursery.cancel_scope.cancel()
    assert h.fast.taken == 0 and h.written == []


async def test_nothing_is_taken_before_run_has_started() -> None:
    h = Harness()
    assert await h.feed(call_line(7)) == [call_line(7)]


async def test_an_id_already_in_flight_goes_to_the_sdk() -> None:
    h = Harness()
    async with trio.open_nursery() as nursery:
        await nursery.start(h.fast.run)
        assert await h.feed(call_line(7), call_line(7), call_line("7")) == [call_line(7)]
        assert h.fast.taken == 2
        nursery.cancel_scope.cancel()


async def test_a_cancelled_call_gets_no_response_and_the_sdk_still_sees_the_cancel() -> None:
    h = Harness()
    cancel = json.dumps({"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": 7}}) + "\n"
    async with trio.open_nursery() as nursery:
        await nursery.start(h.fast.run)
        assert await h.feed(call_line(7), call_line(8), cancel) == [cancel]
        h.release.set()
        with trio.fail_after(TIMEOUT):
            while len(h.written) < 1:
                h.wrote = trio.Event()
                await h.wrote.wait()
        await trio.testing.wait_all_tasks_blocked()
        nursery.cancel_scope.cancel()
    assert [m["id"] for m in h.written] == [8]
    # the id is free again once its call ended
    assert h.fast._in_flight == {}


async def test_progress_goes_out_on_the_agents_token_before_the_response() -> None:
    h = Harness()
    async with trio.open_nursery() as nursery:
        await nursery.start(h.fast.run)
        await h.feed(call_line(7, params={"_meta": {"progressToken": "tok"}}))
        with trio.fail_after(TIMEOUT):
            await h.wrote.wait()
        h.release.set()
        with trio.fail_after(TIMEOUT):
            while len(h.written) < 2:
                h.wrote = trio.Event()
                await h.wrote.wait()
        nursery.cancel_scope.cancel()
    assert h.started == ["tok"]
    assert h.written[0] == {"jsonrpc": "2.0", "method": "notifications/progress",
                            "params": {"progressToken": "tok", "progress": 1, "total": 2, "message": "half"}}
    assert h.written[1]["id"] == 7


@pytest.mark.parametrize(("value", "enabled"), [(None, True), ("1", True), ("0", False), ("false", False), (" OFF ", False), ("no", False)])
def test_the_switch(value: str | None, enabled: bool) -> None:
    environ = {} if value is None else {"OUBLIETTE_FAST_CALLS": value}
    assert fast_calls_enabled(environ) is enabled


# -- both programs, the path on and off ----------------------------------------------------

TOOL = {"name": "echo", "description": "Echo", "inputSchema": {"type": "object", "properties": {"x": {"type": "integer"}}}}


class RawAgent(HandMcp):
    """An agent that speaks MCP to oubliette-client line by line, so the test sees the exact lines."""

    async def receive(self) -> dict[str, Any]:
        with trio.fail_after(TIMEOUT):
            return await super().receive()

    async def initialize(self) -> None:
        await self.send({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
            "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "raw", "version": "1"}}})
        assert "result" in await self.response(0)
        await self.send({"jsonrpc": "2.0", "method": "notifications/initialized"})
        await self.send({"jsonrpc": "2.0", "id": "list", "method": "tools/list"})
        assert "app_echo" in [tool["name"] for tool in (await self.response("list"))["result"]["tools"]]


async def run_programs(deployment: Deployment, fast: bool, tmp: Path) -> dict[str, Any]:
    """One relayed success, one relayed error and one unknown tool, as lines the agent and results the caller saw."""
    env = {**os.environ, "OUBLIETTE_FAST_CALLS": "1" if fast else "0"}
    server_log, client_log = tmp / f"server-{fast}.log", tmp / f"client-{fast}.log"
    params = deployment.server_parameters("--log-level", "DEBUG")
    params = StdioServerParameters(command=params.command, args=params.args, env=env)
    session = f"s-{'on' if fast else 'off'}"
    seen: dict[str, Any] = {}
    events = EventLog()
    with server_log.open("w") as server_err, client_log.open("w") as client_err:
        async with Client(stdio_client(params, errlog=server_err), mode="legacy", **events.callback_if(True)) as caller:
            declared = await caller.call_tool("session_message", {
                "instance": "box1", "session_id": session, "message": "hi",
                "context": {"caller_id": "app", "caller_tools": [TOOL]},
            })
            assert not declared.is_error, text_of(declared)
            process = await trio.lowlevel.open_process(
                [PYTHON, "-m", "oubliette_client", "--log-level", "DEBUG"],
                stdin=-1, stdout=-1, stderr=client_err,
                env={**env, **deployment.client_env("box1", f"mcp:{session}")},
            )
            try:
                agent = RawAgent(process)
                await agent.initialize()
                for request_id, answer in ((11, {"result": {"echo": 1}}), ("twelve", {"error": "no such thing"})):
                    await agent.send({"jsonrpc": "2.0", "id": request_id, "method": "tools/call",
                                      "params": {"name": "app_echo", "arguments": {"x": 1}}})
                    request = await next_request(events, seen)
                    reply = await caller.call_tool("caller_tool_response", {
                        "session_id": session, "request_id": request["request_id"], **answer})
                    seen[f"caller-{request_id}"] = structured(reply)
                    seen[f"agent-{request_id}"] = await agent.response(request_id)
                again = await caller.call_tool("caller_tool_response", {
                    "session_id": session, "request_id": request["request_id"], "result": {}})
                seen["caller-again"] = (again.is_error, text_of(again).replace(request["request_id"], "<id>"))
                await agent.send({"jsonrpc": "2.0", "id": 13, "method": "tools/call",
                                  "params": {"name": "nope", "arguments": {}}})
                seen["agent-13"] = await agent.response(13)
            finally:
                process.kill()
                await process.wait()
    seen["events"] = [(e["type"], e.get("tool")) for e in events.events if e["type"].startswith("caller_tool")]
    seen["client-took"] = client_log.read_text().count("taken off the SDK's path")
    seen["server-took"] = server_log.read_text().count("taken off the SDK's path")
    return seen


async def next_request(events: EventLog, seen: dict[str, Any]) -> dict[str, Any]:
    """The next `caller_tool_request` event not answered yet."""
    answered = seen.setdefault("answered", [])
    event = await events.wait_for(
        lambda e: e["type"] == "caller_tool_request" and e["request_id"] not in answered, timeout=TIMEOUT)
    answered.append(event["request_id"])
    return event


async def test_both_programs_send_the_same_lines_with_the_fast_path_on_and_off(deployment: Deployment, tmp_path: Path) -> None:
    off = await run_programs(deployment, False, tmp_path)
    on = await run_programs(deployment, True, tmp_path)
    assert off.pop("client-took") == 0 and off.pop("server-took") == 0
    # two relayed calls at the client; two answers at the server (the late third is refused on the SDK's path too)
    assert on.pop("client-took") == 2 and on.pop("server-took") == 3
    for seen in (off, on):
        seen.pop("answered")
    assert on == off
    assert on["agent-11"]["result"]["structuredContent"] == {"echo": 1}
    assert on["agent-twelve"]["result"]["isError"] is True
    assert on["caller-11"] == {"resolved": True}
    assert on["caller-again"][0] is True
    assert on["agent-13"]["result"]["isError"] is True  # an unknown tool is the SDK's to answer, in both
