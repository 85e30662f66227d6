"""oubliette-client answers the handshake before the MCP SDK is loaded (oubliette_client/early_handshake.py).

The end-to-end tests run the real programs. `tests/support/sdk_gate.py` holds the client's import of the
SDK until the test releases it, so the tests see what is answered without the SDK, what waits for
it, and that everything queued meanwhile is answered, in order, once it is there. The
equivalence test runs the client with the early answers on and off
(`OUBLIETTE_EARLY_HANDSHAKE=0`) for every handshake-era version and compares what the agent got.
"""

from __future__ import annotations

import os
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, AsyncIterator

import pytest
import trio
import trio.testing
from mcp import Client
from mcp.client.stdio import stdio_client
from mcp_types.version import HANDSHAKE_PROTOCOL_VERSIONS

from harness import PYTHON, Deployment, EventLog, HandMcp, structured, text_of
from oubliette_client.early_handshake import (
    HANDSHAKE_VERSIONS,
    _handshake_initialize,
    _parse,
    early_handshake_enabled,
)

TIMEOUT = 20
HERE = Path(__file__).resolve().parents[2] / "tests" / "support"
TOOL = {"name": "echo", "description": "Echo", "inputSchema": {"type": "object", "properties": {"x": {"type": "integer"}}}}


def initialize(version: str = "2025-06-18", request_id: Any = 0, **params: Any) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": request_id, "method": "initialize", "params": {
        "protocolVersion": version, "capabilities": {}, "clientInfo": {"name": "raw", "version": "1"}, **params}}


def test_the_handshake_versions_are_the_sdks() -> None:
    assert HANDSHAKE_VERSIONS == tuple(HANDSHAKE_PROTOCOL_VERSIONS)


@pytest.mark.parametrize("version", HANDSHAKE_VERSIONS)
def test_a_plain_handshake_initialize_is_taken(version: str) -> None:
    message = _parse(trio_json(initialize(version)))
    assert message is not None and _handshake_initialize(message) == version


def trio_json(message: Any) -> str:
    import json

    return json.dumps(message) + "\n"


@pytest.mark.parametrize("line", [
    trio_json(initialize("2026-07-28")),  # stateless era: the SDK's
    trio_json(initialize("1999-01-01")),  # the SDK negotiates
    trio_json({**initialize(), "extra": 1}),
    trio_json({**initialize(), "id": True}),
    trio_json({**initialize(), "id": None}),
    trio_json({**initialize(), "jsonrpc": "1.0"}),
    trio_json({k: v for k, v in initialize().items() if k != "id"}),
    trio_json({**initialize(), "params": {"protocolVersion": "2025-06-18", "clientInfo": {"name": "x", "version": "1"}}}),
    trio_json({**initialize(), "params": {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "x"}}}),
    trio_json({**initialize(), "params": []}),
    trio_json({**initialize(), "method": "tools/list"}),
    trio_json([initialize()]),
    "not json\n",
    "[" * 100_000 + "\n",
])
def test_anything_else_is_left_to_the_sdk(line: str) -> None:
    message = _parse(line)
    assert message is None or _handshake_initialize(message) is None


@pytest.mark.parametrize(("value", "enabled"), [(None, True), ("1", True), ("0", False), ("off", False), ("No", False)])
def test_the_switch(value: str | None, enabled: bool) -> None:
    assert early_handshake_enabled({} if value is None else {"OUBLIETTE_EARLY_HANDSHAKE": value}) is enabled


# -- the real programs ------------------------------------------------------------------------


class Agent(HandMcp):
    """An agent speaking MCP line by line, with bounded waits."""

    async def receive(self) -> dict[str, Any]:
        with trio.fail_after(TIMEOUT):
            return await super().receive()


class GatedClient:
    """oubliette-client started through tests/support/sdk_gate.py: `wanted()` waits until it is loading
    the SDK (held), `release()` lets the SDK in."""

    def __init__(self, process: trio.Process, wanted_fd: int, go_fd: int) -> None:
        self.process = process
        self.agent = Agent(process)
        self._wanted = trio.lowlevel.FdStream(wanted_fd)
        self._go = trio.lowlevel.FdStream(go_fd)

    async def wanted(self) -> None:
        with trio.fail_after(TIMEOUT):
            assert await self._wanted.receive_some(1) == b"w"

    async def release(self) -> None:
        await self._go.send_all(b"g")


