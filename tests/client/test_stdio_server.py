"""oubliette-client (stdio): the caller's tools as the agent's native MCP tools, end to end.

oubliette-server serves the caller (`deployment.caller()`) and oubliette-client
the agent (`deployment.agent(...)`). Most scenarios run both programs in the
test's Trio loop over memory streams (`InProcessDeployment`); the ones marked
`real_programs` start them as subprocesses speaking stdio, as a sandbox would.
"""

from __future__ import annotations

import tempfile
from typing import Any

import mcp_types as types
import trio
from mcp.client.subscriptions import ToolsListChanged

import pytest

from harness import Deployment, EventLog, ListChanged, structured, text_of
from client_calls import NOTIFY, NOTIFY_SCHEMA, declare, respond

pytestmark = pytest.mark.in_process

NO_SCHEMA = {"name": "ping", "description": "Declared without an inputSchema"}
DOUBLE = {
    "name": "double",
    "description": "Double a number",
    "inputSchema": {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]},
}

# The client reconnects with backoff up to 5 s (x1.2 jitter); waits on reconnection allow for two rounds.
RECONNECT_BOUND = 15.0


def tool_names(listing: types.ListToolsResult) -> set[str]:
    """The relayed tools listed (without the client's built-in `permission_prompt`, tests/server/features/test_connection_approvals.py)."""
    return {tool.name for tool in listing.tools} - {"permission_prompt"}


async def call_and_answer(
    agent: Any, caller: Any, events: EventLog, session_id: str, name: str, arguments: dict, answer: dict,
) -> tuple[dict, types.CallToolResult]:
    """The agent calls `name`; the caller answers the request with `answer`. (request event, agent result)"""
    outcome: dict[str, Any] = {}
    async with trio.open_nursery() as nursery:
        async def agent_call() -> None:
            outcome["result"] = await agent.call_tool(name, arguments)

        nursery.start_soon(agent_call)
        request = await events.wait_for(
            lambda e: e.get("type") == "caller_tool_request" and e.get("arguments") == arguments
            and e.get("session_id") == session_id
        )
        reply = await respond(caller, session_id, request["request_id"], **answer)
        assert not reply.is_error, text_of(reply)
    return request, outcome["result"]


# -- 1. tools declared at session start ----------------------------------------------------


async def test_declared_tools_are_listed_with_their_input_schema(deployment: Deployment) -> None:
    """REQ-CTR-002: tools declared in session_message context appear as {caller_id}_{tool}, with the input schema."""
    async with deployment.caller() as (caller, _events):
        await declare(caller, "box1", "s1", [NOTIFY, NO_SCHEMA])
        async with deployment.agent("box1", "mcp:s1") as agent:
            listing = await agent.list_tools()
    tools = {tool.name: tool for tool in listing.tools}
    assert set(tools) == {"myapp_send_notification", "myapp_ping", "permission_prompt"}
    assert tools["myapp_send_notification"].input_schema == NOTIFY_SCHEMA
    assert tools["myapp_send_notification"].description == "Send notification"
    assert tools["myapp_ping"].input_schema == {"type": "object"}


# -- 2./3. validation and unknown tools, before anything is relayed ---------------------------


async def test_arguments_are_validated_before_relaying(deployment: Deployment) -> None:
    """A wrong-typed or missing argument is refused by the client; the caller never sees a request."""
    async with deployment.caller() as (caller, events):
        await declare(caller, "box1", "s1", [NOTIFY])
        async with deployment.agent("box1", "mcp:s1") as agent:
            wrong_type = await agent.call_tool("myapp_send_notification", {"message": 42})
            missing = await agent.call_tool("myapp_send_notification", {"urgent": True})
            # A good call afterwards: once its request reached the caller, any relayed bad call would have too.
            request, good = await call_and_answer(
                agent, caller, events, "s1", "myapp_send_notification", {"message": "ok"}, {"result": {"sent": True}},
            )
    assert wrong_type.is_error
    assert "invalid arguments for myapp_send_notification" in text_of(wrong_type)
    assert "message" in text_of(wrong_type) and "42 is not of type 'string'" in text_of(wrong_type)
    assert missing.is_error
    assert "'message' is a required property" in text_of(missing)
    assert not good.is_error and good.structured_content == {"sent": True}
    assert [e["arguments"] for e in events.of_type("caller_tool_request")] == [{"message": "ok"}]
    assert request["tool"] == "send_notification"


