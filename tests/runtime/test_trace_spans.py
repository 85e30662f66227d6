"""One trace across the sandbox boundary (docs/OBSERVABILITY.md, "Traces: one call across the
boundary"): the real programs — the server serving an SDK caller on stdio, the agent's
oubliette-client under the SDK's MCP client, a guest runtime — export their spans over OTLP/HTTP
to a receiver on loopback (tests/runtime/test_telemetry.py), and the caller sees the trace where it acts."""

from __future__ import annotations

import json
import os
import sys
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, AsyncIterator

import pytest
import trio
from mcp import Client
from mcp.client.stdio import StdioServerParameters
from client_calls import NOTIFY, declare, respond
from otel_env import _env_without_otel

from harness import PYTHON, Deployment, EventLog, structured, text_of
from otlp_sink import OtlpReceiver

from oubliette_runtime.trace_spans import traced_relay_handler
from protocol import parse_params

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_SPAN = "00f067aa0ba902b7"
PARENT = f"00-{TRACE_ID}-{PARENT_SPAN}-01"
BOUND = 60.0


class _Exports(list):  # type: ignore[type-arg]
    """The receiver's decoded exports; `arrived` is set by each one."""

    def __init__(self) -> None:
        super().__init__()
        self.arrived = trio.Event()

    def append(self, item: Any) -> None:
        super().append(item)
        self.arrived.set()
        self.arrived = trio.Event()


class WatchedReceiver(OtlpReceiver):
    """The OTLP receiver, with a wait for the spans a test expects."""

    def __init__(self) -> None:
        super().__init__()
        self.exports = _Exports()

    async def wait_for_count(self, counts: dict[str, int], *names: str) -> dict[str, list[Any]]:
        """Wait until each service has exported `counts[service]` spans named one of `names`; return every span by service."""
        while True:
            spans = self.spans_by_service()
            if all(sum(span.name in names for span in spans.get(service, [])) >= count for service, count in counts.items()):
                return spans
            await self.exports.arrived.wait()

    async def wait_for(self, names: dict[str, set[str]]) -> dict[str, list[Any]]:
        """Wait until each service has exported spans of these names; return every span by service."""
        while True:
            spans = self.spans_by_service()
            if all(wanted <= {span.name for span in spans.get(service, [])} for service, wanted in names.items()):
                return spans
            await self.exports.arrived.wait()


def _otel(endpoint: str, service: str) -> dict[str, str]:
    return {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
            "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_SERVICE_NAME": service}


def _server(deployment: Deployment, env: dict[str, str]) -> StdioServerParameters:
    return StdioServerParameters(
        command=PYTHON, env=env,
        args=["-m", "oubliette_server", "--relay", deployment.relay, "--data-dir", str(deployment.data_dir),
              "--log-level", "WARNING"],
    )


def _ids(traceparent: str) -> tuple[str, str]:
    """(trace id, span id) of a `traceparent`."""
    _version, trace_id, span_id, _flags = traceparent.split("-")
    return trace_id, span_id


