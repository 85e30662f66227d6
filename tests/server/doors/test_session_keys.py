"""Session keys at every door, keyed lookups and the bound on sessions held in memory
(docs/SECURITY.md, "Session keys at every door").

A guest's `append_frame` once accepted any non-empty channel and id (500 kB strings, newlines,
NUL, lone surrogates): each made a `Session` the server never forgot, and lookups scanned them
all. Here every door is played with bad keys against one in-process server (relay, HTTP tether,
the caller's MCP tools): each gets -32602 (HTTP 400) with a short message naming the rule, and
nothing is stored or held. Then: lookups do not look at other sessions, however many there are;
idle sessions beyond `max_sessions` are forgotten from memory, still readable from the log, and
made again on use.
"""

from __future__ import annotations

import json
import sys
import urllib.parse
from pathlib import Path
from typing import Any, Callable

import pytest
import trio

from harness import Deployment, RawRelay, structured, text_of
from oubliette_server.program.config import ServerConfig, load_config_file
from oubliette_server.core.sessions import Session, SessionRegistry
from protocol import RelayError, session_keys
from raw_relay_calls import response_to
from hello_checks import hello_error, hello_params
from serving_server import INSTANCE, serving

INVALID_PARAMS, NOT_FOUND = -32602, -32005
BAD_IDS = ["s" * 129, "x" * 500_000, "s\n", "s\x00", "s\ud800", "", "a b", "s-é"]
BAD_CHANNELS = ["c" * 65, "c" * 500_000, "c\n", "c\x00", "c\ud800", "", "c:d"]
LONGEST_MESSAGE = 400  # a refusal names the rule; it never echoes a long key back


def bad_pairs() -> list[tuple[str, str]]:
    """(channel, id) pairs with exactly one bad member."""
    return [("mcp", bad) for bad in BAD_IDS] + [(bad, "s1") for bad in BAD_CHANNELS]


def assert_clear(message: str) -> None:
    assert "invalid" in message and len(message) < LONGEST_MESSAGE, message[:LONGEST_MESSAGE * 2]


# -- the grammar ---------------------------------------------------------------------------


def test_the_grammar_and_its_messages() -> None:
    """One rule: 1-64 of A-Z a-z 0-9 _ . - for a channel, 1-128 (plus : @) for an id; full match."""
    assert session_keys.session_problem("mcp", "s-1") is None
    assert session_keys.session_problem("c" * 64, "a:b@c" + "s" * 123) is None
    for channel, session_id in bad_pairs():
        problem = session_keys.session_problem(channel, session_id)
        assert problem is not None, (channel[:80], session_id[:80])
        assert_clear(problem)
    assert "500000 characters" in (session_keys.session_id_problem("x" * 500_000) or "")
    assert session_keys.session_key_problem("s-1") is None  # a bare id is in channel mcp
    assert session_keys.session_key_problem("mcp:" + "s" * 129) is not None
    with pytest.raises(RelayError) as refused:
        session_keys.check_session("mcp", "s\n")
    assert refused.value.code == INVALID_PARAMS


def test_the_grammar_has_one_home() -> None:
    """The frame schemas, the limits' largest envelope and the caller API use the same rule."""
    from oubliette_server.doors.caller_api import schemas as caller_schemas
    from protocol import frames, limits

    assert frames.SESSION_ID_SCHEMA is session_keys.SESSION_ID_SCHEMA
    assert frames.SESSION_CHANNEL_SCHEMA is session_keys.SESSION_CHANNEL_SCHEMA
    assert frames.INGRESS_SCHEMA["properties"]["session"]["properties"]["id"] is session_keys.SESSION_ID_SCHEMA
    assert caller_schemas.SESSION_ID["pattern"] == session_keys.SESSION_ID_SCHEMA["pattern"]
    assert limits.MAX_CHANNEL_CHARS == session_keys.MAX_CHANNEL_CHARS


# -- every door ----------------------------------------------------------------------------