async def test_unknown_tool_gives_a_clear_error(deployment: Deployment) -> None:
    async with deployment.caller() as (caller, events):
        await declare(caller, "box1", "s1", [NOTIFY])
        async with deployment.agent("box1", "mcp:s1") as agent:
            result = await agent.call_tool("myapp_no_such_tool", {})
    assert result.is_error
    assert "unknown tool 'myapp_no_such_tool'" in text_of(result)
    assert "myapp_send_notification" in text_of(result), "the error lists the tools that exist"
    assert events.of_type("caller_tool_request") == []


# -- 4. the caller's error -----------------------------------------------------------------


async def test_caller_error_response_reaches_the_agent_as_a_tool_error(deployment: Deployment) -> None:
    """REQ-CTR-004 "Tool execution error response"."""
    async with deployment.caller() as (caller, events):
        await declare(caller, "box1", "s1", [NOTIFY])
        async with deployment.agent("box1", "mcp:s1") as agent:
            _request, result = await call_and_answer(
                agent, caller, events, "s1", "myapp_send_notification", {"message": "to bob"},
                {"error": "recipient not found"},
            )
    assert result.is_error
    assert "recipient not found" in text_of(result)
    assert "myapp_send_notification" in text_of(result)


# -- 5. the agent cancels ------------------------------------------------------------------


async def test_agent_cancel_reaches_the_caller_and_leaves_nothing_pending(deployment: Deployment) -> None:
    async with deployment.caller() as (caller, events):
        await declare(caller, "box1", "s1", [NOTIFY])
        async with deployment.agent("box1", "mcp:s1") as agent:
            outcome: dict[str, Any] = {}
            async with trio.open_nursery() as nursery:
                scope = trio.CancelScope()

                async def agent_call() -> None:
                    with scope:
                        outcome["result"] = await agent.call_tool("myapp_send_notification", {"message": "never"})

                nursery.start_soon(agent_call)
                request = await events.wait_type("caller_tool_request")
                # While the call is in flight the server reports it as pending for the session.
                waited = await caller.call_tool("session_message", {
                    "session_id": "s1", "instance": "box1", "message": "busy?", "wait": 0.1})
                stop = structured(waited)
                assert stop["stop_reason"] == "requires_action"
                [entry] = stop["pending"]
                assert entry.pop("expires_at").endswith("Z")
                assert entry == {"kind": "caller_tool", "request_id": request["request_id"], "tool": "send_notification",
                                 "arguments": {"message": "never"}, "caller_id": "myapp"}
                scope.cancel()  # the SDK client sends notifications/cancelled for the call
            assert "result" not in outcome
            cancelled = await events.wait_type("caller_tool_cancelled", request_id=request["request_id"])
            assert cancelled["reason"] == "cancelled by the agent"
            assert cancelled["session_id"] == "s1"

            late = await respond(caller, "s1", request["request_id"], result={"sent": True})
            assert late.is_error
            assert "no longer pending" in text_of(late) and "cancelled" in text_of(late)

            # Nothing is left pending for the session ...
            waited = await caller.call_tool("session_message", {"session_id": "s1", "instance": "box1",
                                                                "message": "still there?", "wait": 0.2})
            assert not waited.is_error, text_of(waited)
            assert structured(waited)["pending"] == []
            # ... and the tool works again.
            _request, result = await call_and_answer(
                agent, caller, events, "s1", "myapp_send_notification", {"message": "again"}, {"result": "sent"},
            )
    assert not result.is_error and text_of(result) == "sent"
    assert len(events.of_type("caller_tool_cancelled")) == 1


# -- 6. many calls at once -----------------------------------------------------------------