async def test_one_trace_from_the_agents_call_to_the_callers_pending_entry(deployment: Deployment) -> None:
    """The agent's `tools/call` with `_meta.traceparent` → the client's span → the relay request's
    `_meta` → the server's span → the `caller_tool_request` event and the `requires_action`
    pending entry carry the server's span as `_meta.traceparent`: one trace id all the way. One
    span per program per hop: the relay request carries the client's `tools/call` span itself.
    A call without the agent's context gets the client's `tools/call` span as its root."""
    receiver = WatchedReceiver()
    events = EventLog()
    async with trio.open_nursery() as nursery:
        endpoint = await nursery.start(receiver.serve)
        server = _server(deployment, _env_without_otel(**_otel(endpoint, "oubliette-server"), OTEL_BSP_SCHEDULE_DELAY="50"))
        agent_env = _env_without_otel(**_otel(endpoint, "oubliette-client"), **deployment.client_env("box1", "mcp:s1"),
                                      OTEL_BSP_SCHEDULE_DELAY="50")
        with trio.fail_after(BOUND):
            async with Client(server, mode="legacy", **events.callback_if(True)) as caller:
                await declare(caller, "box1", "s1", [NOTIFY])
                async with Client(StdioServerParameters(command=PYTHON, args=["-m", "oubliette_client"], env=agent_env),
                                  mode="legacy") as agent:
                    outcome: dict[str, Any] = {}

                    async def agent_call() -> None:
                        outcome["result"] = await agent.call_tool(
                            "myapp_send_notification", {"message": "hi"},
                            meta={"traceparent": PARENT, "tracestate": "vendor=abc"})

                    async with trio.open_nursery() as calls:
                        calls.start_soon(agent_call)
                        request = await events.wait_type("caller_tool_request")
                        waited = structured(await caller.call_tool(
                            "session_message", {"session_id": "s1", "instance": "box1", "message": "busy?", "wait": 0.1}))
                        assert waited["stop_reason"] == "requires_action", waited
                        [entry] = waited["pending"]
                        answered = await respond(caller, "s1", request["request_id"], result={"sent": True})
                        assert not answered.is_error, text_of(answered)
                    assert not outcome["result"].is_error, text_of(outcome["result"])

                    async def untraced_call() -> None:
                        outcome["untraced"] = await agent.call_tool("myapp_send_notification", {"message": "no context"})

                    async with trio.open_nursery() as calls:
                        calls.start_soon(untraced_call)
                        root_request = await events.wait_type("caller_tool_request", arguments={"message": "no context"})
                        answered = await respond(caller, "s1", root_request["request_id"], result={"sent": True})
                        assert not answered.is_error, text_of(answered)
                    assert not outcome["untraced"].is_error, text_of(outcome["untraced"])
                    spans = await receiver.wait_for_count({"oubliette-client": 2, "oubliette-server": 2},
                                                          "tools/call myapp_send_notification", "tools/call send_notification")
        nursery.cancel_scope.cancel()

    # What the caller sees: the server's span, in the agent's trace, with the agent's tracestate.
    assert entry["_meta"] == request["_meta"], (entry, request)
    seen_trace, seen_span = _ids(entry["_meta"]["traceparent"])
    assert seen_trace == TRACE_ID and entry["_meta"]["tracestate"] == "vendor=abc"

    client = {span.trace_id.hex(): span for span in spans["oubliette-client"] if span.name.startswith("tools/call")}
    server = {span.trace_id.hex(): span for span in spans["oubliette-server"] if span.name == "tools/call send_notification"}
    mcp_span, server_span = client[TRACE_ID], server[TRACE_ID]
    # agent → the client's tools/call span → (the relay request's _meta) → the server's span, the one the caller saw
    assert mcp_span.parent_span_id.hex() == PARENT_SPAN
    assert server_span.parent_span_id == mcp_span.span_id
    assert server_span.span_id.hex() == seen_span
    attributes = {kv.key: kv.value.string_value for kv in server_span.attributes}
    assert attributes["mcp.method.name"] == "tools/call" and attributes["gen_ai.tool.name"] == "send_notification"
    assert attributes["mcp.session.id"] == "mcp:s1" and attributes["oubliette.relay.method"] == "caller_tool"
    assert server_span.kind == server_span.SPAN_KIND_SERVER and mcp_span.kind == mcp_span.SPAN_KIND_SERVER
    # The client's span, made by the MCP SDK or by the fast path in its stead: the MCP conventions' attributes.
    client_attributes = {kv.key: kv.value.string_value for kv in mcp_span.attributes}
    assert {key: client_attributes.get(key) for key in ("mcp.method.name", "gen_ai.tool.name", "gen_ai.operation.name")} == {
        "mcp.method.name": "tools/call", "gen_ai.tool.name": "myapp_send_notification", "gen_ai.operation.name": "execute_tool"}
    assert client_attributes.get("jsonrpc.request.id"), client_attributes

    # No context from the agent: the client's tools/call span is the root, the server's span its child.
    root_trace, root_parent = _ids(root_request["_meta"]["traceparent"])
    root, root_server_span = client[root_trace], server[root_trace]
    assert root_trace != TRACE_ID and not root.parent_span_id
    assert root_server_span.parent_span_id == root.span_id and root_server_span.span_id.hex() == root_parent
    # One span per program per hop: in each call's trace the client made its `tools/call` span only.
    for trace_id in (TRACE_ID, root_trace):
        assert [span.name for span in spans["oubliette-client"] if span.trace_id.hex() == trace_id] == [
            "tools/call myapp_send_notification"]


DELETE = {"name": "delete_file", "description": "Delete a file on the host", "requires_approval": True,
          "inputSchema": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}


