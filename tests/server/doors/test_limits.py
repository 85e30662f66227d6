"""Limits and fault isolation: nothing a caller or a sandbox sends may crash, wedge or lose.

1. A payload nested 256+ levels deep once killed the server (the caller event sender raised in
   the server's root nursery); now every ingress refuses it, and a failing sender closes only
   its caller.
2. A `user.message` too large to deliver was stored and redelivered forever; now it is refused
   before it is stored, and delivery skips (with `session.error`) anything undeliverable.
3. A `caller_tool_response` result too large for the agent's relay line closed the agent's
   connection; now it is refused and the call stays pending.

The issue's reproductions run against the real programs (stdio caller, HTTP server,
oubliette-client); the rest runs in process (the embedded-server pattern of
tests/server/features/test_caller_tool_answers.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import trio

from harness import EVENT_TIMEOUT, Deployment, EventLog, RawRelay, structured, text_of
from oubliette_server.core.callers import CallerConnection, RequestScopedSink
from oubliette_server.program.config import ServerConfig, load_config_file
from protocol import errors, framing
from protocol.errors import RelayError
from protocol.limits import (
    DEFAULT_MAX_DEPTH,
    DEFAULT_MAX_FRAME_BYTES,
    DEFAULT_MAX_PAYLOAD_BYTES,
    LimitExceeded,
    Limits,
)
from in_process_calls import (
    NOTIFY,
    InProcess,
    agent_call_in_flight,
    declare,
    in_process,
    result_frames,
    start_agent_call,
)
from raw_relay_calls import Env, caller_tool_request, handshake, response_to

INSTANCE = "box1"
SESSION = "s1"
TWO_MIB = "x" * (2 * 1024 * 1024)
CONTROL_CHARS = "\u0001" * 200_000  # 200 kB that escapes to 1.2 MB
DEPTHS = [256, 10_000]


def nest(depth: int) -> Any:
    """A value `depth` lists deep, built without recursion."""
    value: Any = 0
    for _ in range(depth):
        value = [value]
    return value


def deep_json(depth: int) -> str:
    """The JSON text of `nest(depth)`; json.dumps itself cannot write 10,000 levels."""
    return "[" * depth + "0" + "]" * depth


# -- the checker ------------------------------------------------------------------------


def test_the_relay_line_limit_is_the_framing_one() -> None:
    assert DEFAULT_MAX_FRAME_BYTES == framing.MAX_FRAME_BYTES


def test_a_payload_at_the_limit_fits_the_largest_envelope_and_one_more_byte_is_refused() -> None:
    """The budget is honest: the largest value, in the largest envelope with the longest ids, is one relay line."""
    limits = Limits()
    text = "é" * ((DEFAULT_MAX_PAYLOAD_BYTES - 2) // 2)  # 2 UTF-8 bytes each, plus the quotes
    text += "x" * (DEFAULT_MAX_PAYLOAD_BYTES - 2 - len(text.encode()))
    limits.check_value(text, "message")
    frame = {
        "v": 1, "seq": 2**63 - 1, "ts": "2026-11-22T10:00:00.123Z", "instance": "i" * 64,
        "session": {"channel": "c" * 64, "id": "s" * 128}, "type": "caller_tool_request", "msg_id": "m" * 128,
        "reply_to": "r" * 128,
        "payload": {"request_id": "ctr-" + "0" * 16, "tool": "t" * 128, "arguments": text, "caller_id": "c" * 32},
    }
    line = framing.encode({"jsonrpc": "2.0", "method": "user_message", "params": {"frame": frame}})
    assert len(line) - 1 <= DEFAULT_MAX_FRAME_BYTES
    with pytest.raises(LimitExceeded) as refused:
        limits.check_value(text + "x", "message")
    assert refused.value.limit == "max_payload_bytes"


@pytest.mark.parametrize("depth", [65, 256, 100_000])
def test_too_deep_is_refused_without_recursion(depth: int) -> None:
    Limits().check_value(nest(DEFAULT_MAX_DEPTH), "arguments")
    with pytest.raises(LimitExceeded) as refused:
        Limits().check_value(nest(depth), "arguments")
    assert refused.value.limit == "max_payload_depth"
    assert "arguments is nested more than 64 levels deep" in refused.value.message


def test_a_cyclic_value_is_refused() -> None:
    cycle: list[Any] = []
    cycle.append(cycle)
    with pytest.raises(LimitExceeded):
        Limits().check_value(cycle, "result")


@pytest.mark.parametrize("text", [TWO_MIB, CONTROL_CHARS], ids=["2MiB", "200k-U+0001"])
def test_size_is_measured_as_encoded(text: str) -> None:
    with pytest.raises(LimitExceeded) as refused:
        Limits().check_value(text, "message")
    assert refused.value.limit == "max_payload_bytes"
    assert refused.value.data["actual"] == len(framing.encode(text)) - 1


def test_limits_are_settings(tmp_path: Path) -> None:
    config_file = tmp_path / "oubliette.toml"
    config_file.write_text("[server]\nmax_payload_bytes = 65536\nmax_payload_depth = 16\n")
    config = ServerConfig(**load_config_file(config_file))
    assert config.limits == Limits(max_payload_bytes=65536, max_depth=16)
    assert ServerConfig().limits == Limits()
    with pytest.raises(ValueError, match="max_payload_bytes"):
        ServerConfig(max_payload_bytes=2 * 1024 * 1024)
    with pytest.raises(ValueError, match="max_payload_depth"):
        ServerConfig(max_payload_depth=300)


# -- in process: every ingress ----------------------------------------------------------


async def complete_a_call(proc: InProcess, owner: CallerConnection, events: EventLog, link: Any) -> None:
    """A healthy session still completes a relayed call."""
    outcome, finished, _ = start_agent_call(proc.nursery, link)
    request = await events.wait_for(lambda e: e.get("type") == "caller_tool_request" and e["request_id"] in proc.server.calls.pending)
    answer = await proc.call(owner, "caller_tool_response", {
        "session_id": SESSION, "request_id": request["request_id"], "result": {"ok": True},
    })
    assert structured(answer) == {"resolved": True}
    with trio.fail_after(EVENT_TIMEOUT):
        await finished.wait()
    assert outcome["result"] == {"result": {"ok": True}}


@pytest.mark.parametrize("depth", DEPTHS)
async def test_deep_values_are_refused_at_the_caller_tools(deployment: Deployment, depth: int) -> None:
    async with in_process(deployment, instances={INSTANCE: {}}) as proc:
        owner, events = proc.open_caller()
        await proc.declare(owner, [NOTIFY])
        link = await proc.connect_agent(deployment)
        before = await proc.server.store.last_seq(INSTANCE)

        deep_tool = dict(NOTIFY, inputSchema={"type": "object", "properties": {"x": {"default": nest(depth)}}})
        refused = await proc.call(owner, "session_message", {
            "instance": INSTANCE, "session_id": SESSION, "message": "hi",
            "context": {"caller_id": "myapp", "caller_tools": [deep_tool]},
        })
        assert refused.is_error and "context is nested more than 64 levels deep" in text_of(refused), text_of(refused)
        assert await proc.server.store.last_seq(INSTANCE) == before

        outcome, finished, _ = start_agent_call(proc.nursery, link)
        request = await events.wait_type("caller_tool_request")
        refused = await proc.call(owner, "caller_tool_response", {
            "session_id": SESSION, "request_id": request["request_id"], "result": {"deep": nest(depth)},
        })
        assert refused.is_error and "max_payload_depth" in text_of(refused), text_of(refused)
        assert request["request_id"] in proc.server.calls.pending
        assert await proc.call(owner, "caller_tool_response", {
            "session_id": SESSION, "request_id": request["request_id"], "result": "small",
        })
        with trio.fail_after(EVENT_TIMEOUT):
            await finished.wait()
        assert outcome["result"] == {"result": "small"}
        await complete_a_call(proc, owner, events, link)


async def test_deep_values_are_refused_at_the_relay(deployment: Deployment) -> None:
    """caller_tool arguments and append_frame payload: 256 deep gets an error naming the limit,
    10,000 deep is not even JSON the relay parses; the connection or server survives either way."""
    async with in_process(deployment, instances={INSTANCE: {}}) as proc:
        owner, events = proc.open_caller()
        await proc.declare(owner, [NOTIFY])
        link = await proc.connect_agent(deployment)
        token = proc.server.tokens.token_for(INSTANCE)
        before = await proc.server.store.last_seq(INSTANCE)
        async with RawRelay.connect(deployment) as raw:
            _, hello = await handshake(raw, token)
            assert "error" not in hello, hello
            await raw.send(caller_tool_request(7, {"deep": nest(256)}))
            answer = await response_to(raw, 7)
            assert answer["error"]["data"]["limit"] == "max_payload_depth", answer
            assert "caller_tool arguments is nested more than 64" in answer["error"]["message"]
            await raw.send_raw(b'{"jsonrpc":"2.0","id":8,"method":"caller_tool","params":{"tool":"send_notification",'
                               b'"arguments":{"deep":' + deep_json(10_000).encode() + b"}}}\n")
            answer = await raw.receive(EVENT_TIMEOUT)
            assert answer is not None and answer["error"]["code"] == -32700, answer
        async with RawRelay.connect(deployment) as guest:
            hello = await guest.hello(INSTANCE, token, role="guest")
            assert "error" not in hello, hello
            await guest.send({"jsonrpc": "2.0", "id": 1, "method": "append_frame", "params": {
                "session": {"channel": "mcp", "id": SESSION}, "type": "assistant.delta", "payload": {"d": nest(256)},
            }})
            answer = await response_to(guest, 1)
            assert answer["error"]["data"]["limit"] == "max_payload_depth", answer
        assert await proc.server.store.last_seq(INSTANCE) == before
        assert not events.of_type("assistant.delta")
        await complete_a_call(proc, owner, events, link)


async def next_delivery(guest: RawRelay) -> dict[str, Any]:
    while True:
        message = await guest.receive(EVENT_TIMEOUT)
        assert message is not None, "the guest connection closed"
        if message.get("method") == "user_message":
            return message["params"]["frame"]


@pytest.mark.parametrize("text", [TWO_MIB, CONTROL_CHARS], ids=["2MiB", "200k-U+0001"])
async def test_oversized_messages_are_refused_and_nothing_is_stored(deployment: Deployment, text: str) -> None:
    async with in_process(deployment, instances={INSTANCE: {}}) as proc:
        caller, _ = proc.open_caller()
        async with RawRelay.connect(deployment) as guest:
            assert "error" not in await guest.hello(INSTANCE, proc.server.tokens.token_for(INSTANCE), role="guest")
            before = await proc.server.store.last_seq(INSTANCE)
            for tool, args in (
                ("session_message", {"instance": INSTANCE, "session_id": SESSION, "message": text}),
                ("tether_send", {"instance": INSTANCE, "text": text}),
            ):
                refused = await proc.call(caller, tool, args)
                assert refused.is_error, tool
                assert "bytes once encoded; the limit (max_payload_bytes)" in text_of(refused), text_of(refused)
            assert await proc.server.store.last_seq(INSTANCE) == before, "nothing is stored"
            sent = await proc.call(caller, "session_message", {"instance": INSTANCE, "session_id": SESSION, "message": "later"})
            assert not sent.is_error, text_of(sent)
            frame = await next_delivery(guest)
            assert frame["payload"] == {"text": "later"}


async def test_an_undeliverable_result_is_refused_and_the_call_stays_pending(deployment: Deployment) -> None:
    async with in_process(deployment) as proc:
        owner, events = proc.open_caller()
        await proc.declare(owner, [NOTIFY])
        link = await proc.connect_agent(deployment)
        outcome, finished, _ = start_agent_call(proc.nursery, link)
        request = await events.wait_type("caller_tool_request")
        answer = {"session_id": SESSION, "request_id": request["request_id"]}
        for too_big in ({"result": {"blob": TWO_MIB}}, {"error": TWO_MIB}):
            refused = await proc.call(owner, "caller_tool_response", dict(answer, **too_big))
            assert refused.is_error and "max_payload_bytes" in text_of(refused), text_of(refused)
            assert request["request_id"] in proc.server.calls.pending
            assert not finished.is_set()
        good = await proc.call(owner, "caller_tool_response", dict(answer, result={"blob": "small"}))
        assert structured(good) == {"resolved": True}
        with trio.fail_after(EVENT_TIMEOUT):
            await finished.wait()
        assert outcome["result"] == {"result": {"blob": "small"}}
        assert len(await proc_result_frames(proc, request["request_id"])) == 1


async def proc_result_frames(proc: InProcess, request_id: str) -> list[Any]:
    from oubliette_server.store.sqlite import FrameQuery

    frames = await proc.server.store.query(INSTANCE, FrameQuery(types=("caller_tool_result",), limit=100))
    return [f for f in frames if f.payload["request_id"] == request_id]


# -- the last lines: frame log, delivery, senders ---------------------------------------


async def test_the_frame_log_refuses_a_frame_that_could_not_be_delivered(deployment: Deployment) -> None:
    """Even a service that skipped its ingress check cannot store an undeliverable frame."""
    async with in_process(deployment) as proc:
        session = proc.server.sessions.get_or_create(INSTANCE, "mcp", SESSION)
        for payload in ({"text": "x" * (DEFAULT_MAX_FRAME_BYTES - 100)}, {"d": nest(65)}):
            with pytest.raises(LimitExceeded):
                await proc.server.frame_log.append(session, "user.message", payload)
        assert await proc.server.store.last_seq(INSTANCE) == 0


async def test_delivery_skips_an_undeliverable_frame_with_a_session_error(deployment: Deployment) -> None:
    """The safety net: a frame stored past the limits (here, straight into the store) ends its turn, once."""
    async with in_process(deployment, instances={INSTANCE: {}}) as proc:
        caller, events = proc.open_caller()
        store = proc.server.store
        huge = await store.append(INSTANCE, channel="mcp", session_id=SESSION, type="user.message", payload={"text": TWO_MIB})
        small = await store.append(INSTANCE, channel="mcp", session_id=SESSION, type="user.message", payload={"text": "next"})
        token = proc.server.tokens.token_for(INSTANCE)
        for _ in range(2):  # and again on reconnect: the huge frame is not retried
            async with RawRelay.connect(deployment) as guest:
                assert "error" not in await guest.hello(INSTANCE, token, role="guest")
                frame = await next_delivery(guest)
                assert frame["seq"] == small.seq
        from oubliette_server.store.sqlite import FrameQuery

        errors = await store.query(INSTANCE, FrameQuery(types=("session.error",), reply_to=huge.msg_id))
        assert len(errors) == 1
        assert "cannot be delivered to the guest" in errors[0].payload["message"]


class FailingMcpSession:
    """A caller's MCP session whose every send fails (as pydantic did at depth 256)."""

    async def send_notification(self, notification: Any, related_request_id: Any = None) -> None:
        raise ValueError("Maximum serialization depth exceeded")