@asynccontextmanager
async def caller_and_session(deployment: Deployment, session: str, stderr: Any) -> AsyncIterator[tuple[Client, EventLog]]:
    """A caller (oubliette-server over stdio) that declared the `echo` caller tool on `session`."""
    events = EventLog()
    async with Client(stdio_client(deployment.server_parameters(), errlog=stderr), mode="legacy",
                      **events.callback_if(True)) as caller:
        declared = await caller.call_tool("session_message", {
            "instance": "box1", "session_id": session, "message": "hi",
            "context": {"caller_id": "app", "caller_tools": [TOOL]},
        })
        assert not declared.is_error, text_of(declared)
        yield caller, events


@asynccontextmanager
async def gated_client(deployment: Deployment, session: str, stderr: Any, env: dict[str, str] | None = None) -> AsyncIterator[GatedClient]:
    wanted_r, wanted_w = os.pipe()
    go_r, go_w = os.pipe()
    try:
        process = await trio.lowlevel.open_process(
            [PYTHON, str(HERE / "sdk_gate.py"), str(wanted_w), str(go_r), "--log-level", "DEBUG"],
            stdin=-1, stdout=-1, stderr=stderr, pass_fds=(wanted_w, go_r),
            env={**os.environ, **(env or {}), **deployment.client_env("box1", f"mcp:{session}")},
        )
    finally:
        os.close(wanted_w)
        os.close(go_r)
    gated = GatedClient(process, wanted_r, go_w)
    try:
        yield gated
    finally:
        process.kill()
        with trio.CancelScope(shield=True):
            await process.wait()
        await gated._wanted.aclose()
        await gated._go.aclose()


async def answer_next_request(caller: Client, events: EventLog, session: str, answered: list[str], result: Any) -> None:
    event = await events.wait_for(
        lambda e: e["type"] == "caller_tool_request" and e["request_id"] not in answered, timeout=TIMEOUT)
    answered.append(event["request_id"])
    reply = await caller.call_tool("caller_tool_response", {
        "session_id": session, "request_id": event["request_id"], "result": result})
    assert structured(reply) == {"resolved": True}


async def test_the_handshake_is_answered_while_the_sdk_is_held_and_the_rest_after(deployment: Deployment, tmp_path: Path) -> None:
    """initialize, ping and tools/list are answered with the SDK's import held; a call sent
    meanwhile waits and is answered once the SDK is in; the SDK agreed with the early initialize."""
    client_log = tmp_path / "client.log"
    with (tmp_path / "server.log").open("w") as server_err, client_log.open("w") as client_err:
        async with caller_and_session(deployment, "s-held", server_err) as (caller, events), \
                gated_client(deployment, "s-held", client_err) as client:
            await client.wanted()  # the SDK is being loaded, and held
            agent = client.agent
            await agent.send(initialize())
            init = await agent.response(0)
            assert init["result"]["protocolVersion"] == "2025-06-18"
            assert init["result"]["serverInfo"]["name"] == "oubliette-client"
            await agent.send({"jsonrpc": "2.0", "method": "notifications/initialized"})
            await agent.send({"jsonrpc": "2.0", "id": "p", "method": "ping"})
            assert await agent.response("p") == {"jsonrpc": "2.0", "id": "p", "result": {}}
            await agent.send({"jsonrpc": "2.0", "id": "list", "method": "tools/list"})
            listed = (await agent.response("list"))["result"]["tools"]
            assert [t["name"] for t in listed] == ["app_echo", "permission_prompt"]
            assert listed[0]["inputSchema"] == TOOL["inputSchema"]
            # A call before the SDK is there waits for it; a ping sent after it is answered first.
            await agent.send({"jsonrpc": "2.0", "id": 11, "method": "tools/call",
                              "params": {"name": "app_echo", "arguments": {"x": 1}}})
            await agent.send({"jsonrpc": "2.0", "id": "p2", "method": "ping"})
            assert await agent.receive() == {"jsonrpc": "2.0", "id": "p2", "result": {}}
            await client.release()
            await answer_next_request(caller, events, "s-held", [], {"echo": 1})
            called = await agent.response(11)
            assert called["result"]["structuredContent"] == {"echo": 1}
            # After the hand-over, requests are the SDK's (and the fast path's) as before.
            await agent.send({"jsonrpc": "2.0", "id": "list2", "method": "tools/list"})
            assert (await agent.response("list2"))["result"]["tools"] == listed
    log = client_log.read_text()
    assert "answered initialize with" not in log  # the SDK's own answer was the same
    assert log.count("taken off the SDK's path") == 1  # the queued call: the version negotiated early


