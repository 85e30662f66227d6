"""The caller tool relay with the caller on Streamable HTTP (`/mcp`).

The server runs with HTTP listeners and no stdio caller (`deployment.http_server()`);
callers are the MCP SDK's client over Streamable HTTP with the server's bearer token
(`server.caller(mode=...)`). A handshake-era ("legacy") caller receives its events on
the session's SSE stream as `notifications/message` from logger `oubliette`; a
2026-07-28 caller receives them request-scoped, while its own `session_message` with
`wait` is in flight. The agent is the SDK's client spawning `oubliette-client`
(`deployment.agent(...)`), or the demo agent driven by a guest runtime.
"""

from __future__ import annotations

import json
import logging
import time
from contextlib import asynccontextmanager, contextmanager
from typing import Any, AsyncIterator, Iterator

import mcp_types as types
import pytest
import trio

from harness import DEMO_AGENT, Deployment, EventLog, HttpServer, structured, text_of
from parity import masked, masked_text

pytestmark = pytest.mark.in_process

NOTIFY_SCHEMA = {"type": "object", "properties": {"message": {"type": "string"}}}
NOTIFY = {"name": "send_notification", "description": "Send notification", "inputSchema": NOTIFY_SCHEMA}
SLOW = {"name": "slow_tool", "description": "Never answered"}
DEMO_MESSAGE = 'Please call myapp_send_notification {"message": "hi"}'
TURN_TIMEOUT = 60.0


async def declare(caller: Any, instance: str, session_id: str, tools: list[dict], message: str = "hi") -> dict:
    result = await caller.call_tool("session_message", {
        "instance": instance, "session_id": session_id, "message": message,
        # echo_own_answers: these tests also check that the caller_tool_result event reaches the caller.
        "context": {"caller_id": "myapp", "caller_tools": tools, "echo_own_answers": True},
    })
    assert not result.is_error, text_of(result)
    return structured(result)


async def respond(caller: Any, session_id: str, request_id: str, **answer: Any) -> types.CallToolResult:
    return await caller.call_tool("caller_tool_response", {"session_id": session_id, "request_id": request_id, **answer})


async def call_and_answer(
    agent: Any, caller: Any, events: EventLog, session_id: str, name: str, arguments: dict, answer: dict,
) -> tuple[dict, types.CallToolResult, types.CallToolResult]:
    """The agent calls `name`; the caller answers its request. (request event, caller's reply, agent's result)"""
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
    return request, reply, outcome["result"]


# -- REQ-CTR-001/003/004: the successful call ------------------------------------------------


@pytest.mark.real_programs
async def test_http_caller_answers_a_caller_tool_request(deployment: Deployment) -> None:
    """The request event arrives on the SSE stream, the caller answers, the agent gets the result."""
    async with deployment.http_server() as server, server.caller() as (caller, events):
        assert caller.protocol_version != "2026-07-28"
        declared = await declare(caller, "box1", "s1", [NOTIFY])
        assert declared["session_id"] == "s1" and declared["instance"] == "box1"
        async with deployment.agent("box1", "mcp:s1") as agent:
            request, reply, result = await call_and_answer(
                agent, caller, events, "s1", "myapp_send_notification", {"message": "hi"},
                {"result": {"status": "sent"}},
            )
        # The resolution is itself an event of the session (on the stream, which may lag the reply).
        resolved = await events.wait_type("caller_tool_result", request_id=request["request_id"])
    assert request["type"] == "caller_tool_request"
    assert request["request_id"]
    assert request["tool"] == "send_notification"
    assert request["arguments"] == {"message": "hi"}
    assert request["session_id"] == "s1" and request["instance"] == "box1"
    assert not reply.is_error, text_of(reply)
    assert structured(reply) == {"resolved": True}
    assert not result.is_error, text_of(result)
    assert result.structured_content == {"status": "sent"}
    assert resolved["result"] == {"status": "sent"} and resolved["tool"] == "send_notification"


# -- REQ-CTR-001: timeouts --------------------------------------------------------------------


async def test_http_caller_tool_times_out_with_the_server_setting(deployment: Deployment) -> None:
    async with deployment.http_server("--caller-timeout", "0.5") as server, server.caller() as (caller, events):
        await declare(caller, "box1", "s1", [SLOW])
        async with deployment.agent("box1", "mcp:s1") as agent:
            started = time.monotonic()
            with trio.fail_after(20):
                result = await agent.call_tool("myapp_slow_tool", {})
            elapsed = time.monotonic() - started
        request = await events.wait_type("caller_tool_request", tool="slow_tool")
        cancelled = await events.wait_type("caller_tool_cancelled", request_id=request["request_id"])
    assert result.is_error
    assert "timeout" in text_of(result) and "0.5 s" in text_of(result)
    assert 0.4 < elapsed < 10
    assert cancelled["reason"] == "timeout"


async def test_http_caller_per_tool_timeout_overrides_the_server_setting(deployment: Deployment) -> None:
    async with deployment.http_server() as server, server.caller() as (caller, events):
        await declare(caller, "box1", "s1", [dict(SLOW, timeout_ms=300)])
        async with deployment.agent("box1", "mcp:s1") as agent:
            started = time.monotonic()
            with trio.fail_after(20):
                result = await agent.call_tool("myapp_slow_tool", {})
            elapsed = time.monotonic() - started
        request = await events.wait_type("caller_tool_request", tool="slow_tool")
        late = await respond(caller, "s1", request["request_id"], result="too late")
    assert result.is_error
    assert "timeout" in text_of(result) and "0.3 s" in text_of(result)
    assert 0.25 < elapsed < 10, "the per-tool 0.3 s applies, not the server's 60 s"
    assert late.is_error and "no longer pending" in text_of(late) and "timed out" in text_of(late)


# -- REQ-CTR-001: the caller disconnects ------------------------------------------------------