async def test_an_approval_carries_the_trace_and_its_wait_is_a_span(deployment: Deployment) -> None:
    """The agent's gated `tools/call` with `_meta.traceparent` → the server's span of the call →
    its `approval wait` span, open until the decision: the `approval_request` event and the
    `requires_approval` pending entry carry that span as `_meta.traceparent` (with the agent's
    `tracestate`); the caller's `approval_response` sent with it nests under the wait, and the
    approved call's `caller_tool_request` carries the call's span again. One trace id throughout."""
    receiver = WatchedReceiver()
    events = EventLog()
    async with trio.open_nursery() as nursery:
        endpoint = await nursery.start(receiver.serve)
        server = _server(deployment, _env_without_otel(**_otel(endpoint, "oubliette-server"), OTEL_BSP_SCHEDULE_DELAY="50"))
        agent_env = _env_without_otel(**deployment.client_env("box1", "mcp:s1"))
        with trio.fail_after(BOUND):
            async with Client(server, mode="legacy", **events.callback_if(True)) as caller:
                await declare(caller, "box1", "s1", [DELETE])
                async with Client(StdioServerParameters(command=PYTHON, args=["-m", "oubliette_client"], env=agent_env),
                                  mode="legacy") as agent:
                    outcome: dict[str, Any] = {}

                    async def agent_call() -> None:
                        outcome["result"] = await agent.call_tool(
                            "myapp_delete_file", {"path": "/tmp/x"},
                            meta={"traceparent": PARENT, "tracestate": "vendor=abc"})

                    turn: dict[str, Any] = {}
                    stopped = trio.Event()

                    async def send_and_wait() -> None:
                        turn["stop"] = await caller.call_tool(
                            "session_message", {"session_id": "s1", "instance": "box1", "message": "delete", "wait": True})
                        stopped.set()

                    async with trio.open_nursery() as calls:
                        calls.start_soon(send_and_wait)
                        await events.wait_type("user.message", text="delete")
                        calls.start_soon(agent_call)
                        asked = await events.wait_type("approval_request")
                        await stopped.wait()
                        assert not turn["stop"].is_error, text_of(turn["stop"])
                        waited = structured(turn["stop"])
                        assert waited["stop_reason"] == "requires_approval", waited
                        [entry] = waited["pending"]
                        decided = await caller.call_tool(
                            "approval_response", {"session_id": "s1", "request_id": asked["request_id"], "approve": True},
                            meta=entry["_meta"])
                        assert not decided.is_error, text_of(decided)
                        request = await events.wait_type("caller_tool_request")
                        answered = await respond(caller, "s1", request["request_id"], result={"deleted": True})
                        assert not answered.is_error, text_of(answered)
                    assert not outcome["result"].is_error, text_of(outcome["result"])
                    spans = await receiver.wait_for({"oubliette-server": {
                        "tools/call delete_file", "approval wait", "tools/call approval_response"}})
        nursery.cancel_scope.cancel()

    assert entry["kind"] == "approval" and entry["_meta"] == asked["_meta"] == waited["approval_requests"][0]["_meta"]
    seen_trace, seen_span = _ids(entry["_meta"]["traceparent"])
    assert seen_trace == TRACE_ID and entry["_meta"]["tracestate"] == "vendor=abc"
    server = {span.name: span for span in spans["oubliette-server"]}
    call, wait, decision = server["tools/call delete_file"], server["approval wait"], server["tools/call approval_response"]
    for span in (call, wait, decision):
        assert span.trace_id.hex() == TRACE_ID, span.name
    assert wait.parent_span_id == call.span_id and wait.span_id.hex() == seen_span
    assert decision.parent_span_id == wait.span_id, "the caller's decision joins the wait"
    assert wait.start_time_unix_nano <= decision.start_time_unix_nano <= wait.end_time_unix_nano <= call.end_time_unix_nano
    attributes = {kv.key: kv.value.string_value for kv in wait.attributes}
    assert attributes == {"gen_ai.tool.name": "myapp_delete_file", "oubliette.approval.request_id": asked["request_id"],
                          "oubliette.approval.decision": "approved"}
    assert wait.kind == wait.SPAN_KIND_INTERNAL
    # approved: the call goes on to the caller under the call's own span
    assert _ids(request["_meta"]["traceparent"]) == (TRACE_ID, call.span_id.hex())


async def test_an_approval_hands_on_the_agents_trace_without_tracing(deployment: Deployment) -> None:
    """No SDK in the server: no span is recorded, but the `approval_request` frame and the pending
    entry carry the agent's own context, as a caller tool request does."""
    from approval_calls import gated_session
    from in_process_calls import in_process

    with trio.fail_after(BOUND):
        async with in_process(deployment) as proc, trio.open_nursery() as nursery:
            owner, events, link = await gated_session(proc, deployment, [DELETE])
            nursery.start_soon(lambda: link.request("caller_tool", {
                "tool": "delete_file", "arguments": {"path": "/tmp/x"}, "_meta": {"traceparent": PARENT}}))
            asked = await events.wait_type("approval_request")
            [entry] = proc.server.approvals.pending_for(next(iter(proc.server.sessions.all())))
            nursery.cancel_scope.cancel()
    assert asked["_meta"] == {"traceparent": PARENT} and entry.summary()["_meta"] == {"traceparent": PARENT}


AGENT_WRITES_ENV = """
import json, os, sys
sys.stdin.read()
with open(sys.argv[1], "w") as out:
    json.dump({name: os.environ.get(name) for name in ("TRACEPARENT", "TRACESTATE")}, out)
print("env written")
"""