async def test_relay_append_frame_refuses_bad_keys_and_stores_nothing(deployment: Deployment) -> None:
    """The attack: a guest's append_frame with 500 kB, newline, NUL, lone-surrogate or empty keys.
    Each gets -32602 (not -32603 and a traceback), the connection lives on, nothing is stored."""
    async with serving(deployment) as served:
        owner, _ = served.callers.open_caller()
        opened = await served.callers.call(owner, "session_message", {"instance": INSTANCE, "session_id": "s1", "message": "hi"})
        assert not opened.is_error, text_of(opened)
        before = await served.held_and_stored()
        async with RawRelay.connect(deployment) as guest:
            hello = await guest.hello(INSTANCE, served.app.tokens.token_for(INSTANCE), role="guest")
            assert "result" in hello, hello
            for n, (channel, session_id) in enumerate(bad_pairs(), start=1):
                await guest.send({"jsonrpc": "2.0", "id": n, "method": "append_frame", "params": {
                    "session": {"channel": channel, "id": session_id}, "type": "status.presence", "payload": {},
                }})
                error = (await response_to(guest, n))["error"]
                assert error["code"] == INVALID_PARAMS, error
                assert_clear(error["message"])
            assert await served.held_and_stored() == before
            # The same connection still appends to the session it was sent a message in.
            await guest.send({"jsonrpc": "2.0", "id": "ok", "method": "append_frame", "params": {
                "session": {"channel": "mcp", "id": "s1"}, "type": "status.presence", "payload": {},
            }})
            assert "result" in await response_to(guest, "ok")


async def test_frame_ids_a_peer_chooses_are_bounded_too(deployment: Deployment) -> None:
    """The same class one field over: a guest's `reply_to` (and an HTTP frame's `msg_id`) of
    300,000 characters or with a lone surrogate once got stored, or -32603 and a traceback.
    Now -32602 (HTTP 400) naming the 128-character bound; nothing stored."""
    async with serving(deployment) as served, served.http.rest() as rest:
        owner, _ = served.callers.open_caller()
        await served.callers.call(owner, "session_message", {"instance": INSTANCE, "session_id": "s1", "message": "hi"})
        before = await served.held_and_stored()
        async with RawRelay.connect(deployment) as guest:
            await guest.hello(INSTANCE, served.app.tokens.token_for(INSTANCE), role="guest")
            for n, reply_to in enumerate(["\ud800", "r" * 300_000, "m" * 129]):
                await guest.send({"jsonrpc": "2.0", "id": n, "method": "append_frame", "params": {
                    "session": {"channel": "mcp", "id": "s1"}, "type": "status.presence", "payload": {}, "reply_to": reply_to,
                }})
                error = (await response_to(guest, n))["error"]
                assert error["code"] == INVALID_PARAMS and "at most 128 characters" in error["message"], error
                assert len(error["message"]) < LONGEST_MESSAGE
        body = {"type": "user.message", "session": {"channel": "host", "id": "s"}, "msg_id": "m-\ud800", "payload": {"text": "x"}}
        response = await rest.post(f"/v1/instances/{INSTANCE}/tether", content=json.dumps(body).encode(),
                                   headers={"content-type": "application/json"})
        assert response.status_code == 400 and "at most 128 characters" in response.text, response.text
        assert await served.held_and_stored() == before