async def test_a_first_line_that_is_not_initialize_waits_for_the_sdk(deployment: Deployment, tmp_path: Path) -> None:
    with (tmp_path / "client.log").open("w") as client_err:
        # with a relay: a client that cannot reach its relay at the start fails its first request
        async with caller_and_session(deployment, "s-first", client_err), gated_client(deployment, "s-first", client_err) as client:
            await client.wanted()
            agent = client.agent
            await agent.send({"jsonrpc": "2.0", "id": 1, "method": "tools/list"})
            await agent.send(initialize(request_id=2))  # not the first line: the SDK's too
            await agent.send({"jsonrpc": "2.0", "id": "p", "method": "ping"})
            assert await agent.receive() == {"jsonrpc": "2.0", "id": "p", "result": {}}  # nothing before it
            await client.release()
            answers = {}
            while len(answers) < 2:
                message = await agent.receive()
                if "id" in message and "method" not in message:
                    answers[message["id"]] = message
            assert "result" in answers[2] and answers[2]["result"]["serverInfo"]["name"] == "oubliette-client"


async def test_eof_before_the_sdk_is_loaded_ends_the_client_cleanly(deployment: Deployment, tmp_path: Path) -> None:
    with (tmp_path / "client.log").open("w") as client_err:
        # with a relay: a client that cannot reach its relay at the start fails its first request
        async with caller_and_session(deployment, "s-eof", client_err), gated_client(deployment, "s-eof", client_err) as client:
            await client.wanted()
            await client.agent.send(initialize())
            assert "result" in await client.agent.response(0)
            assert client.process.stdin is not None
            await client.process.stdin.aclose()
            await client.release()
            with trio.fail_after(TIMEOUT):
                assert await client.process.wait() == 0


async def agent_view(deployment: Deployment, session: str, version: str, early: bool, tmp: Path,
                     caller: Client, events: EventLog, answered: list[str]) -> dict[str, Any]:
    """What an agent of `version` gets for initialize, tools/list and one relayed call."""
    env = {**os.environ, "OUBLIETTE_EARLY_HANDSHAKE": "1" if early else "0",
           **deployment.client_env("box1", f"mcp:{session}")}
    with (tmp / f"client-{version}-{early}.log").open("w") as client_err:
        process = await trio.lowlevel.open_process(
            [PYTHON, "-m", "oubliette_client", "--log-level", "DEBUG"], stdin=-1, stdout=-1, stderr=client_err, env=env,
        )
        try:
            agent = Agent(process)
            await agent.send(initialize(version))
            init = await agent.response(0)
            await agent.send({"jsonrpc": "2.0", "method": "notifications/initialized"})
            await agent.send({"jsonrpc": "2.0", "id": 1, "method": "tools/list"})
            listed = await agent.response(1)
            await agent.send({"jsonrpc": "2.0", "id": 2, "method": "tools/call",
                              "params": {"name": "app_echo", "arguments": {"x": 2}}})
            await answer_next_request(caller, events, session, answered, {"echo": 2})
            called = await agent.response(2)
        finally:
            process.kill()
            await process.wait()
    assert "answered initialize with" not in (tmp / f"client-{version}-{early}.log").read_text()
    return {"initialize": init, "tools/list": listed, "tools/call": called}