@pytest.mark.parametrize(("server_tracing", "meta"), [
    ("off", {"traceparent": PARENT, "tracestate": "vendor=abc"}),
    ("on", {"traceparent": PARENT, "tracestate": "vendor=abc"}),
    ("off", {"traceparent": "00-not-a-traceparent-01"}),
    ("on", {"traceparent": ["not", "a", "string"]}),
    ("off", {"traceparent": PARENT, "tracestate": "vendor=abc", "baggage": 3}),  # the SDK's own extract
    ("on", {"traceparent": PARENT, "tracestate": "vendor=abc", "baggage": {"not": "a string"}}),
])
async def test_a_callers_traceparent_reaches_the_agent_command(
    deployment: Deployment, tmp_path: Path, server_tracing: str, meta: dict[str, Any],
) -> None:
    """The caller's `session_message` with `_meta.traceparent` → the `user.message` frame → the
    guest runtime starts the agent command with `TRACEPARENT` / `TRACESTATE`: the caller's own
    (the server passes it on without tracing) or the server's span of the message, in the
    caller's trace. An invalid one is ignored: the turn runs, under the server's own root span
    when it traces, else with no `TRACEPARENT`; so is a `baggage` that is not a string (the MCP
    SDK's extraction of `_meta` raised on it), the rest of the context kept."""
    receiver = WatchedReceiver()
    written = tmp_path / "env.json"
    async with trio.open_nursery() as nursery:
        endpoint = await nursery.start(receiver.serve)
        otel = {**_otel(endpoint, "oubliette-server"), "OTEL_BSP_SCHEDULE_DELAY": "50"} if server_tracing == "on" else {}
        with trio.fail_after(BOUND):
            async with Client(_server(deployment, _env_without_otel(**otel)), mode="legacy") as caller, \
                    deployment.guest("box1", [sys.executable, "-c", AGENT_WRITES_ENV, str(written)]):
                done = await caller.call_tool(
                    "session_message", {"instance": "box1", "session_id": "s1", "message": "go", "wait": True},
                    meta=meta)
                stop = structured(done)
                assert stop["stop_reason"] == "end_turn" and "env written" in stop["text"], stop
            if server_tracing == "on":
                spans = await receiver.wait_for({"oubliette-server": {"tools/call session_message"}})
                [message_span] = [span for span in spans["oubliette-server"] if span.name == "tools/call session_message"]
        nursery.cancel_scope.cancel()
    env = json.loads(written.read_text())
    if server_tracing == "on":  # the agent command's TRACEPARENT is the server's exported span of the message
        assert _ids(env["TRACEPARENT"]) == (message_span.trace_id.hex(), message_span.span_id.hex())
    if not isinstance(meta["traceparent"], str) or "not-a" in meta["traceparent"]:
        if server_tracing == "off":
            assert env == {"TRACEPARENT": None, "TRACESTATE": None}
        else:  # ignored: the server's span of the message is a root of its own, and that is handed on
            assert _ids(env["TRACEPARENT"])[0] != TRACE_ID and env["TRACESTATE"] is None
            assert not message_span.parent_span_id
    elif server_tracing == "off":
        assert env == {"TRACEPARENT": PARENT, "TRACESTATE": "vendor=abc"}
    else:
        trace_id, span_id = _ids(env["TRACEPARENT"])
        assert trace_id == TRACE_ID and span_id != PARENT_SPAN and env["TRACESTATE"] == "vendor=abc"
        assert message_span.parent_span_id.hex() == PARENT_SPAN, "the server's span is the caller's span's child"


AGENT_EXITS_AS_TOLD = """
import json, os, sys
code = int(sys.stdin.read().strip())
with open(sys.argv[1], "a") as out:
    out.write(json.dumps({name: os.environ.get(name) for name in ("TRACEPARENT", "TRACESTATE", "OUBLIETTE_MSG_ID")}) + "\\n")
print("env written")
sys.exit(code)
"""


def _attributes(span: Any) -> dict[str, Any]:
    """An OTLP span's attributes as Python values (strings and integers)."""
    return {kv.key: getattr(kv.value, kv.value.WhichOneof("value")) for kv in span.attributes}


async def test_the_guest_runtime_makes_a_span_of_each_turn(deployment: Deployment, tmp_path: Path) -> None:
    """With the guest runtime exporting too, each turn is its span (`process user.message`, kind
    CONSUMER, service `oubliette-guest`) under the server's span of the caller's `session_message`,
    in the caller's trace; the agent command's `TRACEPARENT` names it, so the agent's spans nest
    under the turn. A command that exits 3 makes the span an error with `process.exit.code` 3."""
    from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status

    receiver = WatchedReceiver()
    written = tmp_path / "env.jsonl"
    async with trio.open_nursery() as nursery:
        endpoint = await nursery.start(receiver.serve)
        server = _server(deployment, _env_without_otel(**_otel(endpoint, "oubliette-server"), OTEL_BSP_SCHEDULE_DELAY="50"))
        guest_env = _env_without_otel(**_otel(endpoint, "oubliette-guest"), OTEL_BSP_SCHEDULE_DELAY="50")
        with trio.fail_after(BOUND):
            async with Client(server, mode="legacy") as caller, \
                    deployment.guest("box1", [sys.executable, "-c", AGENT_EXITS_AS_TOLD, str(written)], env=guest_env):
                stops = []
                for code in ("0", "3"):
                    done = await caller.call_tool(
                        "session_message", {"instance": "box1", "session_id": "s1", "message": code, "wait": True},
                        meta={"traceparent": PARENT, "tracestate": "vendor=abc"})
                    stops.append(structured(done)["stop_reason"])
                assert stops == ["end_turn", "error"], stops
                spans = await receiver.wait_for_count(
                    {"oubliette-server": 2, "oubliette-guest": 2}, "tools/call session_message", "process user.message")
        nursery.cancel_scope.cancel()
    messages = sorted((span for span in spans["oubliette-server"] if span.name == "tools/call session_message"),
                      key=lambda span: span.start_time_unix_nano)
    turns = sorted((span for span in spans["oubliette-guest"] if span.name == "process user.message"),
                   key=lambda span: span.start_time_unix_nano)
    envs = [json.loads(line) for line in written.read_text().splitlines()]
    for message, turn, env in zip(messages, turns, envs, strict=True):
        assert turn.kind == Span.SPAN_KIND_CONSUMER
        assert turn.trace_id.hex() == message.trace_id.hex() == TRACE_ID
        assert turn.parent_span_id == message.span_id, "the turn is the child of the server's span of the message"
        assert _ids(env["TRACEPARENT"]) == (TRACE_ID, turn.span_id.hex()) and env["TRACESTATE"] == "vendor=abc"
        attributes = _attributes(turn)
        assert {key: attributes[key] for key in ("mcp.session.id", "oubliette.instance", "oubliette.msg_id")} == {
            "mcp.session.id": "mcp:s1", "oubliette.instance": "box1", "oubliette.msg_id": env["OUBLIETTE_MSG_ID"]}
    ok, failed = turns
    assert _attributes(ok)["process.exit.code"] == 0 and "error.type" not in _attributes(ok)
    assert ok.status.code != Status.STATUS_CODE_ERROR
    assert _attributes(failed)["process.exit.code"] == 3 and _attributes(failed)["error.type"] == "3"
    assert failed.status.code == Status.STATUS_CODE_ERROR