async def test_a_failing_event_sender_closes_only_its_caller(deployment: Deployment) -> None:
    async with in_process(deployment) as proc:
        broken = proc.server.open_caller("test")
        broken.mcp_session = FailingMcpSession()
        healthy, healthy_events = proc.open_caller()
        await proc.declare(broken, [NOTIFY])
        joined = await proc.call(healthy, "session_message", {"instance": INSTANCE, "session_id": "s-healthy", "message": "me too"})
        assert not joined.is_error, text_of(joined)
        with trio.fail_after(EVENT_TIMEOUT):
            await broken.closed.wait()
        link = await proc.connect_agent(deployment)
        outcome, finished, _ = start_agent_call(proc.nursery, link)
        with trio.fail_after(EVENT_TIMEOUT):
            await finished.wait()
        assert outcome["error"].code == -32002, "the closed caller's calls fail at once"
        # The server and the other caller carry on.
        again = await proc.call(healthy, "session_message", {"instance": INSTANCE, "session_id": "s-healthy", "message": "still here"})
        assert not again.is_error, text_of(again)
        await healthy_events.wait_type("user.message", text="still here")


class CountingMcpSession:
    """A caller's MCP session that records the seq of each event it is asked to send; `fail`: each send fails."""

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.sent: list[int] = []

    async def send_notification(self, notification: Any, related_request_id: Any = None) -> None:
        self.sent.append(notification.params.data["seq"])
        if self.fail:
            raise ValueError("Maximum serialization depth exceeded")