async def test_http_caller_session_end_gives_connection_error_at_once(deployment: Deployment) -> None:
    """The caller's MCP session ends (the SDK sends DELETE on exit) -> connection error, not the timeout."""
    disconnect = trio.Event()
    caller_gone = trio.Event()

    async with deployment.http_server() as server:
        async def run_caller(task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
            async with server.caller() as (caller, events):
                await declare(caller, "box1", "s1", [NOTIFY])
                task_status.started(events)
                await disconnect.wait()
            caller_gone.set()

        async with trio.open_nursery() as outer:
            events = await outer.start(run_caller)
            async with deployment.agent("box1", "mcp:s1") as agent, trio.open_nursery() as nursery:
                outcome: dict[str, Any] = {}
                finished = trio.Event()

                async def agent_call() -> None:
                    outcome["result"] = await agent.call_tool("myapp_send_notification", {"message": "bye"})
                    outcome["at"] = time.monotonic()
                    finished.set()

                nursery.start_soon(agent_call)
                await events.wait_type("caller_tool_request")
                disconnected_at = time.monotonic()
                disconnect.set()  # the caller's client leaves: DELETE /mcp ends its session
                with trio.fail_after(20):
                    await finished.wait()
                    await caller_gone.wait()

        # The session's log records why the request ended. The session belongs to the caller
        # that left, so another MCP caller may not read it; the HTTP tether API (admin token) may.
        async with server.caller() as (reader, _events):
            refused = await reader.call_tool("session_events", {"session_id": "s1", "instance": "box1"})
        assert refused.is_error and "session 's1' belongs to another caller" in text_of(refused)
        async with server.rest() as rest:
            response = await rest.get("/v1/instances/box1/tether/poll", params={
                "session_id": "s1", "channel": "mcp", "types": "caller_tool_cancelled"})
            response.raise_for_status()
            frames = response.json()["frames"]
    result = outcome["result"]
    assert result.is_error
    assert "connection error" in text_of(result) and "disconnected" in text_of(result)
    assert outcome["at"] - disconnected_at < 1.0, "the agent must not wait for the 60 s timeout"
    assert [f["payload"]["reason"] for f in frames] == ["caller disconnected"]


async def raw_modern_post(server: Any, name: str, arguments: dict[str, Any]) -> trio.SocketStream:
    """A 2026-07-28 `tools/call` of `name` written by hand on a TCP connection of its own (to be
    closed mid-call), with the headers the SDK's client sends; the connection."""
    from urllib.parse import urlsplit

    where = urlsplit(server.url)
    assert where.hostname is not None and where.port is not None
    body = modern_body(1, name, arguments).encode()
    head = (f"POST /mcp HTTP/1.1\r\nhost: {where.netloc}\r\nauthorization: Bearer {server.token}\r\n"
            "content-type: application/json\r\naccept: application/json, text/event-stream\r\n"
            f"mcp-protocol-version: 2026-07-28\r\nmcp-method: tools/call\r\nmcp-name: {name}\r\n"
            f"content-length: {len(body)}\r\n\r\n").encode()
    stream = await trio.open_tcp_stream(where.hostname, where.port)
    await stream.send_all(head + body)
    return stream


async def test_a_2026_07_28_wait_whose_connection_closes_ends_at_once(deployment: Deployment) -> None:
    """A 2026-07-28 `session_message` with `wait` whose client closes its connection mid-wait: its
    door cancels it (a 2026-07-28 wait starts no watch of its own), so the wait ends at once, not at
    its time or the no-guest grace, says so in the server's log, and the server goes on serving."""
    left = trio.Event()
    handler = logging.Handler()
    handler.emit = lambda record: left.set() if "left while waiting in session s1" in record.getMessage() else None  # type: ignore[method-assign]
    turns_log = logging.getLogger("oubliette.server.caller_api")
    level = turns_log.level
    turns_log.addHandler(handler)
    turns_log.setLevel(logging.INFO)
    try:
        async with deployment.embedded_http_server("box1") as server, server.rest() as http:
            stream = await raw_modern_post(server, "session_message", {
                "owner_key": "wait-closer-0123456789abcdef", "instance": "box1", "session_id": "s1",
                "message": "hi", "wait": 60})
            await server.wait_waiters("box1", 1)  # the wait waits on the turn's end
            await stream.aclose()
            with trio.fail_after(6):  # the no-guest grace (8 s) would end it otherwise, without this line
                await left.wait()
            await server.wait_waiters("box1", 0)
            assert (await http.get("/livez")).status_code == 200
    finally:
        turns_log.removeHandler(handler)
        turns_log.setLevel(level)


async def test_a_fast_path_long_poll_whose_connection_closes_ends_at_once(deployment: Deployment) -> None:
    """A 2026-07-28 `session_events` long poll taken off the SDK's path whose client closes its
    connection mid-wait: the connection's watch (`ConnectionWatch`) cancels the call when the
    connection's reading ends, so the store's wait ends at once, not at its `wait_ms`, and the
    connection's next owner finds nothing left of it."""
    with fast_path_log() as taken:
        async with deployment.embedded_http_server("box1") as server, server.rest() as http:
            caller = RawModernCaller(http, "s1")
            after = await declare_echo(caller)
            stream = await raw_modern_post(server, "session_events", {
                "owner_key": caller.owner_key, "session_id": "s1", "types": ["caller_tool_request"],
                "after_seq": after, "wait_ms": 30_000})
            await server.wait_waiters("box1", 1)  # the long poll waits in the store
            await stream.aclose()
            with trio.fail_after(5):  # its wait_ms is 30 s
                await server.wait_waiters("box1", 0)
            assert (await caller.poll("the next poll", after, 0)) == []
    assert sum("taken off the SDK's path" in line for line in taken) == 2, taken


# -- REQ-CTR-002: dynamic registration -------------------------------------------------------


async def test_http_caller_declared_tools_reach_the_agent_with_their_input_schema(deployment: Deployment) -> None:
    async with deployment.http_server() as server, server.caller() as (caller, events):
        await declare(caller, "box1", "s1", [NOTIFY, {"name": "ping", "description": "No schema"}])
        async with deployment.agent("box1", "mcp:s1") as agent:
            listing = await agent.list_tools()
            tools = {tool.name: tool for tool in listing.tools}
            _request, _reply, result = await call_and_answer(
                agent, caller, events, "s1", "myapp_ping", {}, {"result": "pong"},
            )
    assert set(tools) == {"myapp_send_notification", "myapp_ping", "permission_prompt"}
    assert tools["myapp_send_notification"].input_schema == NOTIFY_SCHEMA
    assert tools["myapp_send_notification"].description == "Send notification"
    assert tools["myapp_ping"].input_schema == {"type": "object"}
    assert not result.is_error and text_of(result) == "pong"


# -- REQ-CTR-004: the caller's error ---------------------------------------------------------


async def test_http_caller_error_response_reaches_the_agent(deployment: Deployment) -> None:
    async with deployment.http_server() as server, server.caller() as (caller, events):
        await declare(caller, "box1", "s1", [NOTIFY])
        async with deployment.agent("box1", "mcp:s1") as agent:
            request, reply, result = await call_and_answer(
                agent, caller, events, "s1", "myapp_send_notification", {"message": "to bob"},
                {"error": "recipient not found"},
            )
        resolved = await events.wait_type("caller_tool_result", request_id=request["request_id"])
    assert not reply.is_error and structured(reply) == {"resolved": True}
    assert result.is_error
    assert "recipient not found" in text_of(result)
    assert resolved["error"] == "recipient not found"


# -- two callers of one server --------------------------------------------------------------


async def test_only_the_declaring_http_caller_may_answer(deployment: Deployment) -> None:
    async with deployment.http_server() as server:
        async with server.caller() as (caller_a, events_a), server.caller() as (caller_b, events_b):
            await declare(caller_a, "box1", "s1", [NOTIFY])
            async with deployment.agent("box1", "mcp:s1") as agent, trio.open_nursery() as nursery:
                outcome: dict[str, Any] = {}

                async def agent_call() -> None:
                    outcome["result"] = await agent.call_tool("myapp_send_notification", {"message": "for A"})

                nursery.start_soon(agent_call)
                request = await events_a.wait_type("caller_tool_request")
                request_id = request["request_id"]

                stolen = await respond(caller_b, "s1", request_id, result={"from": "B"})
                assert stolen.is_error
                assert "session 's1' belongs to another caller" in text_of(stolen)

                answered = await respond(caller_a, "s1", request_id, result={"from": "A"})
                assert not answered.is_error, text_of(answered)
                assert structured(answered) == {"resolved": True}

            again = await respond(caller_a, "s1", request_id, result={"from": "A again"})
            unknown = await respond(caller_a, "s1", "ctr-0000000000000000", result={})
    result = outcome["result"]
    assert not result.is_error, text_of(result)
    assert result.structured_content == {"from": "A"}, "A's answer stands; B's was refused"
    assert again.is_error
    assert "no longer pending" in text_of(again) and "already resolved" in text_of(again)
    assert unknown.is_error
    assert "unknown request_id 'ctr-0000000000000000'" in text_of(unknown)
    # B never took part in session s1: none of its events reached B.
    assert [e for e in events_b.events if e.get("session_id") == "s1"] == []


# -- capabilities in both eras ---------------------------------------------------------------


async def test_mcp_endpoint_advertises_tools_list_changed_in_both_eras(deployment: Deployment) -> None:
    async with deployment.http_server() as server:
        async with server.caller(mode="legacy") as (legacy, _events):
            assert legacy.protocol_version != "2026-07-28"
            assert legacy.server_capabilities.tools is not None
            assert legacy.server_capabilities.tools.list_changed is True
        async with server.caller(mode="auto") as (modern, _events):
            assert modern.protocol_version == "2026-07-28"
            assert modern.server_capabilities.tools is not None
            assert modern.server_capabilities.tools.list_changed is True


async def test_modern_tool_call_is_dispatched_alone(deployment: Deployment, monkeypatch: pytest.MonkeyPatch) -> None:
    """A 2026-07-28 `tools/call` runs the call alone: the SDK checks its `Mcp-Param-*` headers
    against the tool's `inputSchema` from the server's lookup, not from a whole `tools/list`
    dispatched (and every tool's schema dumped) before each call."""
    from mcp.server import _streamable_http_modern as modern

    dispatched: list[str] = []
    serve_one = modern.serve_one

    async def counted(app: Any, dctx: Any, method: str, *args: Any, **kwargs: Any) -> Any:
        dispatched.append(method)
        return await serve_one(app, dctx, method, *args, **kwargs)

    monkeypatch.setattr(modern, "serve_one", counted)
    async with deployment.embedded_http_server("box1") as server, server.caller(mode="auto", events=False) as (caller, _):
        assert caller.protocol_version == "2026-07-28"
        read = await caller.call_tool("session_events", {"instance": "box1", "session_id": "s1", "after_seq": 0})
        assert "unknown session" in text_of(read)  # answered by the tool itself
        assert dispatched[-1:] == ["tools/call"] and "tools/list" not in dispatched, dispatched
        await caller.list_tools()
        assert dispatched[-1] == "tools/list", dispatched


# -- whole turns with the guest runtime and the demo agent -----------------------------------


@asynccontextmanager
async def demo_turn(server: HttpServer, deployment: Deployment, mode: str) -> AsyncIterator[tuple[dict, EventLog, Any]]:
    """session_message(wait) with the demo message stops at `requires_action`; the caller
    answers the request with wait, which returns the turn's end.

    Yields (session_message's result with the end's stop fields, the caller's events, the
    caller_tool_response reply), with the caller still connected.
    """
    async with deployment.guest("box1", DEMO_AGENT), server.caller(mode=mode) as (caller, events):
        with trio.fail_after(TURN_TIMEOUT):
            first = await caller.call_tool("session_message", {
                "instance": "box1", "session_id": "demo-1", "message": DEMO_MESSAGE, "wait": TURN_TIMEOUT,
                "context": {"caller_id": "myapp", "caller_tools": [NOTIFY]},
            })
        assert not first.is_error, text_of(first)
        stop = structured(first)
        assert stop["stop_reason"] == "requires_action", stop
        [entry] = stop["pending"]
        assert entry["tool"] == "send_notification" and entry["arguments"] == {"message": "hi"}, entry
        # A 2026-07-28 caller is named by its owner_key, which its result (and its request-scoped events) carry.
        key = {"owner_key": stop["owner_key"]} if mode != "legacy" else {}
        if not key:  # the event came too, on the SSE stream
            request = await events.wait_type("caller_tool_request", timeout=TURN_TIMEOUT)
            assert request["request_id"] == entry["request_id"]
        with trio.fail_after(TURN_TIMEOUT):
            reply = await respond(caller, "demo-1", entry["request_id"], result={"status": "sent"},
                                  wait=TURN_TIMEOUT, **key)
        assert not reply.is_error, text_of(reply)
        ended = structured(reply)
        turn = {**stop, **{k: ended[k] for k in ("stop_reason", "text", "pending")}}
        yield turn, events, reply


async def test_modern_http_caller_gets_events_during_its_waiting_session_message(deployment: Deployment) -> None:
    """2026-07-28: no standalone stream; the session's events ride the caller's own session_message(wait),
    with its owner_key, but the request event its requires_action stop carries whole does not."""
    async with deployment.http_server() as server:
        async with server.caller(mode="auto") as (probe, _events):
            assert probe.protocol_version == "2026-07-28"
        async with demo_turn(server, deployment, mode="auto") as (turn, events, reply):
            requests = events.of_type("caller_tool_request")
            presence = events.of_type("status.presence")
    assert requests == []
    assert presence and all(event["owner_key"] == turn["owner_key"] for event in presence), presence
    assert turn["msg_id"] in [event.get("reply_to") for event in presence], presence
    assert not reply.is_error and structured(reply)["resolved"] is True
    assert turn["stop_reason"] == "end_turn"
    assert turn["session_id"] == "demo-1" and turn["instance"] == "box1"
    assert turn["msg_id"] and isinstance(turn["ingress_seq"], int)
    assert turn["pending"] == []
    assert 'myapp_send_notification returned {"status": "sent"}' in turn["text"]


@pytest.mark.real_programs
async def test_legacy_http_caller_demo_flow_ends_the_turn_with_the_result(deployment: Deployment) -> None:
    """The demo over HTTP: session_message(wait) + answer the SSE event -> end_turn with the result."""
    async with deployment.http_server() as server:
        async with demo_turn(server, deployment, mode="legacy") as (turn, events, reply):
            # The legacy caller also follows the turn on its own stream (which may lag the response).
            done = await events.wait_type("assistant.done", reply_to=turn["msg_id"])
            presence = events.of_type("status.presence")
    request = events.of_type("caller_tool_request")[0]
    assert request["tool"] == "send_notification" and request["arguments"] == {"message": "hi"}
    assert not reply.is_error and structured(reply)["resolved"] is True
    assert turn["stop_reason"] == "end_turn"
    assert turn["pending"] == []
    assert 'myapp_send_notification returned {"status": "sent"}' in turn["text"]
    assert "Calling myapp_send_notification with " + json.dumps({"message": "hi"}) in turn["text"]
    assert done["text"] == turn["text"]
    assert [e["state"] for e in presence if e.get("reply_to") == turn["msg_id"]] == ["thinking"]


# -- the 2026-07-28 fast path (doors/caller_api/http_fast.py) against the SDK ----------------

#: The 2026-07-28 per-request envelope of a raw caller.
ENVELOPE = {"io.modelcontextprotocol/protocolVersion": "2026-07-28",
            "io.modelcontextprotocol/clientInfo": {"name": "raw", "version": "1"},
            "io.modelcontextprotocol/clientCapabilities": {}}
ECHO = {"name": "echo", "description": "Echo", "inputSchema": {"type": "object", "properties": {"text": {"type": "string"}}}}
#: The response headers a caller acts on.
HEADERS_THAT_MATTER = ("content-type", "cache-control", "allow", "retry-after", "www-authenticate", "mcp-session-id")
OVERSIZE = 4 * 1024 * 1024 + 1


def modern_body(request_id: Any, name: str, arguments: Any, meta: Any = None, **params: Any) -> str:
    """A raw 2026-07-28 `tools/call` body."""
    return json.dumps({"jsonrpc": "2.0", "id": request_id, "method": "tools/call",
                       "params": {"name": name, "arguments": arguments, "_meta": ENVELOPE if meta is None else meta, **params}})


async def chunked(*parts: bytes) -> AsyncIterator[bytes]:
    """A body sent in chunks, with no Content-Length."""
    for part in parts:
        yield part


def payload_of(response: Any, text: str) -> Any:
    """The JSON of an answer's `text`: each SSE event's data, or the body (the text itself when not JSON)."""
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        return [json.loads(line[len("data: "):]) for line in text.split("\r\n") if line.startswith("data: ")]
    try:
        return json.loads(text) if text else None
    except ValueError:
        return text


class RawModernCaller:
    """A 2026-07-28 caller writing its POSTs by hand; each answer kept as the parts a caller reads."""

    def __init__(self, http: Any, session: str) -> None:
        self.http = http
        self.session = session
        self.owner_key = "parity-caller-0123456789abcdef"  # one it chose, the same in both runs
        self.answers: list[tuple[str, Any]] = []

    async def post(self, label: str, name: str, body: str | bytes | AsyncIterator[bytes], **headers: str) -> Any:
        """POST `body` to /mcp with the headers the SDK's client sends for `name` (`headers` over them)."""
        sent = {"content-type": "application/json", "accept": "application/json, text/event-stream",
                "mcp-protocol-version": "2026-07-28", "mcp-method": "tools/call", "mcp-name": name, **headers}
        response = await self.http.post("/mcp", content=body, headers=sent)
        text = response.text
        if response.headers.get("content-type", "").startswith("text/event-stream"):
            text = "\r\n\r\n".join(part for part in text.split("\r\n\r\n") if part and not part.startswith(": ping"))
        payload = payload_of(response, text)
        self.answers.append((label, {
            "status": response.status_code, "body": masked(payload), "layout": masked_text(text),
            "headers": {key: response.headers[key] for key in HEADERS_THAT_MATTER if key in response.headers},
        }))
        return payload

    async def call(self, label: str, request_id: Any, name: str, arguments: dict[str, Any], **headers: str) -> Any:
        """A well-formed call of `name` with this caller's owner key; its result."""
        arguments = {"owner_key": self.owner_key, **arguments}
        answer = await self.post(label, name, modern_body(request_id, name, arguments), **headers)
        return answer.get("result") if isinstance(answer, dict) else answer

    async def poll(self, label: str, after_seq: int, wait_ms: int) -> list[dict[str, Any]]:
        """`session_events` for caller_tool_request frames after `after_seq`: the frames."""
        result = await self.call(label, label, "session_events", {
            "session_id": self.session, "types": ["caller_tool_request"], "after_seq": after_seq, "wait_ms": wait_ms})
        if isinstance(result, list):  # an SSE answer: its one response event
            result = result[-1]["result"]
        return result["structuredContent"]["frames"]


def assert_same_answers(on: list[tuple[str, Any]], off: list[tuple[str, Any]]) -> None:
    """The same requests, in the same order, got the same answers with the fast path on and off."""
    assert [label for label, _ in on] == [label for label, _ in off]
    differing = [(label, a, b) for (label, a), (_, b) in zip(on, off) if a != b]
    assert not differing, json.dumps([d[0] for d in differing]) + json.dumps(differing, indent=1, ensure_ascii=False)


@contextmanager
def fast_path_log() -> Iterator[list[str]]:
    """The fast path's DEBUG lines while the block runs (each taken request logs one)."""
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    fast_log = logging.getLogger("oubliette.fast_calls")
    fast_log.addHandler(handler)
    level = fast_log.level
    fast_log.setLevel(logging.DEBUG)
    try:
        yield lines
    finally:
        fast_log.removeHandler(handler)
        fast_log.setLevel(level)


async def modern_caller_answers(deployment: Deployment, fast: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[list, int]:
    """Every answer a raw 2026-07-28 caller got from a server with `OUBLIETTE_FAST_PATH` on or off,
    and how many of its requests the fast path took."""
    from mcp.server import _streamable_http_modern as sdk_http

    monkeypatch.setenv("OUBLIETTE_FAST_PATH", "1" if fast else "0")
    session = f"s-{'on' if fast else 'off'}"
    with fast_path_log() as taken:
        async with deployment.embedded_http_server("box1") as server, server.rest() as http:
            caller = RawModernCaller(http, session)
            declared = await caller.call("declare", 1, "session_message", {
                "instance": "box1", "session_id": session, "message": "hi",
                "context": {"caller_id": "app", "caller_tools": [ECHO]}})
            assert declared["structuredContent"]["owner_key"] == caller.owner_key
            after = declared["structuredContent"]["ingress_seq"]
            async with deployment.agent("box1", f"mcp:{session}") as agent, trio.open_nursery() as nursery:
                woken: list[list[dict[str, Any]]] = []
                polled = trio.Event()

                async def long_poll() -> None:
                    woken.append(await caller.poll("poll woken", after, 20_000))
                    polled.set()

                nursery.start_soon(long_poll)
                await server.wait_waiters("box1", 1)  # the poll waits before the request exists
                results: list[Any] = []

                async def agent_call(text: str) -> None:
                    results.append(await agent.call_tool("app_echo", {"text": text}))

                nursery.start_soon(agent_call, "héllo ✓")
                with trio.fail_after(TURN_TIMEOUT):
                    await polled.wait()
                first = woken[0][0]
                nursery.start_soon(agent_call, "two")
                second = (await caller.poll("poll after the first", first["seq"], 20_000))[0]
                await caller.poll("poll that times out", second["seq"], 200)
                ids = [frame["payload"]["request_id"] for frame in (first, second)]
                owner = {"session_id": session}
                for label, request_id, arguments in [
                    ("result", 10, {**owner, "request_id": ids[0], "result": {"echo": "héllo ✓"}}),
                    ("error", 11, {**owner, "request_id": ids[1], "error": "no such thing", "wait": False}),
                    ("late", 12, {**owner, "request_id": ids[0], "result": {}}),
                    ("unknown request", 13, {**owner, "request_id": "ctr-0000", "result": {}}),
                    ("bad params: no request_id", 14, {**owner, "result": {}}),
                    ("bad params: result and error", 15, {**owner, "request_id": ids[1], "result": 1, "error": "x"}),
                    ("bad params: unknown key", 16, {**owner, "request_id": ids[1], "result": 1, "extra": 1}),
                    ("unknown session", 17, {"session_id": "nope", "request_id": ids[1], "result": {}}),
                    ("late, with wait", 18, {**owner, "request_id": ids[1], "result": {}, "wait": 0}),
                ]:
                    await caller.call(label, request_id, "caller_tool_response", arguments)
                # The loop of a model caller: each answer waits for the turn's next stop in the same request.
                nursery.start_soon(agent_call, "three")
                third = (await caller.poll("poll for the third", second["seq"], 20_000))[0]
                third_id = third["payload"]["request_id"]
                await caller.call("progress", 19, "caller_tool_progress", {
                    **owner, "request_id": third_id, "progress": 1, "total": 2, "message": "half"})
                waited = trio.Event()
                stops: list[Any] = []

                async def answer_and_wait() -> None:
                    stops.append(await caller.call("answer, wait woken by the next request", 24, "caller_tool_response", {
                        **owner, "request_id": third_id, "result": {"echo": "three"}, "wait": 20}))
                    waited.set()

                nursery.start_soon(answer_and_wait)
                await server.wait_waiters("box1", 1)  # the answer's wait waits before the next request exists
                nursery.start_soon(agent_call, "four")
                with trio.fail_after(TURN_TIMEOUT):
                    await waited.wait()
                # JSON, not SSE: the stop carries the request whole, so its event does not ride first
                # (and the SDK's client keeps its connection).
                assert isinstance(stops[0], dict), stops
                stop = stops[0]["structuredContent"]
                assert stop["stop_reason"] == "requires_action", stop
                assert stop["pending"][0]["arguments"] == {"text": "four"}, stop
                fourth_id = stop["pending"][0]["request_id"]
                await caller.call("answer, wait times out", 25, "caller_tool_response", {
                    **owner, "request_id": fourth_id, "result": {"echo": "four"}, "wait": 0.3})
                await caller.post("wait from a client with elicitation: the SDK's", "caller_tool_response", modern_body(
                    26, "caller_tool_response", {**owner, "owner_key": caller.owner_key, "request_id": fourth_id,
                                                 "result": {}, "wait": 0},
                    {**ENVELOPE, "io.modelcontextprotocol/clientCapabilities": {"elicitation": {}}}))
            assert sorted(text_of(result) for result in results) == sorted([
                '{"echo": "héllo ✓"}', "app_echo failed: no such thing", '{"echo": "three"}', '{"echo": "four"}'])
            await caller.post("wrong owner_key", "caller_tool_response", modern_body(20, "caller_tool_response", {
                "owner_key": "k" * 32, "session_id": session, "request_id": ids[0], "result": {}}))
            await caller.post("events of another owner", "session_events", modern_body(21, "session_events", {
                "owner_key": "k" * 32, "session_id": session}))
            await caller.call("events: bad params", 22, "session_events", {"session_id": session, "wait_ms": -1})
            await caller.call("events: unknown session", 23, "session_events", {"session_id": "nope"})
            good = modern_body(30, "session_events", {"owner_key": caller.owner_key, "session_id": session})
            for label, body, headers in [
                ("Mcp-Name mismatch", good, {"mcp-name": "caller_tool_response"}),
                ("Mcp-Method mismatch", good, {"mcp-method": "tools/list"}),
                ("version header and envelope disagree", good, {"mcp-protocol-version": "2099-01-01"}),
                ("unknown protocol version", modern_body(31, "session_events", {"owner_key": caller.owner_key, "session_id": session},
                                                         {**ENVELOPE, "io.modelcontextprotocol/protocolVersion": "2099-01-01"}),
                 {"mcp-protocol-version": "2099-01-01"}),
                ("Host refused", good, {"host": "evil.example"}),
                ("Origin refused", good, {"origin": "http://evil.example"}),
                ("Content-Type", good, {"content-type": "text/plain"}),
                ("Accept without SSE", good, {"accept": "application/json"}),
                ("oversize", good + " " * OVERSIZE, {}),
                ("oversize, chunked (no Content-Length)", chunked(good.encode(), b" " * OVERSIZE), {}),
                ("not JSON", "{not json", {}),
                ("a batch", f"[{good}]", {}),
                ("an unknown key", good[:-1] + ', "x": 1}', {}),
                ("envelope missing", modern_body(32, "session_events", {"owner_key": caller.owner_key, "session_id": session}, {}), {}),
                ("Mcp-Param header of no parameter", good, {"mcp-param-session_id": "other"}),
            ]:
                await caller.post(label, "session_events", body, **headers)
            # A long poll silent past the SDK's keepalive interval: an SSE stream, pings, then the answer.
            with monkeypatch.context() as patched:
                patched.setattr(sdk_http, "_SSE_PING_INTERVAL", 0.2)
                await caller.poll("poll answered over SSE", second["seq"], 1000)
                await caller.call("wait answered over SSE", 40, "caller_tool_response", {
                    "session_id": session, "request_id": ids[0], "result": {}, "wait": 1})
            # An event of the session during a wait rides it: SSE, the event, then the answer.
            ridden: list[Any] = []
            async with trio.open_nursery() as nursery:

                async def wait_an_event_rides() -> None:
                    ridden.append(await caller.call("wait an event rides", 41, "caller_tool_response", {
                        "session_id": session, "request_id": ids[0], "result": {}, "wait": 1}))

                nursery.start_soon(wait_an_event_rides)
                await server.wait_waiters("box1", 1)  # the wait follows the session
                [followed] = server.app.sessions.find_by_id(session, "box1")
                await server.app.frame_log.append(followed, "assistant.delta", {"text": "on its way"})
            assert "on its way" in json.dumps(ridden[0]), ridden  # SSE: the event, then the answer
    return caller.answers, sum("taken off the SDK's path" in line for line in taken)


async def test_a_2026_07_28_caller_gets_the_same_answers_from_the_fast_path_and_from_the_sdk(
    deployment: Deployment, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The HTTP fast path's parity test: the same raw 2026-07-28 requests to `/mcp` with
    `OUBLIETTE_FAST_PATH` off (the SDK answers every one) and on (the fast path answers the
    well-formed `session_events`, `caller_tool_progress` and `caller_tool_response`, with `wait`
    too) give the caller the same status, headers, JSON body and body layout for each (ids, seq
    and times masked): long polls woken, timed out and answered over SSE, answers ok, error, late,
    unknown, bad params, another owner's key, a progress report, answers with `wait` woken by the
    next request (JSON: its event does not ride), timed out, answered over SSE after the keepalive and
    with an event of the session riding it (SSE: the event, then the answer),
    and every refusal of the transport (headers, size, body)."""
    off, off_taken = await modern_caller_answers(deployment, False, monkeypatch)
    on, on_taken = await modern_caller_answers(deployment, True, monkeypatch)
    assert_same_answers(on, off)
    assert off_taken == 0
    # the five polls, the nine answers (a late one with wait), the progress report, the three answers
    # with wait (woken, timed out, over SSE, an event riding; not the one from a client with elicitation), the four
    # calls after the agent, and the well-formed call with an `Mcp-Param-*` header its tool does not
    # declare (which the SDK ignores too)
    assert on_taken == 5 + 9 + 1 + 4 + 4 + 1, on_taken


async def test_the_sdk_clients_2026_07_28_long_polls_and_answers_take_the_fast_path(deployment: Deployment) -> None:
    """The MCP SDK's own client (mode auto, 2026-07-28) sends `session_events` and
    `caller_tool_response` in the shape the fast path takes: both are answered beside the SDK."""
    with fast_path_log() as taken:
        async with deployment.embedded_http_server("box1") as server, server.caller(mode="auto", events=False) as (caller, _):
            declared = await declare(caller, "box1", "s1", [NOTIFY])
            owner = {"owner_key": declared["owner_key"]}
            read = await caller.call_tool("session_events", {"session_id": "s1", "after_seq": 0, **owner})
            assert not read.is_error and structured(read)["frames"], text_of(read)
            answer = await respond(caller, "s1", "ctr-0000", result={}, **owner)
            assert "is not pending" in text_of(answer) or "unknown" in text_of(answer), text_of(answer)
    assert sum("taken off the SDK's path" in line for line in taken) == 2, taken


async def test_the_fast_path_sends_an_answers_head_with_its_body_and_its_last_event_with_the_end(
    deployment: Deployment, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The fast path's answers reach the socket in fewer writes, the same bytes: a JSON answer in one
    (the head with the body, not two), an SSE one with its head and first ping in one and its response
    event with the end of the chunked body in one (each write a system call and a packet); a
    handshake-era answer likewise, its head in one and its response event with the end in one."""
    from mcp.server import _streamable_http_modern as sdk_http

    from oubliette_server.doors import connection_limits

    writes: list[bytes] = []
    guarded_init = connection_limits.GuardedStream.__init__

    class RecordedSocket:
        """The socket stream under a connection's `GuardedStream`, recording each write it is given."""

        def __init__(self, inner: trio.SocketStream) -> None:
            self.inner = inner
            self.socket = inner.socket

        async def send_all(self, data: bytes) -> None:
            if data:
                writes.append(bytes(data))
            await self.inner.send_all(data)

        def __getattr__(self, name: str) -> Any:
            return getattr(self.inner, name)

    def recorded(guarded: Any, inner: trio.SocketStream, write_timeout: float) -> None:
        guarded_init(guarded, RecordedSocket(inner), write_timeout)  # type: ignore[arg-type]

    monkeypatch.setattr(connection_limits.GuardedStream, "__init__", recorded)
    at_once = connection_limits.write_at_once

    def recorded_at_once(fd: int, data: bytes) -> int:
        """A write the socket takes in the sending task's step (`write_at_once`), recorded likewise."""
        sent = at_once(fd, data)
        if sent:
            writes.append(bytes(data[:sent]))
        return sent

    monkeypatch.setattr(connection_limits, "write_at_once", recorded_at_once)
    with fast_path_log() as taken:
        async with deployment.embedded_http_server("box1") as server, server.rest() as http:
            caller = RawModernCaller(http, "s1")
            after = await declare_echo(caller)
            writes.clear()
            await caller.call("read at once", 2, "session_events", {"session_id": "s1"})
            json_writes = writes[:]
            writes.clear()
            # Only this poll is to outlast the keepalive interval: a slow machine must not turn the
            # declare or the read above into SSE answers.
            with monkeypatch.context() as patched:
                patched.setattr(sdk_http, "_SSE_PING_INTERVAL", 0.2)
                assert await caller.poll("poll answered over SSE", after, 1000) == []
            sse_writes = writes[:]
            handshake = RawHandshakeCaller(http)
            await handshake.open()
            early = {"session_id": "s2", "request_id": "ctr-0000", "result": {}}
            await handshake.call("the session's first call: the SDK's", 1, "caller_tool_response", early)
            writes.clear()
            await handshake.call("a handshake-era answer, taken", 2, "caller_tool_response", early)
            handshake_writes = writes[:]
    assert sum("taken off the SDK's path" in line for line in taken) == 3, taken
    assert handshake_writes[0].startswith(b"HTTP/1.1 200 ") and len(handshake_writes) == 2, handshake_writes
    assert b'"result"' in handshake_writes[-1] and handshake_writes[-1].endswith(b"\r\n\r\n\r\n0\r\n\r\n"), handshake_writes
    assert len(json_writes) == 1 and json_writes[0].startswith(b"HTTP/1.1 200 ") and json_writes[0].endswith(b"}"), json_writes
    assert sse_writes[0].startswith(b"HTTP/1.1 200 ") and sse_writes[0].endswith(b": ping\r\n\r\n\r\n"), sse_writes
    assert b'"result"' in sse_writes[-1] and sse_writes[-1].endswith(b"\r\n\r\n\r\n0\r\n\r\n"), sse_writes


# -- the handshake-era fast path (http_fast_handshake.py) ------------------------------------


HANDSHAKE = "2025-11-25"


class RawHandshakeCaller:
    """A 2025-11-25 caller writing its POSTs by hand on its MCP session; each answer kept whole: the
    status, every header but the date (its session id masked), the body's layout and its JSON."""

    def __init__(self, http: Any) -> None:
        self.http = http
        self.session_id = ""
        self.answers: list[tuple[str, Any]] = []

    async def open(self) -> None:
        """`initialize` and `notifications/initialized`: the session the SDK opens."""
        await self.post("initialize", json.dumps({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
            "protocolVersion": HANDSHAKE, "capabilities": {}, "clientInfo": {"name": "raw", "version": "1"}}}))
        await self.post("initialized", json.dumps({"jsonrpc": "2.0", "method": "notifications/initialized"}))

    async def post(self, label: str, body: str, **headers: str | None) -> Any:
        """POST `body` to /mcp with the headers the SDK's client sends on this session (`headers` over
        them; None: without that header)."""
        sent: dict[str, str | None] = {"content-type": "application/json", "accept": "application/json, text/event-stream",
                **({"mcp-session-id": self.session_id, "mcp-protocol-version": HANDSHAKE} if self.session_id else {}),
                **headers}
        response = await self.http.post("/mcp", content=body, headers={k: v for k, v in sent.items() if v is not None})
        if label == "initialize":
            self.session_id = response.headers["mcp-session-id"]
        text = response.text.replace(self.session_id, "<session>") if self.session_id else response.text
        payload = payload_of(response, text)
        self.answers.append((label, {
            "status": response.status_code, "body": masked(payload), "layout": masked_text(text),
            "headers": [(key, "<session>" if key == "mcp-session-id" else value)
                        for key, value in response.headers.multi_items() if key != "date"],
        }))
        return payload

    async def call(self, label: str, request_id: Any, name: str, arguments: Any, **headers: str | None) -> Any:
        """A `tools/call` of `name` on this session; its result (or error) as read."""
        answer = await self.post(label, json.dumps({"jsonrpc": "2.0", "id": request_id, "method": "tools/call",
                                                    "params": {"name": name, "arguments": arguments}}), **headers)
        return answer[-1] if isinstance(answer, list) and answer else answer


async def handshake_caller_answers(deployment: Deployment, fast: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[list, int]:
    """Every answer a raw 2025-11-25 caller got from a server with `OUBLIETTE_FAST_PATH` on or off,
    and how many of its requests the handshake-era fast path took."""
    monkeypatch.setenv("OUBLIETTE_FAST_PATH", "1" if fast else "0")
    session = f"s-{'on' if fast else 'off'}"
    with fast_path_log() as taken:
        async with deployment.embedded_http_server("box1") as server, server.rest() as http:
            caller = RawHandshakeCaller(http)
            early = {"session_id": session, "request_id": "ctr-0000", "result": {}}
            await caller.open()
            await caller.call("answer before the session's first call: the SDK's", 1, "caller_tool_response", early)
            declared = await caller.call("declare", 2, "session_message", {
                "instance": "box1", "session_id": session, "message": "hi",
                "context": {"caller_id": "app", "caller_tools": [ECHO]}})
            assert "result" in declared, (declared, caller.answers)
            after = declared["result"]["structuredContent"]["ingress_seq"]
            async with deployment.agent("box1", f"mcp:{session}") as agent, trio.open_nursery() as nursery:
                results: list[Any] = []

                async def agent_call(text: str) -> None:
                    results.append(await agent.call_tool("app_echo", {"text": text}))

                async def next_request(label: str, request_id: int) -> dict[str, Any]:
                    nonlocal after
                    read = await caller.call(label, request_id, "session_events", {
                        "session_id": session, "types": ["caller_tool_request"], "after_seq": after, "wait_ms": 20_000})
                    frame = read["result"]["structuredContent"]["frames"][0]
                    after = frame["seq"]
                    return frame["payload"]

                nursery.start_soon(agent_call, "héllo ✓")
                first = (await next_request("poll", 3))["request_id"]
                nursery.start_soon(agent_call, "two")
                second = (await next_request("poll again", 4))["request_id"]
                nursery.start_soon(agent_call, "three")
                third = (await next_request("poll a third time", 5))["request_id"]
                await caller.call("progress", 9, "caller_tool_progress", {
                    "session_id": session, "request_id": third, "progress": 1, "total": 2, "message": "half"})
                owner = {"session_id": session}
                for label, request_id, arguments in [
                    ("result", 10, {**owner, "request_id": first, "result": {"echo": "héllo ✓"}}),
                    ("error", "eleven", {**owner, "request_id": second, "error": "no such thing", "wait": False}),
                    ("late", 12, {**owner, "request_id": first, "result": {}}),
                    ("unknown request", 13, {**owner, "request_id": "ctr-0000", "result": {}}),
                    ("bad params: no request_id", 14, {**owner, "result": {}}),
                    ("bad params: result and error", 15, {**owner, "request_id": third, "result": 1, "error": "x"}),
                    ("bad params: unknown key", 16, {**owner, "request_id": third, "result": 1, "extra": 1}),
                    ("unknown session", 17, {"session_id": "nope", "request_id": third, "result": {}}),
                    ("late, with wait: the SDK's", 18, {**owner, "request_id": first, "result": {}, "wait": 0}),
                ]:
                    await caller.call(label, request_id, "caller_tool_response", arguments)
                good = {**owner, "request_id": "ctr-0000", "result": {}}
                for label, headers in [
                    ("unknown Mcp-Session-Id", {"mcp-session-id": "0" * 32}),
                    ("no protocol version header", {"mcp-protocol-version": None}),
                    ("an empty protocol version header", {"mcp-protocol-version": ""}),
                    ("a 2026-07-28 protocol version header", {"mcp-protocol-version": "2026-07-28"}),
                    ("Host refused", {"host": "evil.example"}),
                    ("Origin refused", {"origin": "http://evil.example"}),
                    ("Content-Type", {"content-type": "text/plain"}),
                    ("Accept without SSE", {"accept": "application/json"}),
                ]:
                    await caller.call(label, 20, "caller_tool_response", good, **headers)
                for label, body in [
                    ("not JSON", "{not json"),
                    ("a batch", "[]"),
                    ("arguments not an object", json.dumps({"jsonrpc": "2.0", "id": 21, "method": "tools/call",
                                                            "params": {"name": "caller_tool_response", "arguments": []}})),
                ]:
                    await caller.post(label, body)
                await cancelled_in_flight(caller, owner)
                await caller.call("answer", 22, "caller_tool_response", {**owner, "request_id": third, "result": {"echo": "three"}})
            assert sorted(text_of(result) for result in results) == sorted([
                '{"echo": "héllo ✓"}', "app_echo failed: no such thing", '{"echo": "three"}'])
            ended = await http.delete("/mcp", headers={"mcp-session-id": caller.session_id, "mcp-protocol-version": HANDSHAKE})
            assert ended.status_code == 200, ended.text
            await caller.call("after the session ended", 23, "caller_tool_response", good)
    return caller.answers, sum("taken off the SDK's path (handshake era)" in line for line in taken)


async def cancelled_in_flight(caller: RawHandshakeCaller, owner: dict[str, str]) -> None:
    """An answer whose call is held until the caller's `notifications/cancelled` for it arrives
    (`CallerApi.call` held for its request id, never released): the cancel's answer, then the call's."""
    from oubliette_server.doors.caller_api.tools import CallerApi

    entered = trio.Event()
    real = CallerApi.call

    async def held(self: Any, ctx: Any, who: Any, name: str, arguments: dict[str, Any], *rest: Any) -> Any:
        if arguments.get("request_id") == "ctr-held":
            entered.set()
            await trio.Event().wait()  # until cancelled
        return await real(self, ctx, who, name, arguments, *rest)

    with pytest.MonkeyPatch.context() as patched:
        patched.setattr(CallerApi, "call", held)
        with trio.fail_after(TURN_TIMEOUT):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(caller.call, "cancelled while in flight", 30, "caller_tool_response",
                                   {**owner, "request_id": "ctr-held", "result": {}})
                await entered.wait()
                cancel = await caller.post("cancel", json.dumps({
                    "jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": 30, "reason": "gone"}}))
                assert cancel is None, cancel  # 202, no body
        # the two answers in one order, whichever the client read first
        caller.answers[-2:] = sorted(caller.answers[-2:], key=lambda answer: answer[0])


async def test_a_2025_11_25_caller_gets_the_same_answers_from_the_fast_path_and_from_the_sdk(
    deployment: Deployment, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The handshake-era fast path's parity test: the same raw 2025-11-25 requests on an MCP session
    with `OUBLIETTE_FAST_PATH` off (the SDK answers every one) and on (the fast path answers the
    well-formed `caller_tool_response` without `wait` and `caller_tool_progress` on a live session)
    give the caller the same status, headers and body, byte for byte (ids and numbers masked):
    answers ok, error (a string request id), late, unknown, bad params, for an unknown session, a
    progress report, a call cancelled in flight by the caller's `notifications/cancelled` (the SDK's
    `Request cancelled` error), and every request the SDK keeps: with `wait`, an unknown or ended MCP session,
    a session whose caller made no call yet, other protocol versions, refused headers and bodies."""
    off, off_taken = await handshake_caller_answers(deployment, False, monkeypatch)
    on, on_taken = await handshake_caller_answers(deployment, True, monkeypatch)
    assert_same_answers(on, off)
    assert off_taken == 0
    # the progress report, the eight answers without wait, "no protocol version header", the one
    # cancelled in flight, the last answer
    assert on_taken == 1 + 8 + 1 + 1 + 1, on_taken


async def test_the_sdk_clients_2025_11_25_answers_take_the_fast_path(deployment: Deployment) -> None:
    """The MCP SDK's own client (mode legacy) answers a request it got on its stream with a
    `caller_tool_response` in the shape the handshake-era fast path takes: answered beside the
    SDK, and the agent gets the result."""
    with fast_path_log() as taken:
        async with deployment.embedded_http_server("box1") as server, server.caller(mode="legacy") as (caller, events):
            await declare(caller, "box1", "s1", [NOTIFY])
            async with deployment.agent("box1", "mcp:s1") as agent:
                _request, reply, result = await call_and_answer(
                    agent, caller, events, "s1", "myapp_send_notification", {"message": "hi"}, {"result": {"status": "sent"}})
    assert structured(reply) == {"resolved": True} and result.structured_content == {"status": "sent"}
    assert sum("taken off the SDK's path (handshake era)" in line for line in taken) == 1, taken


async def test_a_slow_handshake_era_answer_is_pinged_by_its_connection_watch(
    deployment: Deployment, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A handshake-era answer taken off the SDK's path whose call outlasts sse-starlette's ping
    interval gets sse-starlette's keepalive comment from its connection's task (`ConnectionWatch`)
    each interval, before its response event, and its answer as ever; the ping stops with the call."""
    from sse_starlette import EventSourceResponse

    from oubliette_server.doors import connection_limits, http_api

    monkeypatch.setattr(EventSourceResponse, "DEFAULT_PING_INTERVAL", 0.2)
    held, release, pinged_twice = trio.Event(), trio.Event(), trio.Event()
    answer_call = http_api.call_as_caller
    ping = connection_limits.WatchedRequest.pinged
    pings: list[float] = []

    async def counted_ping(watched: Any) -> None:
        pings.append(trio.current_time())  # when it is due: its write may take a step or more
        await ping(watched)
        if len(pings) == 2:
            pinged_twice.set()

    monkeypatch.setattr(connection_limits.WatchedRequest, "pinged", counted_ping)

    async def slow_call(*args: Any) -> Any:
        if args[-1].get("request_id") == "ctr-slow":  # this test's slow answer: held until released
            held.set()
            await release.wait()
        return await answer_call(*args)

    monkeypatch.setattr(http_api, "call_as_caller", slow_call)
    with fast_path_log() as taken:
        async with deployment.embedded_http_server("box1") as server, server.rest() as http:
            handshake = RawHandshakeCaller(http)
            await handshake.open()
            early = {"session_id": "s2", "request_id": "ctr-0000", "result": {}}
            await handshake.call("the session's first call: the SDK's", 1, "caller_tool_response", early)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(handshake.call, "a slow answer, taken", 2, "caller_tool_response",
                                   {**early, "request_id": "ctr-slow"})
                await held.wait()
                with trio.fail_after(10):
                    await pinged_twice.wait()  # the call outlasts two ping intervals (0.2 s each)
                release.set()
    assert sum("taken off the SDK's path (handshake era)" in line for line in taken) == 1, taken
    label, slow = handshake.answers[-1]
    events = [part for part in slow["layout"].split("\r\n\r\n") if part]
    assert label == "a slow answer, taken" and slow["status"] == 200, slow
    assert len(pings) >= 2 and all(later - earlier >= 0.2 for earlier, later in zip(pings, pings[1:])), pings
    assert [part.startswith(": ping - ") for part in events] == [True] * len(pings) + [False], events
    assert "is not pending" in json.dumps(slow["body"]) or "unknown" in json.dumps(slow["body"]), slow["body"]


async def declare_echo(caller: RawModernCaller) -> int:
    """Declare session s1 of box1 with the echo caller tool; its message's ingress seq."""
    declared = await caller.call("declare", 1, "session_message", {
        "instance": "box1", "session_id": "s1", "message": "hi", "context": {"caller_id": "app", "caller_tools": [ECHO]}})
    return int(declared["structuredContent"]["ingress_seq"])


class _ServerTasks(trio.abc.Instrument):
    """The tasks the server starts and the steps they take (each a scheduler round trip); the test's
    own HTTP client runs in the same Trio run, so only the server's tasks count."""

    def __init__(self) -> None:
        self.spawned = 0
        self.steps = 0

    @staticmethod
    def _ours(task: trio.lowlevel.Task) -> bool:
        return task.name.startswith(("hypercorn.", "oubliette_server."))

    def task_spawned(self, task: trio.lowlevel.Task) -> None:
        """One more task, if the server's."""
        self.spawned += self._ours(task)

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        """One more step, if of a server task."""
        self.steps += self._ours(task)


async def test_a_fast_path_answer_starts_no_task_beside_the_request_and_takes_few_scheduler_round_trips(
    deployment: Deployment,
) -> None:
    """A `session_events` read and a `caller_tool_response` without `wait`, answered on a kept
    connection, start no task beside the connection's task of the request (`HTTP11Connection`): the
    call runs in the request's task, and the watch for the client leaving, with the keepalive pings,
    is the connection's one other task (`ConnectionWatch`, also its keep-alive timer); and they take
    few steps: h11 runs under the connection's task, the write lock is taken in the step that asks
    (`QuickLock`), and a write the socket takes at once is no round trip. Before: a task for the call and one for the watch, a keep-alive
    task started each time the connection went idle, and 15 or more steps a request."""
    with fast_path_log() as taken:
        async with deployment.embedded_http_server("box1") as server, server.rest() as http:
            caller = RawModernCaller(http, "s1")
            await caller.call("declare", 1, "session_message", {
                "instance": "box1", "session_id": "s1", "message": "hi", "context": {"caller_id": "app", "caller_tools": [ECHO]}})
            await caller.call("read at once", 2, "session_events", {"session_id": "s1"})
            counted = _ServerTasks()
            trio.lowlevel.add_instrument(counted)
            try:
                for n in range(10):
                    await caller.call("read at once", 3 + 2 * n, "session_events", {"session_id": "s1"})
                    answer = await caller.call("an answer to no request", 4 + 2 * n, "caller_tool_response", {
                        "session_id": "s1", "request_id": "ctr-0000", "result": {}})
                    assert answer["isError"] is True, answer
            finally:
                trio.lowlevel.remove_instrument(counted)
    assert sum("taken off the SDK's path" in line for line in taken) == 21, taken
    # 20 requests: 20 tasks and 64-69 steps here (each connection h11 under its own task); 160-162 with
    # hypercorn's connection; 40 and 226-237 with a task of the request's own for the watch (253 when
    # each write was a round trip); 61 and 313 with hypercorn's keep-alive task, 81 and 348 with a
    # task for the call and one for the watch, 71 and 439 with trio's locks as well.
    assert counted.spawned <= 20, counted.spawned
    assert counted.steps <= 4 * 20, counted.steps


async def test_a_fast_path_request_reads_its_headers_in_one_pass(
    deployment: Deployment, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The fast path decodes a request's header lines once for the SDK's checks (content type, host,
    origin, accept, the duplicate routing headers, the classifier's map), instead of asking a
    Starlette `Headers` for each name, a scan of every line each: fifteen a request before."""
    from starlette.datastructures import Headers

    scans = 0
    lookup = Headers.__getitem__

    def counted(self: Headers, key: str) -> str:
        nonlocal scans
        scans += 1
        return lookup(self, key)

    with fast_path_log() as taken:
        async with deployment.embedded_http_server("box1") as server, server.rest() as http:
            caller = RawModernCaller(http, "s1")
            await caller.call("declare", 1, "session_message", {
                "instance": "box1", "session_id": "s1", "message": "hi", "context": {"caller_id": "app", "caller_tools": [ECHO]}})
            monkeypatch.setattr(Headers, "__getitem__", counted)
            for n in range(5):
                await caller.call("read at once", 2 + n, "session_events", {"session_id": "s1"})
    assert sum("taken off the SDK's path" in line for line in taken) == 5, taken
    assert scans == 0, scans


async def test_an_answer_with_wait_runs_its_call_in_the_request_task(deployment: Deployment) -> None:
    """A `caller_tool_response` with `wait` woken by the agent's next request (the loop of a model
    caller, answered as JSON on a kept connection) runs its call in the connection's task of the request,
    watched for the client leaving and pinged by the connection's task (`ConnectionWatch`); its
    events would be written by the task that sends them. Before: a task for the call and one for
    the watch, the request's task reading the call's events from a memory stream; then a task of the
    request's own for the watch: one task and a few steps more per answer."""
    answers = 6
    with fast_path_log() as taken:
        async with deployment.embedded_http_server("box1") as server, server.rest() as http:
            caller = RawModernCaller(http, "s1")
            after = await declare_echo(caller)
            async with deployment.agent("box1", "mcp:s1") as agent, trio.open_nursery() as nursery:

                async def agent_calls() -> None:
                    for n in range(answers + 1):
                        await agent.call_tool("app_echo", {"text": str(n)})

                nursery.start_soon(agent_calls)
                request_id = (await caller.poll("the first request", after, 20_000))[0]["payload"]["request_id"]
                counted = _ServerTasks()
                trio.lowlevel.add_instrument(counted)
                try:
                    for n in range(answers):
                        answer = await caller.call("answer, wait woken by the next request", 10 + n, "caller_tool_response", {
                            "session_id": "s1", "request_id": request_id, "result": {"echo": str(n)}, "wait": 20})
                        assert isinstance(answer, dict), answer  # JSON
                        stop = answer["structuredContent"]
                        assert stop["stop_reason"] == "requires_action", stop
                        request_id = stop["pending"][0]["request_id"]
                finally:
                    trio.lowlevel.remove_instrument(counted)
                await caller.call("the last answer", 99, "caller_tool_response", {
                    "session_id": "s1", "request_id": request_id, "result": {}})
    assert sum("taken off the SDK's path" in line for line in taken) >= answers + 1, taken
    # 6 answers: 18 tasks and 74-77 steps here (each connection h11 under its own task); 110-111 with
    # hypercorn's connection; 24 and 126-129 with a watch task of the request's own, 30 and 145-148
    # with the call in a task of its own too. Three tasks an answer: the request's, the turn wait's
    # race (turn end, approval).
    assert counted.spawned <= 3 * answers, counted.spawned
    assert counted.steps <= 14 * answers, counted.steps