async def test_frame_types_are_bounded_at_every_door(deployment: Deployment) -> None:
    """Seen in an attack: a frame type had a pattern but no length at HTTP ingress, so a 5,000-character type
    was stored and printed whole by `oubliette-server tail`. Every door that names a type — HTTP
    ingress, a guest's `append_frame`, the read filters of the caller tools and HTTP, and
    `Limits.check_frame` before every append — refuses one over 64 characters clearly; nothing stored."""
    from protocol.frames import MAX_FRAME_TYPE_CHARS
    from protocol.limits import Limits

    long_type, longest = "t" * 5000, "t" * MAX_FRAME_TYPE_CHARS
    async with serving(deployment) as served, served.http.rest() as rest:
        owner, _ = served.callers.open_caller()
        await served.callers.call(owner, "session_message", {"instance": INSTANCE, "session_id": "s1", "message": "hi"})
        before = await served.held_and_stored()

        async def ingress(type_: str) -> Any:
            body = {"type": type_, "session": {"channel": "host", "id": "s"}, "payload": {"text": "x"}}
            return await rest.post(f"/v1/instances/{INSTANCE}/tether", content=json.dumps(body).encode(),
                                   headers={"content-type": "application/json"})

        for type_ in (long_type, longest + "t", "a\u009b", "x.\u202e"):
            response = await ingress(type_)
            assert response.status_code == 400 and "invalid frame type" in response.text, response.text
            assert len(response.text) < LONGEST_MESSAGE
        async with RawRelay.connect(deployment) as guest:
            await guest.hello(INSTANCE, served.app.tokens.token_for(INSTANCE), role="guest")
            await guest.send({"jsonrpc": "2.0", "id": 1, "method": "append_frame", "params": {
                "session": {"channel": "mcp", "id": "s1"}, "type": long_type, "payload": {}}})
            error = (await response_to(guest, 1))["error"]
            assert error["code"] == INVALID_PARAMS and "invalid frame type" in error["message"], error
            assert len(error["message"]) < LONGEST_MESSAGE
        for tool, arguments in (("session_events", {"instance": INSTANCE, "session_id": "s1", "types": [long_type]}),
                                ("tether_read", {"instance": INSTANCE, "types": [long_type]})):
            result = await served.callers.call(owner, tool, arguments)
            assert result.is_error and len(text_of(result)) < LONGEST_MESSAGE, (tool, text_of(result)[:LONGEST_MESSAGE])
        poll = await rest.get(f"/v1/instances/{INSTANCE}/tether/poll", params={"types": long_type})
        assert poll.status_code == 400 and "invalid frame type" in poll.text, poll.text[:LONGEST_MESSAGE]
        assert await served.held_and_stored() == before
        assert (await ingress(longest)).status_code == 201  # the limit itself is a type
    with pytest.raises(RelayError, match="invalid frame type"):
        Limits().check_frame({}, instance=INSTANCE, channel="mcp", session_id="s1", type=long_type)


async def test_a_guest_cannot_open_a_session(deployment: Deployment) -> None:
    """A well-formed key the server does not know (not held, no frames in the log) is NOT_FOUND:
    what a guest cannot create it cannot exhaust."""
    async with serving(deployment) as served:
        before = await served.held_and_stored()
        async with RawRelay.connect(deployment) as guest:
            await guest.hello(INSTANCE, served.app.tokens.token_for(INSTANCE), role="guest")
            for n in range(20):
                await guest.send({"jsonrpc": "2.0", "id": n, "method": "append_frame", "params": {
                    "session": {"channel": "mcp", "id": f"made-up-{n}"}, "type": "assistant.delta", "payload": {},
                }})
                error = (await response_to(guest, n))["error"]
                assert error["code"] == NOT_FOUND and "cannot open one" in error["message"], error
        assert await served.held_and_stored() == before


async def test_relay_hello_refuses_bad_keys(deployment: Deployment) -> None:
    async with serving(deployment) as served:
        token = served.app.tokens.token_for(INSTANCE)
        for channel, session_id in bad_pairs():
            if ":" in channel:
                continue  # a key splits at its first colon: "c:d:s1" is channel c, id d:s1
            error = await hello_error(deployment, hello_params(INSTANCE, token, session=f"{channel}:{session_id}"))
            assert error["code"] == INVALID_PARAMS, error
            assert_clear(error["message"])