@asynccontextmanager
async def toolset_agent(deployment: Deployment, client: Any = None) -> AsyncIterator[Any]:
    """An in-process server with the host toolset `pg` (tests/support/progress_mcp_server.py) allowed to
    box1, and an agent (a real oubliette-client under the SDK's client; `client`: the SDK client's
    transport to it instead of the default) in a session of it."""
    from in_process_calls import INSTANCE, SESSION, in_process

    script = str(Path(__file__).resolve().parents[2] / "tests" / "support" / "progress_mcp_server.py")
    with trio.fail_after(BOUND):
        async with in_process(deployment) as proc:
            await proc.server.register_mcp_toolset("progress", "pg", sys.executable, [script])
            await proc.server.update_allowed_toolsets(INSTANCE, ["progress"])
            owner, _events = proc.open_caller()
            await proc.declare(owner, [])
            if client is not None:
                async with Client(client, mode="legacy") as agent:
                    yield agent
            else:
                async with deployment.agent(INSTANCE, f"mcp:{SESSION}") as agent:
                    yield agent


async def test_the_client_imports_no_sdk_without_an_otel_variable(deployment: Deployment, tmp_path: Path) -> None:
    """No `OTEL_*` set: the agent's oubliette-client relays calls, with and without the agent's
    trace context, and never loads an OpenTelemetry SDK or exporter module (the server's own check
    is tests/runtime/test_telemetry.py's)."""
    from mcp.client.stdio import stdio_client
    from in_process_calls import INSTANCE, SESSION
    from otel_env import CLIENT_MAIN, PROBE

    errlog = tmp_path / "client.stderr"
    params = StdioServerParameters(command=PYTHON, args=["-c", PROBE.format(block=False, argv=[], main=CLIENT_MAIN)],
                                   env=_env_without_otel(**deployment.client_env(INSTANCE, f"mcp:{SESSION}")))
    with errlog.open("w") as err:
        async with toolset_agent(deployment, stdio_client(params, errlog=err)) as agent:
            traced = await agent.call_tool("pg.trace_id", {}, meta={"traceparent": PARENT})
            untraced = await agent.call_tool("pg.trace_id", {})
    assert (text_of(traced), text_of(untraced)) == (TRACE_ID, "none")
    assert "MODULES []" in errlog.read_text(), errlog.read_text()


async def test_a_toolset_call_hands_the_trace_to_the_toolsets_mcp_server(deployment: Deployment) -> None:
    """The agent's `tools/call` of a host toolset's tool with `_meta.traceparent` → the client →
    `toolset_call`'s `_meta` → the server (here tracing nothing: it passes the context on) → the
    toolset's MCP server receives the same trace in its `tools/call`'s `_meta`."""
    async with toolset_agent(deployment) as agent:
        traced = await agent.call_tool("pg.trace_id", {}, meta={"traceparent": PARENT})
        untraced = await agent.call_tool("pg.trace_id", {})
        bad_baggage = await agent.call_tool("pg.trace_id", {}, meta={"traceparent": PARENT, "baggage": 3})
    assert text_of(traced) == TRACE_ID, text_of(traced)
    assert text_of(untraced) == "none"
    assert text_of(bad_baggage) == TRACE_ID, "a non-string baggage is ignored (the SDK's path), the trace kept"


async def test_a_traced_toolset_call_hands_the_servers_span_to_the_toolsets_mcp_server(
    deployment: Deployment, recording: Any,
) -> None:
    """The server recording spans: the `toolset_call`'s span (`tools/call pg.trace_parent`, under
    the agent's context) is the parent the toolset's MCP server receives in its `tools/call`'s
    `_meta` (through the SDK's client span, a no-op here), so the toolset's work joins the trace."""
    async with toolset_agent(deployment) as agent:
        traced = await agent.call_tool("pg.trace_parent", {}, meta={"traceparent": PARENT})
    [span] = [span for span in recording.get_finished_spans() if span.name == "tools/call pg.trace_parent"]
    assert format(span.parent.span_id, "016x") == PARENT_SPAN
    assert span.attributes["oubliette.relay.method"] == "toolset_call"
    assert text_of(traced) == f"{TRACE_ID}-{span.context.span_id:016x}", text_of(traced)


