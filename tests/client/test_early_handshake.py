"""oubliette-client's line router (oubliette_client/line_router.py): what it answers beside the MCP SDK.

The end-to-end tests run the real programs. `tests/support/sdk_gate.py` holds the client's import of the
SDK until the test releases it, so the tests see what is answered without the SDK, what waits for
it, and that everything queued meanwhile is answered, in order, once it is there. The client's
parity test (`test_the_agent_gets_the_same_lines_from_the_router_and_from_the_sdk`) runs the
client with the router on and off (`OUBLIETTE_FAST_PATH=0`) in every protocol version and
compares every line the agent got.
"""

from __future__ import annotations

import json
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
from oubliette_client.line_router import HANDSHAKE_VERSIONS, _handshake_initialize, _parse

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
    meanwhile waits and is answered once the SDK is in."""
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
            # Once the SDK is in, the router goes on answering its handshake's lists.
            await agent.send({"jsonrpc": "2.0", "id": "list2", "method": "tools/list"})
            assert (await agent.response("list2"))["result"]["tools"] == listed
    assert client_log.read_text().count("taken off the SDK's path") == 1  # the call, waiting for the SDK


async def test_a_first_line_that_is_not_initialize_leaves_every_line_to_the_sdk(deployment: Deployment, tmp_path: Path) -> None:
    """The handshake is the SDK's when the first line is not a plain handshake-era `initialize`:
    the router then answers nothing, and everything sent meanwhile is answered once the SDK is in."""
    with (tmp_path / "client.log").open("w") as client_err:
        # with a relay: a client that cannot reach its relay at the start fails its first request
        async with caller_and_session(deployment, "s-first", client_err), gated_client(deployment, "s-first", client_err) as client:
            await client.wanted()
            agent = client.agent
            await agent.send({"jsonrpc": "2.0", "id": 1, "method": "tools/list"})
            await agent.send(initialize(request_id=2))  # not the first line: the SDK's too
            await agent.send({"jsonrpc": "2.0", "method": "notifications/initialized"})
            await agent.send({"jsonrpc": "2.0", "id": 3, "method": "tools/call", "params": {"name": "nope", "arguments": {}}})
            await agent.send({"jsonrpc": "2.0", "id": "p", "method": "ping"})
            await client.release()
            answers = {}
            while len(answers) < 4:
                message = await agent.receive()
                if "id" in message and "method" not in message:
                    answers[message["id"]] = message
            assert "result" in answers[2] and answers[2]["result"]["serverInfo"]["name"] == "oubliette-client"
            assert answers[3]["result"]["isError"] is True and answers["p"]["result"] == {}
    assert "taken off the SDK's path" not in (tmp_path / "client.log").read_text()


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


def call(request_id: Any, name: str, arguments: Any = None, **params: Any) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": request_id, "method": "tools/call",
            "params": {"name": name, **({} if arguments is None else {"arguments": arguments}), **params}}


#: The 2026-07-28 per-request envelope of a raw agent.
ENVELOPE = {"io.modelcontextprotocol/protocolVersion": "2026-07-28",
            "io.modelcontextprotocol/clientInfo": {"name": "raw", "version": "1"},
            "io.modelcontextprotocol/clientCapabilities": {}}


async def handshake_script(agent: Agent, version: str, relay: Any) -> None:
    """A handshake-era agent: the handshake, ping, the list, relayed calls, and (for the latest
    version Claude Code speaks) every other shape the router must get right or leave to the SDK."""
    await agent.send(initialize(version))
    await agent.response(0)
    await agent.send({"jsonrpc": "2.0", "method": "notifications/initialized"})
    await agent.send({"jsonrpc": "2.0", "id": "p", "method": "ping"})
    await agent.response("p")
    await agent.send({"jsonrpc": "2.0", "id": "list", "method": "tools/list"})
    await agent.response("list")
    if version == "2025-06-18":  # the caller's tools change, twice: the agent is told each time
        for n, tools in enumerate(([TOOL, {**TOOL, "name": "extra"}], [TOOL])):
            await relay({"tools": tools}, kind="declare")
            while (await agent.receive()).get("method") != "notifications/tools/list_changed":
                pass
            await agent.send({"jsonrpc": "2.0", "id": f"list-{n}", "method": "tools/list"})
            await agent.response(f"list-{n}")
    await agent.send(call(11, "app_echo", {"x": 1}, _meta={"progressToken": "t11", "claudecode/toolUseId": "u"}))
    await relay({"result": {"echo": 1}})
    await agent.response(11)
    await agent.send(call(13, "nope", {}))  # an unknown tool: a tool error
    await agent.response(13)
    if version != "2025-06-18":
        return
    await agent.send(call("twelve", "app_echo", {"x": 1}))
    await relay({"error": "no such thing"})
    await agent.response("twelve")
    await agent.send(call(14, "app_echo"))  # no arguments: the tool's schema decides
    await relay({"result": "plain text"})
    await agent.response(14)
    await agent.send(call(15, "permission_prompt", {"tool_name": "Bash", "input": {"command": "ls"}}))
    await relay({"approve": True}, kind="approval_request")
    await agent.response(15)
    for request_id, params in ((21, {"name": 5}), (22, {"name": "app_echo", "arguments": [1]}), (23, {})):
        await agent.send({"jsonrpc": "2.0", "id": request_id, "method": "tools/call", "params": params})
        await agent.response(request_id)
    await agent.send(call(16, "app_echo", {"x": 16}))  # cancelled while the caller holds it
    await relay(None)
    await agent.send({"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": 16}})
    await agent.send({"jsonrpc": "2.0", "id": "p2", "method": "ping"})
    await agent.response("p2")
    await agent.send({"jsonrpc": "2.0", "id": "list2", "method": "tools/list", "params": {"cursor": "x"}})
    await agent.response("list2")
    for line, request_id in (("not json\n", None), ('{"jsonrpc": "2.0", "id": 31, "method": "tools/call", "params": \n', None),
                             (json.dumps({"jsonrpc": "2.0", "id": 32, "method": "resources/list"}) + "\n", 32),
                             (json.dumps({"jsonrpc": "2.0", "id": 33, "method": "ping", "params": {"x": 1}}) + "\n", 33),
                             (json.dumps(call(34, "nope", {}, _meta=ENVELOPE)) + "\n", 34),
                             (json.dumps({"jsonrpc": "2.0", "id": 35, "method": "tools/list", "params": {"cursor": 5}}) + "\n", 35),
                             (json.dumps(initialize(request_id=36)) + "\n", 36)):
        await agent.send(line)
        if request_id is not None:  # the SDK answers no line it cannot read: the next answer shows it
            await agent.response(request_id)
    await agent.send({"jsonrpc": "2.0", "id": "end", "method": "ping"})
    await agent.response("end")


async def modern_script(agent: Agent, version: str, relay: Any) -> None:
    """A 2026-07-28 agent (every request enveloped), or one whose `initialize` names 2026-07-28."""
    if version == "initialize-2026-07-28":
        await agent.send(initialize("2026-07-28"))  # the SDK negotiates a handshake-era version
        await agent.response(0)
        await agent.send({"jsonrpc": "2.0", "method": "notifications/initialized"})
        await agent.send({"jsonrpc": "2.0", "id": 1, "method": "tools/list"})
        await agent.response(1)
        return
    await agent.send({"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {"_meta": ENVELOPE}})
    await agent.response(1)
    await agent.send(call(2, "app_echo", {"x": 2}, _meta=ENVELOPE))
    await relay({"result": {"echo": 2}})
    await agent.response(2)
    await agent.send(call(3, "nope", {}, _meta=ENVELOPE))
    await agent.response(3)
    await agent.send(initialize(request_id=4))  # the handshake on a 2026-07-28 connection: refused
    await agent.response(4)


async def agent_lines(deployment: Deployment, session: str, version: str, fast: bool, tmp: Path,
                      caller: Client, events: EventLog, answered: list[str]) -> tuple[list[dict[str, Any]], int]:
    """Every line an agent of `version` got for its script, and how many calls the router took."""

    async def relay(answer: Any, kind: str = "caller_tool_request") -> None:
        """The caller answers the next request it got (an approval or a caller tool's; None: holds
        it), or declares the caller tools `answer` names (kind `declare`)."""
        if kind == "declare":
            declared = await caller.call_tool("session_message", {
                "instance": "box1", "session_id": session, "message": "again",
                "context": {"caller_id": "app", "caller_tools": answer["tools"]}})
            assert not declared.is_error, text_of(declared)
            return
        event = await events.wait_for(lambda e: e["type"] == kind and e["request_id"] not in answered, timeout=TIMEOUT)
        answered.append(event["request_id"])
        if answer is None:
            return
        tool = "approval_response" if kind == "approval_request" else "caller_tool_response"
        reply = await caller.call_tool(tool, {"session_id": session, "request_id": event["request_id"], **answer})
        assert not reply.is_error, text_of(reply)

    log = tmp / f"client-{version}-{fast}.log"
    env = {**os.environ, "OUBLIETTE_FAST_PATH": "1" if fast else "0", **deployment.client_env("box1", f"mcp:{session}")}
    with log.open("w") as client_err:
        process = await trio.lowlevel.open_process(
            [PYTHON, "-m", "oubliette_client", "--log-level", "DEBUG"], stdin=-1, stdout=-1, stderr=client_err, env=env,
        )
        try:
            agent = Agent(process)
            script = handshake_script if version in HANDSHAKE_VERSIONS else modern_script
            await script(agent, version, relay)
        finally:
            process.kill()
            await process.wait()
    return agent.received, log.read_text().count("taken off the SDK's path")


async def test_the_agent_gets_the_same_lines_from_the_router_and_from_the_sdk(deployment: Deployment, tmp_path: Path) -> None:
    """The client's parity test: the same requests with `OUBLIETTE_FAST_PATH` off (the SDK answers
    every line) and on (the line router answers the handshake era's fixed shapes), in every
    handshake-era version and the 2026-07-28 era, give the agent the same lines in the same order,
    each the same JSON (ids, results, errors; the order of an object's keys aside: the router
    writes a listed tool's keys in the registry's order, the SDK in its model's); only the router's handshake takes calls,
    and only when on."""
    answered: list[str] = []
    with (tmp_path / "server.log").open("w") as server_err:
        async with caller_and_session(deployment, "s-same", server_err) as (caller, events):
            for version in (*HANDSHAKE_VERSIONS, "initialize-2026-07-28", "2026-07-28"):
                off, off_took = await agent_lines(deployment, "s-same", version, False, tmp_path, caller, events, answered)
                on, on_took = await agent_lines(deployment, "s-same", version, True, tmp_path, caller, events, answered)
                assert on == off, version
                assert off_took == 0
                assert on_took == ({"2025-06-18": 6}.get(version, 2) if version in HANDSHAKE_VERSIONS else 0), version
                if version in HANDSHAKE_VERSIONS:
                    assert on[0]["result"]["protocolVersion"] == version
                    listed = next(m for m in on if m.get("id") == "list")["result"]["tools"]
                    assert [t["name"] for t in listed] == ["app_echo", "permission_prompt"]


async def test_lines_sent_while_the_sdk_loads_wait_in_order_and_none_is_lost(deployment: Deployment, tmp_path: Path) -> None:
    """More lines than wait in memory (MAX_WAITING_LINES) arrive while the SDK is held: stdin
    is read no further until the SDK takes them, and every one is answered afterwards."""
    from oubliette_client.line_router import MAX_WAITING_LINES

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
    from oubliette_client.line_router import WaitingChars

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