async def test_http_tether_refuses_bad_keys_with_400(deployment: Deployment) -> None:
    """Ingress (body), poll and stream (query filters), and the operator's answer routes (path)."""
    async with serving(deployment) as served, served.http.rest() as rest:
        before = await served.held_and_stored()
        for channel, session_id in bad_pairs():
            body = {"type": "user.message", "session": {"channel": channel, "id": session_id}, "payload": {"text": "x"}}
            response = await rest.post(f"/v1/instances/{INSTANCE}/tether", content=json.dumps(body).encode(),
                                       headers={"content-type": "application/json"})
            assert response.status_code == 400, response.text[:300]
            assert_clear(response.json()["error"]["message"])
            if "\ud800" in channel + session_id or len(channel + session_id) > 10_000:
                continue  # not something a URL carries
            query = urllib.parse.urlencode({"channel": channel or "x\n", "session_id": session_id or "y\n"})
            for route in ("poll", "stream"):
                response = await rest.get(f"/v1/instances/{INSTANCE}/tether/{route}?{query}")
                assert response.status_code == 400, (route, response.text[:300])
                assert_clear(response.json()["error"]["message"])
            if channel == "mcp" and session_id:
                path = urllib.parse.quote(session_id, safe="")
                response = await rest.post(f"/v1/instances/{INSTANCE}/sessions/{path}/caller_tool_response",
                                           json={"request_id": "ctr-1", "result": {}})
                assert response.status_code == 400, response.text[:300]
                assert_clear(response.json()["error"]["message"])
        assert await served.held_and_stored() == before


def caller_tool_calls(channel: str, session_id: str) -> list[tuple[str, dict[str, Any]]]:
    """Every caller tool that names a session, with (channel, session_id) in it."""
    if channel != "mcp":
        return [("session_events", {"instance": INSTANCE, "session_id": "s1", "channel": channel})]
    return [
        ("session_message", {"instance": INSTANCE, "session_id": session_id, "message": "hi"}),
        ("session_events", {"instance": INSTANCE, "session_id": session_id}),
        ("caller_tool_response", {"session_id": session_id, "request_id": "ctr-1", "result": {}}),
        ("caller_tool_progress", {"session_id": session_id, "request_id": "ctr-1", "progress": 1}),
        ("approval_response", {"session_id": session_id, "request_id": "apr-1", "approve": True}),
        ("tether_send", {"instance": INSTANCE, "text": "hi", "session_id": session_id}),
        ("tether_read", {"instance": INSTANCE, "session_id": session_id}),
    ]


async def test_mcp_caller_tools_refuse_bad_keys(deployment: Deployment) -> None:
    async with serving(deployment) as served:
        caller, _ = served.callers.open_caller()
        before = await served.held_and_stored()
        for channel, session_id in bad_pairs():
            for tool, arguments in caller_tool_calls(channel, session_id):
                result = await served.callers.call(caller, tool, arguments)
                assert result.is_error, (tool, channel[:80], session_id[:80], text_of(result)[:300])
                assert_clear(text_of(result))
        assert await served.held_and_stored() == before


# -- keyed lookups ---------------------------------------------------------------------------


def lines_run(action: Callable[[], Any]) -> int:
    """How many Python lines `action` runs (a scan over n sessions runs at least n)."""
    count = 0

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        nonlocal count
        if event == "line":
            count += 1
        return tracer

    previous = sys.gettrace()
    sys.settrace(tracer)
    try:
        action()
    finally:
        sys.settrace(previous)
    return count


def test_lookups_do_not_look_at_other_sessions() -> None:
    """With 100,000 sessions held, a lookup runs exactly as many lines as with 3: it is a dict
    lookup (the registry once scanned every session: 8.6 -> 35 ms a healthy call)."""
    few, many = SessionRegistry(max_sessions=200_000), SessionRegistry(max_sessions=200_000)
    for registry, count in ((few, 3), (many, 100_000)):
        owner: Any = type("Owner", (), {"closed": trio.Event()})()
        for n in range(count):
            session = registry.get_or_create(f"box{n % 2}", "mcp", f"s-{n}")
            if n == 1:
                registry.set_owner(session, owner)
        registry.owner = owner  # type: ignore[attr-defined]
    for action in (
        lambda r: r.get("box1", "mcp", "s-1"),
        lambda r: r.get("box1", "mcp", "missing"),
        lambda r: r.get_or_create("box1", "mcp", "s-1"),
        lambda r: r.find_by_id("s-1"),
        lambda r: r.find_by_id("s-1", "box1"),
        lambda r: r.find_by_id("missing"),
        lambda r: r.owned_by(r.owner),
    ):
        assert lines_run(lambda: action(many)) == lines_run(lambda: action(few))
    assert many.find_by_id("s-1") == [many.get("box1", "mcp", "s-1")]
    assert many.owned_by(many.owner) == [many.get("box1", "mcp", "s-1")]  # type: ignore[attr-defined]