async def test_the_agent_gets_the_same_answers_with_the_early_handshake_on_and_off(deployment: Deployment, tmp_path: Path) -> None:
    answered: list[str] = []
    with (tmp_path / "server.log").open("w") as server_err:
        async with caller_and_session(deployment, "s-same", server_err) as (caller, events):
            for version in HANDSHAKE_VERSIONS:
                off = await agent_view(deployment, "s-same", version, False, tmp_path, caller, events, answered)
                on = await agent_view(deployment, "s-same", version, True, tmp_path, caller, events, answered)
                assert on == off, version
                assert on["initialize"]["result"]["protocolVersion"] == version
                assert [t["name"] for t in on["tools/list"]["result"]["tools"]] == ["app_echo", "permission_prompt"]
                assert "_meta" in on["tools/list"]["result"]["tools"][0]  # the relayed tool's descriptor
                assert on["tools/call"]["result"]["structuredContent"] == {"echo": 2}


async def test_lines_sent_while_the_sdk_loads_wait_in_order_and_none_is_lost(deployment: Deployment, tmp_path: Path) -> None:
    """More lines than wait in memory (MAX_WAITING_LINES) arrive while the SDK is held: stdin
    is read no further until the SDK takes them, and every one is answered afterwards."""
    from oubliette_client.early_handshake import MAX_WAITING_LINES

    count = MAX_WAITING_LINES * 3
    with (tmp_path / "client.log").open("w") as client_err:
        # with a relay: a client that cannot reach its relay at the start fails its first request
        async with caller_and_session(deployment, "s-many", client_err), gated_client(deployment, "s-many", client_err) as client:
            await client.wanted()
            agent = client.agent
            await agent.send(initialize())
            assert "result" in await agent.response(0)

            async def send_all() -> None:
                for n in range(count):
                    await agent.send({"jsonrpc": "2.0", "id": 1000 + n, "method": "tools/call",
                                      "params": {"name": "nope", "arguments": {}}})

            async with trio.open_nursery() as nursery:
                nursery.start_soon(send_all)
                await client.release()
                answered = []
                while len(answered) < count:
                    message = await agent.receive()
                    if "method" not in message:
                        answered.append(message["id"])
                        assert message["result"]["isError"] is True
            assert sorted(answered) == list(range(1000, 1000 + count))


async def test_waiting_lines_are_bounded_in_characters_too() -> None:
    """Lines that wait for the SDK hold at most the budget's characters; a line over it alone still fits."""
    from oubliette_client.early_handshake import WaitingChars

    waiting = WaitingChars(10)
    await waiting.reserve(25)  # alone: fits
    reserved = trio.Event()

    async def second() -> None:
        await waiting.reserve(1)
        reserved.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(second)
        await trio.testing.wait_all_tasks_blocked()
        assert not reserved.is_set() and waiting.used == 25
        waiting.release(25)
        with trio.fail_after(TIMEOUT):
            await reserved.wait()
    assert waiting.used == 1


async def test_a_2026_07_28_agent_is_served_by_the_sdk_as_before(deployment: Deployment, tmp_path: Path) -> None:
    """The stateless era has no handshake to answer early: the real client hands every request
    to the SDK, and a 2026-07-28 agent lists and calls a relayed tool as before."""
    with (tmp_path / "server.log").open("w") as server_err, (tmp_path / "client.log").open("w") as client_err:
        async with caller_and_session(deployment, "s-modern", server_err) as (caller, events), \
                deployment.agent("box1", "mcp:s-modern", mode="auto", errlog=client_err,
                                 extra_args=("--log-level", "DEBUG")) as agent:
            assert agent.protocol_version == "2026-07-28"
            listed = await agent.list_tools()
            assert [t.name for t in listed.tools] == ["app_echo", "permission_prompt"]
            async with trio.open_nursery() as nursery:
                nursery.start_soon(answer_next_request, caller, events, "s-modern", [], {"echo": 3})
                with trio.fail_after(TIMEOUT):
                    result = await agent.call_tool("app_echo", {"x": 3})
            assert not result.is_error and result.structured_content == {"echo": 3}
    assert "taken off the SDK's path" not in (tmp_path / "client.log").read_text()