async def test_a_failing_request_scoped_sink_stops_only_its_events() -> None:
    """The failing sink sends nothing after its first failure and ends without raising; a sibling's
    events all go out."""
    failing, healthy = CountingMcpSession(fail=True), CountingMcpSession()
    broken, sibling = RequestScopedSink(failing, request_id=1), RequestScopedSink(healthy, request_id=2)
    with trio.fail_after(EVENT_TIMEOUT):  # a sink that went on after the failure would never end
        async with trio.open_nursery() as nursery:
            nursery.start_soon(broken.run)
            nursery.start_soon(sibling.run)
            for seq in (1, 2, 3):
                broken.push({"type": "assistant.delta", "seq": seq})
                sibling.push({"type": "assistant.delta", "seq": seq})
            sibling.close()
    broken.push({"type": "assistant.delta", "seq": 4})  # after the failure: dropped, no error
    assert failing.sent == [1], "the failing sink stopped at its first failure"
    assert healthy.sent == [1, 2, 3], "the other request's events all went out"


# -- HTTP ingress -----------------------------------------------------------------------


async def test_http_ingress_limits(deployment: Deployment) -> None:
    async with deployment.embedded_http_server(INSTANCE) as server, server.rest() as rest:
        url = f"/v1/instances/{INSTANCE}/tether"
        head = '{"type":"user.message","session":{"channel":"host","id":"s"},"payload":{"text":"x","d":'
        for depth in DEPTHS:
            response = await rest.post(url, content=(head + deep_json(depth) + "}}").encode(),
                                       headers={"Content-Type": "application/json"})
            assert response.status_code == 400, response.text
            assert "max_payload_depth" in response.json()["error"]["message"]
        body = {"type": "user.message", "session": {"channel": "host", "id": "s"}, "payload": {"text": "x" * 1_048_400}}
        assert len(json.dumps(body)) <= 1024 * 1024, "the body passes the 1 MiB body check"
        response = await rest.post(url, json=body)
        assert response.status_code == 413, response.text
        assert "max_payload_bytes" in response.json()["error"]["message"]
        assert await server.app.store.last_seq(INSTANCE) == 0
        response = await rest.post(url, json={"type": "user.message", "session": {"channel": "host", "id": "s"},
                                              "payload": {"text": "fine"}})
        assert response.status_code == 201, response.text