# -- the bound ---------------------------------------------------------------------------


def test_the_registry_forgets_the_least_recently_used_idle_session() -> None:
    registry = SessionRegistry(max_sessions=3)
    pinned: set[int] = set()
    registry.keep_while(lambda s: id(s) in pinned)
    owner: Any = type("Owner", (), {"closed": trio.Event()})()
    owned = registry.get_or_create("box", "mcp", "owned")
    registry.set_owner(owned, owner)
    followed = registry.get_or_create("box", "mcp", "followed")
    followed.sinks.add(object())  # type: ignore[arg-type]
    pending = registry.get_or_create("box", "mcp", "pending")
    pinned.add(id(pending))
    for n in range(10):
        registry.get_or_create("box", "host", f"t{n}")
        registry.get_or_create("other", "host", f"t{n}")  # another instance has its own bound
    held = {s.id for s in registry.for_instance("box")}
    assert held == {"owned", "followed", "pending", "t9"}  # in use, plus the newest
    assert registry.count("other") == 3 and registry.find_by_id("t0") == []
    assert registry.get("other", "host", "t7") is not None
    owner.closed.set()  # the owner left: its session is idle now, and goes first (least recently used)
    registry.get_or_create("box", "host", "t10")
    assert {s.id for s in registry.for_instance("box")} == {"followed", "pending", "t10"}
    assert registry.owned_by(owner) == []


async def test_forgotten_sessions_stay_in_the_log_and_are_made_again_on_use(deployment: Deployment) -> None:
    async with serving(deployment, max_sessions=3) as served:
        owner, _ = served.callers.open_caller()
        opened = await served.callers.call(owner, "session_message", {"instance": INSTANCE, "session_id": "s1", "message": "hi"})
        assert not opened.is_error, text_of(opened)
        for n in range(8):
            sent = await served.callers.call(owner, "tether_send", {"instance": INSTANCE, "text": f"m{n}", "session_id": f"t{n}"})
            assert not sent.is_error, text_of(sent)
        sessions = served.app.sessions
        assert sessions.count(INSTANCE) == 3 and sessions.forgotten == 6
        assert sessions.get(INSTANCE, "mcp", "s1") is not None  # its owner is connected
        assert sessions.get(INSTANCE, "host", "t0") is None
        # Forgotten from memory only: the log still has it.
        read = structured(await served.callers.call(owner, "tether_read", {
            "instance": INSTANCE, "session_id": "t0", "types": ["user.message"]}))
        assert [f["payload"]["text"] for f in read["frames"]] == ["m0"]
        # A guest may append to it (the log knows it): it is made again.
        async with RawRelay.connect(deployment) as guest:
            await guest.hello(INSTANCE, served.app.tokens.token_for(INSTANCE), role="guest")
            await guest.send({"jsonrpc": "2.0", "id": 1, "method": "append_frame", "params": {
                "session": {"channel": "host", "id": "t0"}, "type": "assistant.delta", "payload": {"text": "back"},
            }})
            assert "result" in await response_to(guest, 1)
        assert sessions.get(INSTANCE, "host", "t0") is not None and sessions.count(INSTANCE) == 3
        read = structured(await served.callers.call(owner, "tether_read", {"instance": INSTANCE, "session_id": "t0"}))
        assert [f["payload"]["text"] for f in read["frames"]] == ["back"]


def test_max_sessions_is_a_setting(tmp_path: Path) -> None:
    path = tmp_path / "oubliette.toml"
    path.write_text("[server]\nmax_sessions = 500\n")
    assert ServerConfig(**load_config_file(path)).max_sessions == 500
    assert ServerConfig().max_sessions == 10_000
    for bad in (0, -1, 10**9):
        with pytest.raises(ValueError, match="max_sessions"):
            ServerConfig(max_sessions=bad)


def test_session_is_hashable_by_identity() -> None:
    """The registry's owner index and the weak log cursors key sessions by identity."""
    a, b = Session(instance="i", channel="mcp", id="s"), Session(instance="i", channel="mcp", id="s")
    assert len({a, b}) == 2