@pytest.mark.real_programs
async def test_hundred_concurrent_calls_answered_in_reverse_order(deployment: Deployment) -> None:
    """100 calls in flight from one agent; answered last-first, each agent call gets its own result."""
    count = 100
    async with deployment.caller() as (caller, events):
        await declare(caller, "box1", "s1", [DOUBLE])
        async with deployment.agent("box1", "mcp:s1") as agent:
            results: dict[int, types.CallToolResult] = {}
            with trio.fail_after(60):
                async with trio.open_nursery() as nursery:
                    async def agent_call(n: int) -> None:
                        results[n] = await agent.call_tool("myapp_double", {"n": n})

                    for n in range(count):
                        nursery.start_soon(agent_call, n)
                    # Every request reaches the caller before any is answered: none waits behind another.
                    await events.wait_for(lambda _e: len(events.of_type("caller_tool_request")) >= count)
                    requests = events.of_type("caller_tool_request")
                    assert sorted(r["arguments"]["n"] for r in requests) == list(range(count))
                    assert len({r["request_id"] for r in requests}) == count
                    assert results == {}
                    for request in reversed(requests):
                        n = request["arguments"]["n"]
                        reply = await respond(caller, "s1", request["request_id"], result={"n": n, "doubled": 2 * n})
                        assert not reply.is_error, text_of(reply)
    assert sorted(results) == list(range(count))
    for n, result in results.items():
        assert not result.is_error, text_of(result)
        assert result.structured_content == {"n": n, "doubled": 2 * n}


# -- 7. relay down -------------------------------------------------------------------------


async def test_client_started_before_the_server_picks_up_tools_later(deployment: Deployment) -> None:
    """The client serves MCP without a relay, then connects when the server appears and shows its tools."""
    changes = ListChanged()
    async with deployment.agent("box1", "mcp:s1", extra_args=("--connect-wait", "0.5"),
                                message_handler=changes) as agent:
        listing = await agent.list_tools()
        assert tool_names(listing) == set()
        early = await agent.call_tool("myapp_send_notification", {"message": "too early"})
        assert early.is_error
        assert "unknown tool 'myapp_send_notification'" in text_of(early)
        assert "unavailable" in text_of(early), "while the relay is down, the error says so"

        async with deployment.caller() as (caller, events):
            await declare(caller, "box1", "s1", [NOTIFY])
            await changes.wait_beyond(0, timeout=RECONNECT_BOUND)
            assert tool_names(await agent.list_tools()) == {"myapp_send_notification"}
            _request, result = await call_and_answer(
                agent, caller, events, "s1", "myapp_send_notification", {"message": "now"}, {"result": {"sent": 1}},
            )
    assert not result.is_error and result.structured_content == {"sent": 1}