def test_the_guest_runtime_hands_its_otel_variables_to_the_agents_client(monkeypatch: pytest.MonkeyPatch) -> None:
    """An MCP client starts its stdio server with a few safe variables and the config's `env`
    only: the per-session MCP config carries the runtime's `OTEL_*` so that the agent's
    `oubliette-client` exports where the runtime does (and nothing else of its environment)."""
    from oubliette_client.mcp_config import mcp_config
    from oubliette_client.settings import RelaySettings

    for name in [name for name in os.environ if name.startswith("OTEL_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318")
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=test")
    monkeypatch.setenv("NOT_OTEL_SECRET", "kept out")
    settings = RelaySettings(relay="unix:/oubliette/relay.sock", instance="box1", token="t0k", request_timeout=300)
    env = mcp_config(settings, "mcp:s1")["mcpServers"]["oubliette"]["env"]
    assert {name: value for name, value in env.items() if not name.startswith("OUBLIETTE_")} == {
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318", "OTEL_RESOURCE_ATTRIBUTES": "deployment.environment=test"}


# -- the server's span of a relay request, alone ---------------------------------------------------


class _Connection:
    session_key = "mcp:s1"
    instance = "box1"


@pytest.mark.parametrize("meta", [None, {"traceparent": "garbage"}, {"traceparent": 7}, {"tracestate": "a=b"}])
async def test_an_invalid_relay_meta_is_ignored_never_an_error(meta: Any) -> None:
    """A client's `_meta` that carries no valid context leaves the request to run as it would."""
    params = parse_params("caller_tool", {"tool": "t", "arguments": {}, **({} if meta is None else {"_meta": meta})})
    seen: list[Any] = []

    async def handler(connection: Any, got: Any) -> str:
        from opentelemetry import trace

        seen.append(trace.get_current_span().get_span_context().is_valid)
        return "ran"

    assert await traced_relay_handler("caller_tool", handler)(_Connection(), params) == "ran"
    assert seen == [False]


async def test_a_relay_meta_passes_through_without_tracing() -> None:
    """No SDK configured: no span is recorded, but the client's context is what the handler sees
    (the caller is handed the agent's trace all the same)."""
    from oubliette_runtime.trace_spans import current_meta

    params = parse_params("toolset_call", {"name": "x.t", "_meta": {"traceparent": PARENT}})

    async def handler(connection: Any, got: Any) -> Any:
        return current_meta()

    assert await traced_relay_handler("toolset_call", handler)(_Connection(), params) == {"traceparent": PARENT}


async def test_the_fast_path_takes_a_call_with_trace_context_and_runs_it_there() -> None:
    """A handshake-era `tools/call` whose `_meta` carries `traceparent`/`tracestate` stays on the
    fast path (oubliette_runtime/fast_tool_calls.py), and its handler runs in that context, as under the
    SDK's span: what the handler relays on carries the agent's trace."""
    from oubliette_runtime.fast_tool_calls import FastToolCalls
    from oubliette_runtime.trace_spans import current_meta

    seen: list[Any] = []
    written: list[str] = []
    answered = trio.Event()

    async def handler(token: Any, progress: Any) -> dict[str, Any]:
        seen.append(current_meta())
        return {"content": [], "isError": False}

    async def write(text: str) -> None:
        written.append(text)
        answered.set()

    fast = FastToolCalls(lambda name, arguments: handler, write)
    line = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {
        "name": "t", "arguments": {}, "_meta": {"progressToken": 3, "traceparent": PARENT, "tracestate": "vendor=abc"}}})

    async def source() -> Any:
        yield line

    with trio.fail_after(BOUND):
        async with trio.open_nursery() as nursery:
            await nursery.start(fast.run)
            assert [passed async for passed in fast.lines(source())] == [], "the SDK does not see it"
            await answered.wait()
            nursery.cancel_scope.cancel()
    assert seen == [{"traceparent": PARENT, "tracestate": "vendor=abc"}]
    assert json.loads(written[0])["id"] == 1


@pytest.fixture
def recording(monkeypatch: pytest.MonkeyPatch) -> Any:
    """This process records spans as if the SDK were set up (into memory; the global provider untouched)."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from oubliette_runtime import telemetry, trace_spans

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(trace_spans, "_tracer", provider.get_tracer("test"))
    monkeypatch.setattr(telemetry, "tracing_configured", lambda: True)
    return exporter


async def test_the_servers_span_of_a_gated_call_and_of_its_approval_wait(recording: Any) -> None:
    """Recording: the relay request's span has the MCP attributes, an error its code; the approval's
    wait is a span under it, open from the request to the decision, the one its `_meta` names,
    marked with the decision by the approvals' `on_decided` hook."""
    from oubliette_runtime.trace_spans import approval_wait_span, record_approval_decision
    from protocol import RelayError, errors

    handed: list[Any] = []

    async def gated(connection: Any, params: Any) -> Any:
        with approval_wait_span("delete_file", "apr-1") as meta:
            handed.append(meta)
            await trio.sleep(0.01)  # the decision takes a while
            record_approval_decision("denied")
        raise RelayError(errors.DENIED, "denied: not now")

    params = parse_params("caller_tool", {"tool": "delete_file", "arguments": {}, "_meta": {"traceparent": PARENT}})
    with pytest.raises(RelayError):
        await traced_relay_handler("caller_tool", gated)(_Connection(), params)
    wait, call = recording.get_finished_spans()
    assert call.name == "tools/call delete_file" and format(call.context.trace_id, "032x") == TRACE_ID
    assert format(call.parent.span_id, "016x") == PARENT_SPAN
    assert dict(call.attributes) == {
        "mcp.method.name": "tools/call", "gen_ai.tool.name": "delete_file", "gen_ai.operation.name": "execute_tool",
        "mcp.session.id": "mcp:s1", "oubliette.relay.method": "caller_tool", "oubliette.instance": "box1",
        "error.type": str(errors.DENIED),
    }
    assert wait.name == "approval wait" and wait.parent.span_id == call.context.span_id
    assert handed == [{"traceparent": f"00-{TRACE_ID}-{wait.context.span_id:016x}-01"}]
    assert dict(wait.attributes) == {"gen_ai.tool.name": "delete_file", "oubliette.approval.request_id": "apr-1",
                                     "oubliette.approval.decision": "denied"}
    assert (wait.end_time - wait.start_time) / 1e9 >= 0.01