# -- the issue's reproductions, against the real programs ------------------------------


async def test_issue8_item1_deep_arguments_do_not_kill_the_server(deployment: Deployment) -> None:
    async with deployment.caller() as (caller, events):
        await declare(caller)
        async with RawRelay.connect(deployment) as raw:
            _, hello = await handshake(raw, deployment.token(INSTANCE))
            assert "error" not in hello, hello
            for request_id, depth in ((1, 250), (2, 256)):
                await raw.send(caller_tool_request(request_id, {"deep": nest(depth)}))
                answer = await response_to(raw, request_id)
                assert answer["error"]["data"]["limit"] == "max_payload_depth", answer
            await Env(caller, events, "").relay_call(raw, 3, "still alive")


async def test_issue8_item2_oversized_messages_are_refused_not_wedged(deployment: Deployment) -> None:
    async with deployment.caller() as (caller, events):
        await declare(caller)
        async with RawRelay.connect(deployment) as guest:
            assert "error" not in await guest.hello(INSTANCE, deployment.token(INSTANCE), role="guest")
            hi = await next_delivery(guest)
            assert hi["payload"] == {"text": "hi"}
            for tool, args in (
                ("session_message", {"instance": INSTANCE, "session_id": SESSION, "message": TWO_MIB}),
                ("tether_send", {"instance": INSTANCE, "text": CONTROL_CHARS}),
            ):
                refused = await caller.call_tool(tool, args)
                assert refused.is_error and "max_payload_bytes" in text_of(refused), text_of(refused)
            sent = await caller.call_tool("session_message", {"instance": INSTANCE, "session_id": SESSION, "message": "later"})
            assert not sent.is_error, text_of(sent)
            frame = await next_delivery(guest)
            assert frame["payload"] == {"text": "later"}
            assert frame["seq"] == structured(sent)["ingress_seq"] == hi["seq"] + 1, "nothing was stored in between"


