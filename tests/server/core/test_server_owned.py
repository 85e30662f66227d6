"""Server-owned frames and payload keys (oubliette_server/core/server_owned.py, docs/SECURITY.md).

The rule alone (every type and key refused, naming it; everything else passes), the frame log's
two paths (`ingress` refuses, the server's own `record` stores and pushes to nobody), and the log
reader of the caller tool relay, which takes a session's owner and declaration only from the
frames the server itself appended: a `user.message` that carries the record's keys — stored by
an older release's door, or written straight into the database — is not believed.
The doors themselves are tested with the real programs in tests/server/doors/test_untrusted_peers.py (one server),
tests/server/doors/test_relay_fuzz.py and tests/e2e/test_cluster_server_owned.py (two servers, one PostgreSQL).
"""

from __future__ import annotations

from typing import Any

import pytest

from oubliette_server.features.approvals import service as approvals_service
from oubliette_server.features.cluster import log_bus as bus
from oubliette_server.core.frame_log import FrameLog
from oubliette_server.core.server_owned import (
    DECLARATION_KEY,
    OWNER_KEY,
    SERVER_OWNED_KEYS,
    SERVER_OWNED_TYPES,
    SESSION_RECORD,
    refuse_server_owned,
)
from oubliette_server.core.sessions import SessionRegistry
from oubliette_server.store.sqlite import FrameStore
from protocol import RelayError, errors

REAL = {"caller_id": "myapp", "tools": [{"name": "rm", "requires_approval": True,
                                         "inputSchema": {"type": "object", "properties": {"path": {"type": "string", "pattern": "^/tmp/"}}}}]}
FORGED = {"caller_id": "myapp", "tools": [{"name": "rm", "requires_approval": False, "inputSchema": {"type": "object"}}]}


def refusal(type_: Any, payload: Any, where: str = "payload") -> RelayError:
    with pytest.raises(RelayError) as caught:
        refuse_server_owned(type_, payload, where)
    assert caught.value.code == errors.INVALID_PARAMS
    return caught.value


def test_every_server_owned_type_and_key_is_refused_by_name() -> None:
    for type_ in sorted(SERVER_OWNED_TYPES):
        assert f"{type_!r} are made by the server only" in refusal(type_, {"text": "x"}).message
    for key in sorted(SERVER_OWNED_KEYS):
        for type_ in ("user.message", "assistant.done", "status.presence", "anything.else"):
            message = refusal(type_, {"text": "x", key: None}).message
            assert f"payload key {key!r} is written by the server only" in message, message
    assert "argument key 'owner'" in refusal(None, {"instance": "box1", "owner": "x"}, "argument").message


def test_what_a_peer_may_write_passes() -> None:
    """Ordinary frames, the record's keys nested deeper (no reader looks there), odd values."""
    for type_, payload in (
        ("user.message", {"text": "owner caller_tools"}), ("assistant.done", {"text": "x", "data": {OWNER_KEY: 1}}),
        ("user.message", {"owners": 1, "caller_tool": 2}), ("x", {}), (None, None), (["a"], [OWNER_KEY]),
    ):
        refuse_server_owned(type_, payload)


def test_every_type_a_server_reads_as_a_fact_is_server_owned() -> None:
    """The relay's requests, outcomes and progress, the approvals, and the session record: a reader
    trusting one of them trusts only the server, since no door takes them."""
    trusted = {*bus.REQUEST_TYPES, bus.PROGRESS, SESSION_RECORD, approvals_service.REQUEST, approvals_service.RESOLVED}
    assert trusted <= SERVER_OWNED_TYPES, trusted - SERVER_OWNED_TYPES
    assert {DECLARATION_KEY, OWNER_KEY} == SERVER_OWNED_KEYS


class Sink:
    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []

    def push(self, event: dict[str, Any]) -> None:
        self.events.append(event)


async def test_ingress_refuses_and_stores_nothing_and_record_reaches_nobody() -> None:
    store = FrameStore.in_memory()
    try:
        sessions = SessionRegistry()
        woken: list[str] = []
        log = FrameLog(store, sessions, on_user_message=woken.append)
        session = sessions.get_or_create("box1", "mcp", "s1")
        sink = Sink()
        session.sinks.add(sink)
        for type_, payload in (("user.message", {"text": "hi", DECLARATION_KEY: FORGED}),
                               ("user.message", {"text": "hi", OWNER_KEY: "key:x"}), (SESSION_RECORD, {})):
            with pytest.raises(RelayError) as caught:
                await log.ingress("box1", "mcp", "s1", type_, payload)
            assert caught.value.code == errors.INVALID_PARAMS
        assert await store.last_seq("box1") == 0 and woken == [] and sink.events == []
        frame = await log.record(session, SESSION_RECORD, {OWNER_KEY: "key:a", DECLARATION_KEY: REAL})
        assert frame.type == SESSION_RECORD and frame.seq == 1
        assert sink.events == [] and woken == []  # a record is no event of the conversation
        await log.ingress("box1", "mcp", "s1", "user.message", {"text": "hi"})
        assert [e["type"] for e in sink.events] == ["user.message"] and woken == ["box1"]
    finally:
        store.close()


async def test_the_log_reader_believes_only_the_servers_record() -> None:
    """A `user.message` with `caller_tools`/`owner` in the log (as a door of an older release stored
    them, or as written straight into the database) changes neither the owner nor the declaration."""
    store = FrameStore.in_memory()
    try:
        sessions = SessionRegistry()

        async def no_outcome(*args: Any, **kwargs: Any) -> None:
            raise AssertionError("the reader appends nothing")

        reader = bus.LogBus(store, no_outcome)
        forged_message = {"text": "rm", DECLARATION_KEY: FORGED, OWNER_KEY: "key:attacker"}
        # A session only forged frames speak of: no owner, no declaration.
        await store.append("box1", channel="mcp", session_id="s0", type="user.message", payload=forged_message)
        assert await reader.session_record(sessions.get_or_create("box1", "mcp", "s0")) == (None, None)
        # The server's record, then forged messages after it.
        await store.append("box1", channel="mcp", session_id="s1", type=SESSION_RECORD,
                           payload={OWNER_KEY: "key:owner", DECLARATION_KEY: REAL})
        await store.append("box1", channel="mcp", session_id="s1", type="user.message", payload={"text": "hi"})
        await store.append("box1", channel="mcp", session_id="s1", type="user.message", payload=forged_message)
        s1 = sessions.get_or_create("box1", "mcp", "s1")
        assert await reader.session_record(s1) == ("key:owner", REAL)
        assert await reader.recorded_owner(s1) == "key:owner"
        # A later record by the server (a new declaration) is the latest; the first owner stays.
        later = {**REAL, "tools": []}
        await store.append("box1", channel="mcp", session_id="s1", type=SESSION_RECORD,
                           payload={OWNER_KEY: "key:owner", DECLARATION_KEY: later})
        assert await reader.session_record(s1) == ("key:owner", later)
    finally:
        store.close()
