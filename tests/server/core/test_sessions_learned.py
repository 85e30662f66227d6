"""A server that never held a session learns it from the shared log (docs/SCALING.md, "Every server
knows every session"), with the services alone over an in-memory store.

Another server (A) opened session `s1` (its `session_record`: owner identity and declaration) and
its agent's server (B) asked a caller tool request and an approval, all written straight into the
log. This server (C) holds nothing of `s1`: its session registry, caller tool requests and
approvals, wired with the shared-store crossing as app.py wires them, learn the session, serve
its owner (an answer and a decision stored once, with `append_outcome`) and refuse anyone else
as the owning server does. An id the log does not record makes nothing, and costs one store read
however many instances the log has.
"""

from __future__ import annotations

from typing import Any

import pytest

from oubliette_server.core.callers import CallerConnection
from oubliette_server.core.frame_log import FrameLog
from oubliette_server.core.pending_requests import SharedStore
from oubliette_server.core.server_owned import DECLARATION_KEY, OWNER_KEY, SESSION_RECORD
from oubliette_server.core.sessions import SessionRegistry
from oubliette_server.features.approvals.service import ApprovalService, Decision
from oubliette_server.features.caller_tool_relay.pending import CallerCallRegistry
from oubliette_server.features.cluster.log_bus import LogBus
from oubliette_server.store.api import MAX_RECORDED_INSTANCES, FrameQuery
from oubliette_server.store.sqlite import FrameStore
from protocol import RelayError

INSTANCE = "box1"


def caller(identity: str) -> CallerConnection:
    """A 2026-07-28 caller of this server whose identity (token principal + owner_key) is `identity`."""
    connection = CallerConnection("http")
    connection.identity = identity
    return connection


class CountingStore:
    """The in-memory store, counting the reads a server asks of it (every async call but an append)."""

    def __init__(self, store: FrameStore) -> None:
        self.store = store
        self.reads: list[str] = []

    def __getattr__(self, name: str) -> Any:
        found = getattr(self.store, name)
        if not callable(found) or name.startswith("append"):
            return found

        def counted(*args: Any, **kw: Any) -> Any:
            self.reads.append(name)
            return found(*args, **kw)
        return counted