async def test_the_servers_span_of_a_call_carries_the_policies_decision(recording: Any) -> None:
    """`PolicyGate.check` runs inside the relay request's span and marks it with the decision."""
    from oubliette_server.features.policy import PolicyGate, PolicyRules, ToolCall
    from protocol import RelayError

    gate = PolicyGate(PolicyRules.load(
        '@id("no-rm") @reason("not here") forbid(principal, action, resource == Oubliette::Tool::"myapp_rm");', "test"))

    async def decided(connection: Any, params: Any) -> Any:
        await gate.check(ToolCall("box1", "mcp:s1", "myapp_rm", "caller", "myapp", {}), None)

    params = parse_params("caller_tool", {"tool": "rm", "arguments": {}, "_meta": {"traceparent": PARENT}})
    with pytest.raises(RelayError):
        await traced_relay_handler("caller_tool", decided)(_Connection(), params)
    [call] = recording.get_finished_spans()
    assert {k: v for k, v in call.attributes.items() if k.startswith("oubliette.policy.")} == {
        "oubliette.policy.effect": "forbid", "oubliette.policy.policies": ("no-rm",), "oubliette.policy.enforced": True}


def test_the_fast_paths_span_is_the_one_the_sdk_makes(recording: Any) -> None:
    """`fast_call_span` (the client's fast `tools/call`, a stdio caller's fast `caller_tool_response`)
    makes the span the MCP SDK would: its name, kind and the MCP conventions' attributes, under the
    call's `_meta.traceparent`; a tool error marks it."""
    from opentelemetry.trace import SpanKind, StatusCode

    from oubliette_runtime.trace_spans import fast_call_span

    with fast_call_span("send_notification", 7, {"traceparent": PARENT}) as ended:
        ended({"content": [], "isError": True})
    [span] = recording.get_finished_spans()
    assert (span.name, span.kind) == ("tools/call send_notification", SpanKind.SERVER)
    assert format(span.context.trace_id, "032x") == TRACE_ID and format(span.parent.span_id, "016x") == PARENT_SPAN
    assert dict(span.attributes) == {
        "mcp.method.name": "tools/call", "jsonrpc.request.id": "7", "gen_ai.operation.name": "execute_tool",
        "gen_ai.tool.name": "send_notification", "error.type": "tool_error"}
    assert span.status.status_code == StatusCode.ERROR


async def test_a_client_span_left_by_an_exception_is_an_error_and_a_cancellation_is_not(recording: Any) -> None:
    """The client's `tools/call` span (the fast path's, which the relay request's `_meta` names)
    marks a call that failed under it as an error (the relay went away under it), with the
    exception's type; a span left by a cancellation is no error."""
    from opentelemetry.trace import StatusCode

    from oubliette_runtime.trace_spans import fast_call_span

    with pytest.raises(ConnectionResetError):
        with fast_call_span("send_notification", 1, {}):
            raise ConnectionResetError("the relay went away")
    with trio.CancelScope() as scope:
        with fast_call_span("send_notification", 2, {}):
            scope.cancel()
            await trio.sleep(1)
    failed, cancelled = recording.get_finished_spans()
    assert failed.status.status_code == StatusCode.ERROR and failed.attributes["error.type"] == "ConnectionResetError"
    assert "the relay went away" in (failed.status.description or "")
    assert cancelled.status.status_code == StatusCode.UNSET and "error.type" not in cancelled.attributes