async def test_issue8_item3_an_oversized_result_keeps_the_call_pending(deployment: Deployment) -> None:
    async with deployment.caller() as (caller, events):
        await declare(caller)
        async with agent_call_in_flight(deployment, events) as (request, outcome, finished):
            answer = {"session_id": SESSION, "request_id": request["request_id"]}
            refused = await caller.call_tool("caller_tool_response", dict(answer, result={"blob": TWO_MIB}))
            assert refused.is_error and "max_payload_bytes" in text_of(refused), text_of(refused)
            assert await result_frames(caller, request["request_id"]) == []
            good = await caller.call_tool("caller_tool_response", dict(answer, result={"blob": "small"}))
            assert structured(good) == {"resolved": True}
        assert not outcome["result"].is_error, text_of(outcome["result"])
        assert outcome["result"].structured_content == {"blob": "small"}


async def test_issue8_http_ingress_deep_and_oversized_bodies(deployment: Deployment) -> None:
    config = deployment.config_file(INSTANCE)
    async with deployment.http_server("--config", str(config)) as server, server.rest() as rest:
        url = f"/v1/instances/{INSTANCE}/tether"
        deep = {"type": "user.message", "session": {"channel": "host", "id": "s"}, "payload": {"d": nest(256)}}
        assert (await rest.post(url, json=deep)).status_code == 400
        big = {"type": "user.message", "session": {"channel": "host", "id": "s"}, "payload": {"text": "x" * 1_048_400}}
        assert (await rest.post(url, json=big)).status_code == 413
        fine = await rest.post(url, json={"type": "user.message", "session": {"channel": "host", "id": "s"},
                                          "payload": {"text": "fine"}})
        assert fine.status_code == 201, fine.text
        assert fine.json()["ingress_seq"] == 1
        assert server.process.returncode is None