class ServerC:
    """This server's session registry and request services over the shared (in-memory) log."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.sessions = SessionRegistry()
        frame_log = FrameLog(store, self.sessions)
        crossing = SharedStore(LogBus(store, frame_log.append_outcome), "server-c")
        self.sessions.learn_from(crossing.record_of, crossing.recorded_sessions)
        self.calls = CallerCallRegistry(frame_log.append, 60, crossing=crossing, find_sessions=self.sessions.find_by_id)
        self.approvals = ApprovalService(frame_log.append, 600, crossing=crossing)


async def written_elsewhere(store: FrameStore) -> None:
    """What A and B stored of `s1`: A's record of the owner and its tools, B's request and approval."""
    async def put(type: str, payload: dict[str, Any]) -> None:
        await store.append(INSTANCE, channel="mcp", session_id="s1", type=type, payload=payload)

    await put(SESSION_RECORD, {OWNER_KEY: "key:owner", DECLARATION_KEY: {
        "caller_id": "myapp", "tools": [{"name": "notify", "requires_approval": False}]}})
    await put("user.message", {"text": "hi"})
    await put("caller_tool_request", {"request_id": "ctr-1", "tool": "notify", "arguments": {"n": 1},
                                      "caller_id": "myapp", "expires_at": "2999-01-01T00:00:00.000Z", "server": "server-b"})
    await put("approval_request", {"request_id": "apr-1", "tool_name": "myapp_notify", "arguments": {},
                                   "origin": "caller", "expires_at": "2999-01-01T00:00:00.000Z", "server": "server-b"})


async def outcomes(store: FrameStore, *types: str) -> list[Any]:
    return await store.query(INSTANCE, FrameQuery(session_id="s1", types=types))


async def test_a_session_opened_elsewhere_is_learned_and_served_to_its_owner_only() -> None:
    store = FrameStore.in_memory()
    await written_elsewhere(store)
    c = ServerC(store)
    owner, stranger = caller("key:owner"), caller("key:stranger")

    assert c.sessions.get(INSTANCE, "mcp", "s1") is None
    [session] = await c.sessions.owns(owner, "s1", "mcp")
    assert (session.owner, session.owner_identity, session.caller_id) == (None, "key:owner", "myapp"), \
        "SessionRegistry.learn: the owner and the declaration come from the session_record"
    assert set(session.caller_tools) == {"notify"}
    with pytest.raises(RelayError, match="session 's1' belongs to another caller"):
        await c.sessions.owns(stranger, "s1", "mcp")
    assert await c.sessions.owns(owner, "s-guessed", "mcp") == [] and c.sessions.count() == 1, \
        "an id no log records makes no session"

    await c.calls.sync(session)  # as the owner's first look does
    assert [call.request_id for call in c.calls.pending_for(session)] == ["ctr-1"]
    with pytest.raises(RelayError, match="may only be answered by the caller that declared"):
        await c.calls.respond(stranger, "s1", "ctr-1", result="hijacked")
    answered = await c.calls.respond(owner, "s1", "ctr-1", result={"ok": 1})
    assert answered.remote and answered.done.is_set()
    with pytest.raises(RelayError, match="no longer pending: it was already resolved"):
        await c.calls.respond(owner, "s1", "ctr-1", result={"ok": 2})

    await c.approvals.sync(session)
    with pytest.raises(RelayError, match="may only be answered by the caller that owns session 's1'"):
        await c.approvals.answer(stranger, "s1", "apr-1", Decision(approve=True, who="caller"))
    decided = await c.approvals.answer(owner, "s1", "apr-1", Decision(approve=True, who="caller"))
    assert decided["resolved"] is True

    [result] = await outcomes(store, "caller_tool_result", "caller_tool_cancelled")
    assert result.payload == {"request_id": "ctr-1", "tool": "notify", "result": {"ok": 1}}
    [decision] = await outcomes(store, "approval_resolved")
    assert (decision.payload["request_id"], decision.payload["approve"]) == ("apr-1", True)


async def test_the_owner_sends_into_a_session_opened_elsewhere_and_a_stranger_cannot() -> None:
    store = FrameStore.in_memory()
    await written_elsewhere(store)
    c = ServerC(store)

    async def has_history(session_id: str) -> bool:
        return True

    c.sessions.get_or_create(INSTANCE, "mcp", "s1")  # held with no owner (as a guest's frame makes it): learned all the same

    with pytest.raises(RelayError, match="session 's1' belongs to another caller"):
        await c.sessions.claim(INSTANCE, "mcp", "s1", caller("key:stranger"), has_history)
    owner = caller("key:owner")
    session = await c.sessions.claim(INSTANCE, "mcp", "s1", owner, has_history)
    assert session.owner is None and session.is_owner(owner), \
        "SessionRegistry.claim: the owner stays an identity on a server it did not open the session on"
    c.sessions.declare(session, owner, "myapp", [])
    assert owner in session.sinks and session.caller_tools == {}


async def test_an_unknown_id_costs_one_store_read_however_many_instances_the_log_has() -> None:
    """A caller sending ids no log records (a guess, a typo, a flood) costs the server one bounded
    query per request, not one per instance (docs/SCALING.md, "Every server knows every session")."""
    store = FrameStore.in_memory()
    for n in range(40):
        await store.append(f"box{n:02}", channel="mcp", session_id=f"s-{n}", type="user.message", payload={"text": "hi"})
        await store.append(f"box{n:02}", channel="mcp", session_id=f"s-{n}", type=SESSION_RECORD, payload={OWNER_KEY: "key:owner"})
    counting = CountingStore(store)
    c = ServerC(counting)
    owner = caller("key:owner")

    assert await c.sessions.owns(owner, "s-guessed", "mcp") == [] and c.sessions.count() == 0
    assert counting.reads == ["session_records"], \
        f"SessionRegistry.learn: an unknown id cost {len(counting.reads)} store reads: {counting.reads}"

    counting.reads.clear()
    [session] = await c.sessions.owns(owner, "s-37", "mcp")
    assert (session.instance, session.owner_identity) == ("box37", "key:owner") and counting.reads == ["session_records"], \
        f"SessionRegistry.learn: a session recorded on one instance of 40 cost {counting.reads}"
    counting.reads.clear()
    assert await c.sessions.owns(owner, "s-37", "mcp") == [session] and counting.reads == [], "a session learnt is held"


async def test_sessions_other_callers_open_under_the_owners_id_do_not_hide_its_own() -> None:
    """A session id is a name, not a secret: a stranger opens `s1` in more instances than the bound
    of one lookup, all named before the owner's, and in one more that this server holds. The
    owner's answer on this server still finds its own session (by its identity), and the stranger
    is refused as before."""
    store = FrameStore.in_memory()
    await written_elsewhere(store)  # the owner's s1, in box1
    for n in range(MAX_RECORDED_INSTANCES):
        await store.append(f"a{n:03}", channel="mcp", session_id="s1", type=SESSION_RECORD, payload={OWNER_KEY: "key:stranger"})
    c = ServerC(store)
    owner, stranger = caller("key:owner"), caller("key:stranger")

    [session] = await c.sessions.owns(owner, "s1", "mcp")
    assert (session.instance, session.owner_identity) == (INSTANCE, "key:owner"), \
        "SessionRegistry.owns: the stranger's instances hid the owner's session"
    assert await c.sessions.owns(stranger, "s1", "mcp") != []

    held = ServerC(store)  # another server, holding only a session the stranger opened through it
    await held.sessions.claim("a000", "mcp", "s1", stranger, has_history=lambda session_id: _true())
    [session] = await held.sessions.owns(owner, "s1", "mcp")
    assert session.instance == INSTANCE, "SessionRegistry.owns: a stranger's session held here hid the owner's"
    with pytest.raises(RelayError, match="belongs to another caller"):
        await held.sessions.owns(caller("key:third"), "s1", "mcp")


async def _true() -> bool:
    return True