@pytest.mark.real_programs
async def test_call_while_the_relay_is_down_says_it_is_unavailable(deployment: Deployment) -> None:
    """The server goes away while the agent stays up: the known tool stays listed, calls say why they fail."""
    changes = ListChanged()
    stop, gone = trio.Event(), trio.Event()

    async def caller_until_stopped(*, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        async with deployment.caller() as (caller, _events):
            task_status.started(caller)
            await stop.wait()
        gone.set()  # the server process exited and its end of the relay socket is closed

    # the agent starts with its relay (a client that cannot reach it at the start fails), which then goes
    async with trio.open_nursery() as nursery:
        caller = await nursery.start(caller_until_stopped)
        async with deployment.agent("box1", "mcp:s1", extra_args=("--connect-wait", "0.5"),
                                    message_handler=changes) as agent:
            assert tool_names(await agent.list_tools()) == set()  # a change after this list is announced
            await declare(caller, "box1", "s1", [NOTIFY])
            await changes.wait_beyond(0, timeout=RECONNECT_BOUND)
            assert tool_names(await agent.list_tools()) == {"myapp_send_notification"}
            stop.set()
            await gone.wait()
            listing = await agent.list_tools()
            assert tool_names(listing) == {"myapp_send_notification"}, "the tools it last knew stay listed"
            result = await agent.call_tool("myapp_send_notification", {"message": "anyone?"})
    assert result.is_error
    assert "unavailable" in text_of(result)
    assert deployment.relay in text_of(result)


# -- 8. tool list changes in both protocol eras ---------------------------------------------


async def test_legacy_agent_is_told_of_every_tool_list_change(deployment: Deployment) -> None:
    """Handshake era: declare, redeclare a different set, declare none -> list_changed each time."""
    changes = ListChanged()
    async with deployment.caller() as (caller, _events):
        async with deployment.agent("box1", "mcp:s1", message_handler=changes) as agent:
            assert tool_names(await agent.list_tools()) == set()

            await declare(caller, "box1", "s1", [NOTIFY])
            seen = await changes.wait_beyond(0)
            assert tool_names(await agent.list_tools()) == {"myapp_send_notification"}

            await declare(caller, "box1", "s1", [NO_SCHEMA, DOUBLE])
            seen = await changes.wait_beyond(seen)
            assert tool_names(await agent.list_tools()) == {"myapp_ping", "myapp_double"}

            await declare(caller, "box1", "s1", [])
            seen = await changes.wait_beyond(seen)
            assert tool_names(await agent.list_tools()) == set()
    assert changes.count == 3


async def test_legacy_agent_is_told_without_having_listed_first(deployment: Deployment) -> None:
    """list_changed reaches an agent that has only initialized (no tools/list or tools/call yet)."""
    changes = ListChanged()
    async with deployment.caller() as (caller, _events):
        async with deployment.agent("box1", "mcp:s1", message_handler=changes) as agent:
            await declare(caller, "box1", "s1", [NOTIFY])
            await changes.wait_beyond(0)
            assert tool_names(await agent.list_tools()) == {"myapp_send_notification"}


@pytest.mark.real_programs
async def test_modern_agent_receives_tools_list_changed_events(deployment: Deployment) -> None:
    """2026-07-28 (the SDK's default mode): a subscriptions/listen event when the caller declares tools."""
    async with deployment.caller() as (caller, _events):
        async with deployment.agent("box1", "mcp:s1", mode="auto") as agent:
            assert agent.protocol_version == "2026-07-28"
            assert tool_names(await agent.list_tools()) == set()
            async with agent.listen(tools_list_changed=True) as subscription:
                await declare(caller, "box1", "s1", [NOTIFY])
                with trio.fail_after(10):
                    event = await subscription.__anext__()
                assert isinstance(event, ToolsListChanged)
                listing = await agent.list_tools(cache_mode="refresh")
                assert tool_names(listing) == {"myapp_send_notification"}
                assert listing.tools[0].input_schema == NOTIFY_SCHEMA

                await declare(caller, "box1", "s1", [DOUBLE])
                with trio.fail_after(10):
                    event = await subscription.__anext__()
                assert isinstance(event, ToolsListChanged)
                assert tool_names(await agent.list_tools(cache_mode="refresh")) == {"myapp_double"}


# -- 9. a client without a session ----------------------------------------------------------


async def test_client_without_session_sees_the_latest_declaration_per_caller(deployment: Deployment) -> None:
    changes = ListChanged()
    async with deployment.caller() as (caller, events):
        await declare(caller, "box1", "s1", [NOTIFY])
        await declare(caller, "box1", "s2", [DOUBLE])                       # myapp's latest declaration
        await declare(caller, "box1", "s3", [NO_SCHEMA], caller_id="other")  # another caller id
        await declare(caller, "box9", "s4", [NOTIFY], caller_id="elsewhere")  # another instance
        async with deployment.agent("box1", None, message_handler=changes) as agent:
            assert tool_names(await agent.list_tools()) == {"myapp_double", "other_ping"}
            request, result = await call_and_answer(
                agent, caller, events, "s2", "myapp_double", {"n": 21}, {"result": {"doubled": 42}},
            )
            assert request["tool"] == "double" and request["caller_id"] == "myapp"
            assert not result.is_error and result.structured_content == {"doubled": 42}

            # A newer declaration of myapp replaces its tools for this client.
            await declare(caller, "box1", "s5", [NOTIFY])
            await changes.wait_beyond(0)
            assert tool_names(await agent.list_tools()) == {"myapp_send_notification", "other_ping"}
            request, result = await call_and_answer(
                agent, caller, events, "s5", "myapp_send_notification", {"message": "hey"}, {"result": "sent"},
            )
            assert not result.is_error and text_of(result) == "sent"


# -- 10. long names -------------------------------------------------------------------------


async def test_tool_names_over_64_characters_are_warned_about(deployment: Deployment) -> None:
    long_tool = "t" * 60
    published = f"myapp_{long_tool}"
    assert len(published) > 64
    # `errlog` is the real client's stderr, so this test starts the real programs.
    with tempfile.TemporaryFile(mode="w+", encoding="utf-8") as errlog:
        async with deployment.caller() as (caller, _events):
            await declare(caller, "box1", "s1", [NOTIFY, {"name": long_tool, "description": "long"}])
            async with deployment.agent("box1", "mcp:s1", errlog=errlog) as agent:
                assert tool_names(await agent.list_tools()) == {"myapp_send_notification", published}
        # The agent's context has ended: the client process has exited and flushed its stderr.
        errlog.seek(0)
        stderr = errlog.read()
    warnings = [line for line in stderr.splitlines() if "WARNING" in line and published in line]
    assert warnings, stderr
    assert "64" in warnings[0]
    assert not any("myapp_send_notification" in line for line in stderr.splitlines() if "WARNING" in line)


async def test_initialize_is_answered_before_a_slow_relay_and_the_first_list_waits_for_it(tmp_path: Any) -> None:
    """The handshake waits for the relay's verdict on the hello only `HELLO_VERDICT_WAIT` (1 s, so a
    refused token fails the handshake); the first `tools/list` waits for it up to `--connect-wait`.

    The relay here accepts the connection and never answers `hello`, the slowest relay there is.
    """
    import subprocess
    import sys
    import time

    from harness import HandMcp

    socket_path = str(tmp_path / "silent.sock")
    listener = trio.socket.socket(trio.socket.AF_UNIX, trio.socket.SOCK_STREAM)
    await listener.bind(socket_path)
    listener.listen()
    accepted: list[Any] = []

    async def accept_and_stay_silent() -> None:
        while True:
            connection, _ = await listener.accept()
            accepted.append(connection)

    connect_wait = 8.0  # long beside the handshake's 1 s, so a loaded machine's slow start cannot blur the two
    async with trio.open_nursery() as nursery:
        nursery.start_soon(accept_and_stay_silent)
        process = await trio.lowlevel.open_process(
            [sys.executable, "-m", "oubliette_client", "--relay", f"unix:{socket_path}", "--instance", "box1",
             "--token", "t", "--connect-wait", str(connect_wait)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
        )
        try:
            agent = HandMcp(process)
            with trio.fail_after(30):
                started = time.monotonic()
                await agent.send({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
                    "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "hand", "version": "1"}}})
                assert "result" in await agent.response(1)
                initialized_after = time.monotonic() - started
                await agent.send({"jsonrpc": "2.0", "method": "notifications/initialized"})
                await agent.send({"jsonrpc": "2.0", "id": 2, "method": "tools/list"})
                listed = await agent.response(2)
                listed_after = time.monotonic() - started
        finally:
            process.kill()
            await process.wait()
            nursery.cancel_scope.cancel()
    for connection in accepted:
        connection.close()
    listener.close()
    assert accepted, "the client connected to the relay"
    assert initialized_after < connect_wait / 2, initialized_after
    assert listed_after >= connect_wait * 0.9, listed_after  # it waited for the relay's first attempt
    assert [tool["name"] for tool in listed["result"]["tools"]] == ["permission_prompt"]


async def test_the_relay_link_is_started_as_a_service_without_waiting_for_the_relay() -> None:
    """`nursery.start(link.run)` returns while the relay is down; the first attempt is reported after."""
    from oubliette_client.relay_link import RelayLink
    from oubliette_client.settings import RelaySettings

    async def ignore(method: str, params: Any) -> None:
        return None

    link = RelayLink(RelaySettings(relay="unix:/nonexistent/relay.sock", instance="box1", token="t"), "client", ignore)
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            await nursery.start(link.run)
            await link.attempted.wait()
            assert not link.connected and "cannot connect" in link.failure_line()
            nursery.cancel_scope.cancel()