def test_the_documented_defaults_are_the_real_ones() -> None:
    docs = Path(__file__).resolve().parents[3] / "docs"
    assert f"{DEFAULT_MAX_PAYLOAD_BYTES:,}" in (docs / "SECURITY.md").read_text()
    assert f"max_payload_bytes = {DEFAULT_MAX_PAYLOAD_BYTES}" in (docs / "CONFIG.md").read_text()
    assert f"max_payload_depth = {DEFAULT_MAX_DEPTH}" in (docs / "CONFIG.md").read_text()


# -- limits first, at the door ----------------------------------------------------------------


class NoLookups:
    """A door's lookups (sessions, instances), each refused and recorded: a door must refuse a value
    over the limits before it looks anything up (a shared store's lookup queries the database)."""

    def __init__(self) -> None:
        self.looked_up: list[str] = []

    def __getattr__(self, name: str) -> Any:
        def lookup(*args: Any, **kwargs: Any) -> Any:
            self.looked_up.append(name)
            raise RelayError(errors.NOT_FOUND, f"unknown ({name})")
        return lookup


async def test_the_caller_api_checks_limits_before_any_lookup(deployment: Deployment) -> None:
    """An oversized answer for a session that does not exist gets the size refusal, with no lookup made."""
    async with in_process(deployment) as proc:
        caller, _ = proc.open_caller()
        proc.tools.sessions = lookups = NoLookups()  # type: ignore[assignment]
        for tool, args in (
            ("caller_tool_response", {"session_id": "nobody", "request_id": "r1", "result": {"blob": TWO_MIB}}),
            ("approval_response", {"session_id": "nobody", "request_id": "a1", "approve": False, "reason": TWO_MIB}),
            ("session_message", {"instance": INSTANCE, "session_id": "nobody", "message": TWO_MIB}),
        ):
            refused = await proc.call(caller, tool, args)
            assert refused.is_error and "max_payload_bytes" in text_of(refused), (tool, text_of(refused))
        with pytest.raises(LimitExceeded):
            await proc.tools.caller_tool_response_over_http(
                INSTANCE, {"session_id": "nobody", "request_id": "r1", "result": {"blob": TWO_MIB}})
        with pytest.raises(LimitExceeded):
            await proc.tools.approval_response_over_http(
                INSTANCE, {"session_id": "nobody", "request_id": "a1", "approve": False, "reason": TWO_MIB})
        assert lookups.looked_up == []


async def test_the_tether_door_checks_limits_and_grammar_before_the_instance_lookup(deployment: Deployment) -> None:
    async with deployment.embedded_http_server(INSTANCE) as server, server.rest() as rest:
        big = {"type": "user.message", "session": {"channel": "host", "id": "s"}, "payload": {"text": "x" * 1_048_400}}
        response = await rest.post("/v1/instances/nobody/tether", json=big)
        assert response.status_code == 413, response.text  # not 404: the size first
        tether = server.app.tether
        tether.instances = lookups = NoLookups()
        with pytest.raises(LimitExceeded):
            await tether.ingest(INSTANCE, big)
        with pytest.raises(LimitExceeded):
            await tether.send(INSTANCE, TWO_MIB)
        with pytest.raises(RelayError) as bad_session:
            await tether.send(INSTANCE, "hi", session_id="no spaces allowed")
        assert bad_session.value.code == errors.INVALID_PARAMS, bad_session.value.message
        assert lookups.looked_up == []


async def test_the_relay_handler_table_checks_limits_before_its_handler(deployment: Deployment) -> None:
    """`_limited` refuses the oversized field before the handler (and its session lookup) runs."""
    handled: list[Any] = []

    async def handler(connection: Any, params: Any) -> None:
        handled.append(params)

    async with in_process(deployment) as proc:
        checked = proc.server._limited(handler, "append_frame", "payload")
        with pytest.raises(LimitExceeded):
            await checked(None, SimpleNamespace(payload={"text": TWO_MIB}))
        await checked(None, SimpleNamespace(payload={"text": "fine"}))
    assert [params.payload for params in handled] == [{"text": "fine"}]