def test_the_turns_span_under_the_messages_context(recording: Any) -> None:
    """`turn_span`: `process user.message`, kind CONSUMER, under the frame's `_meta`, with the
    session, instance and message id; the agent command's `TRACEPARENT` is this span (the
    `tracestate` kept); a command's exit status is `process.exit.code`, a non-zero one an error."""
    from opentelemetry.trace import SpanKind, StatusCode

    from oubliette_runtime.trace_spans import turn_span

    handed = []
    for code in (0, 3):
        with turn_span({"traceparent": PARENT, "tracestate": "vendor=abc"}, "mcp:s1", "box1", f"m{code}") as turn:
            handed.append(turn.environment)
            turn.exited(code)
    ok, failed = recording.get_finished_spans()
    for span, environment, code in ((ok, handed[0], 0), (failed, handed[1], 3)):
        assert (span.name, span.kind) == ("process user.message", SpanKind.CONSUMER)
        assert format(span.context.trace_id, "032x") == TRACE_ID and format(span.parent.span_id, "016x") == PARENT_SPAN
        assert environment == {"TRACEPARENT": f"00-{TRACE_ID}-{span.context.span_id:016x}-01", "TRACESTATE": "vendor=abc"}
        assert {key: span.attributes[key] for key in ("mcp.session.id", "oubliette.instance", "oubliette.msg_id",
                                                      "process.exit.code")} == {
            "mcp.session.id": "mcp:s1", "oubliette.instance": "box1", "oubliette.msg_id": f"m{code}", "process.exit.code": code}
    assert ok.status.status_code == StatusCode.UNSET and "error.type" not in ok.attributes
    assert failed.status.status_code == StatusCode.ERROR and failed.attributes["error.type"] == "3"


@pytest.mark.parametrize("meta", [None, {}, {"traceparent": "00-not-a-traceparent-01"}, {"traceparent": 7}, "text"])
def test_a_turn_without_a_valid_context_is_a_root_and_its_failure_an_error(recording: Any, meta: Any) -> None:
    """No `_meta`, or an invalid one: the turn's span is a root of its own (never an error), and
    the agent command gets it; a turn that failed without an exit status says how."""
    from opentelemetry.trace import StatusCode

    from oubliette_runtime.trace_spans import turn_span

    with turn_span(meta, "mcp:s1", "box1", "m1") as turn:
        turn.failed("timeout", "the agent command did not finish")
    [span] = recording.get_finished_spans()
    assert span.parent is None and format(span.context.trace_id, "032x") != TRACE_ID
    assert turn.environment == {"TRACEPARENT": f"00-{span.context.trace_id:032x}-{span.context.span_id:016x}-{span.context.trace_flags:02x}"}
    assert span.status.status_code == StatusCode.ERROR and span.attributes["error.type"] == "timeout"
    assert "process.exit.code" not in span.attributes


def test_without_tracing_a_turn_hands_on_the_messages_context_and_makes_no_span() -> None:
    """Tracing off in the guest runtime: no span, the frame's context handed on as it came."""
    from oubliette_runtime.trace_spans import turn_span

    with turn_span({"traceparent": PARENT, "tracestate": "vendor=abc"}, "mcp:s1", "box1", "m1") as turn:
        turn.exited(3)  # nothing to mark
    assert turn.environment == {"TRACEPARENT": PARENT, "TRACESTATE": "vendor=abc"}
    with turn_span(None, "mcp:s1", "box1", "m2") as turn:
        pass
    assert turn.environment == {}


@pytest.mark.parametrize(("command", "timeout", "outcome"), [
    (["sh", "-c", "exit 3"], 30.0, ("3", 3)),
    (["sh", "-c", "sleep 30"], 0.3, ("timeout", None)),
    (["/nonexistent/agent-command"], 30.0, ("start_failed", None)),
])
async def test_the_guest_runtimes_turn_is_one_span_with_its_outcome(
    recording: Any, command: list[str], timeout: float, outcome: tuple[str, int | None],
) -> None:
    """The guest runtime alone (a fake relay link): its turn's span covers the whole turn, from
    before the `thinking` status to after the turn's last frame, and says how the turn failed
    (`error.type`: the exit status, `timeout`, `start_failed`; `process.exit.code` when it exited)."""
    import time

    from opentelemetry.trace import StatusCode
    from recording_peer import RecordingPeer

    from oubliette_client.guest import GuestRuntime
    from oubliette_client.settings import RelaySettings
    from protocol import Frame, SessionRef

    runtime = GuestRuntime(RelaySettings(relay="unix:/nonexistent/relay.sock", instance="box1", token="t"), command,
                           turn_timeout=timeout)
    peer = RecordingPeer(runtime.link, frozenset())
    peer.connect()
    appended: list[tuple[int, str]] = []
    record = peer.request

    async def request(method: str, params: Any, timeout: float) -> Any:
        appended.append((time.time_ns(), params["type"]))
        return await record(method, params, timeout)

    peer.request = request  # type: ignore[method-assign]
    message = Frame(v=1, seq=3, ts="2026-11-22T10:00:00.123Z", instance="box1", session=SessionRef(channel="mcp", id="s1"),
                    type="user.message", msg_id="m-1", payload={"text": "hi", "_meta": {"traceparent": PARENT}})
    with trio.fail_after(BOUND):
        await runtime._run_turn("mcp:s1", message)
    [span] = recording.get_finished_spans()
    assert span.name == "process user.message" and format(span.parent.span_id, "016x") == PARENT_SPAN
    assert [kind for _, kind in appended] == ["status.presence", "session.error"]
    assert span.start_time <= appended[0][0] and span.end_time >= appended[-1][0]
    assert span.status.status_code == StatusCode.ERROR
    assert (span.attributes["error.type"], span.attributes.get("process.exit.code")) == outcome
