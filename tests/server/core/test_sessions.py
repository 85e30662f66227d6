"""Who owns a session: `SessionRegistry`'s operations alone (claim, owns, declare, forget), in memory.

The registry is the one place a session's owner, declaration and followers are written; the
caller API and the caller tool relay only ask it.
"""

from __future__ import annotations

from typing import Any

import pytest

from oubliette_server.core.callers import CallerConnection
from oubliette_server.core.sessions import SessionRegistry
from protocol import RelayError, errors
from protocol.messages import CallerToolSpec


async def no_history(session_id: str) -> bool:
    """The log has no frames of the session."""
    return False


async def some_history(session_id: str) -> bool:
    """The log has frames of the session (opened before a restart, or by the tether)."""
    return True


async def test_the_first_caller_claims_a_session_and_nobody_else_may() -> None:
    registry = SessionRegistry()
    alice, bob = CallerConnection("stdio"), CallerConnection("stdio")
    session = await registry.claim("box1", "mcp", "s1", alice, no_history)
    assert session.owner is alice and registry.owned_by(alice) == [session]
    assert await registry.claim("box1", "mcp", "s1", alice, no_history) is session
    with pytest.raises(RelayError) as refused:
        await registry.claim("box1", "mcp", "s1", bob, no_history)
    assert refused.value.code == errors.UNAUTHORIZED
    fresh = await registry.claim("box1", "mcp", None, bob, some_history)
    assert fresh.owner is bob and fresh.id.startswith("s-")


async def test_a_session_with_history_and_no_owner_is_nobodys_to_claim() -> None:
    registry = SessionRegistry()
    with pytest.raises(RelayError, match="belongs to another caller"):
        await registry.claim("box1", "mcp", "old", CallerConnection("stdio"), some_history)
    assert registry.get("box1", "mcp", "old") is None


async def test_owns_lists_the_callers_sessions_and_refuses_anothers() -> None:
    registry = SessionRegistry()
    alice, bob = CallerConnection("stdio"), CallerConnection("stdio")
    session = await registry.claim("box1", "mcp", "s1", alice, no_history)
    assert await registry.owns(alice, "s1", "mcp") == [session]
    assert await registry.owns(alice, "unknown", "mcp") == []
    with pytest.raises(RelayError, match="belongs to another caller"):
        await registry.owns(bob, "s1", "mcp")


async def test_owns_knows_the_owner_recorded_in_a_shared_log() -> None:
    registry = SessionRegistry()
    caller = CallerConnection("stdio")

    async def recorded(session: object) -> tuple[str | None, None]:
        return caller.identity, None

    async def no_records(channel: str, session_id: str, owner: str | None = None) -> list[Any]:
        return []

    registry.learn_from(recorded, no_records)
    session = registry.get_or_create("box1", "mcp", "s1")  # opened on another server
    assert await registry.owns(caller, "s1", "mcp") == [session]
    assert session.owner_identity == caller.identity and session.owner is None


async def test_only_the_owner_declares_and_then_follows_the_session() -> None:
    registry = SessionRegistry()
    alice, bob = CallerConnection("stdio"), CallerConnection("stdio")
    session = await registry.claim("box1", "mcp", "s1", alice, no_history)
    registry.declare(session, alice, "myapp", [CallerToolSpec(name="notify")], echo_own_answers=True)
    assert set(session.caller_tools) == {"notify"} and session.caller_id == "myapp"
    assert alice in session.sinks and session.echo_own_answers
    with pytest.raises(RelayError, match="belongs to another caller"):
        registry.declare(session, bob, "theirs", [])
    assert set(session.caller_tools) == {"notify"}
    registry.forget(session)
    assert registry.get("box1", "mcp", "s1") is None and registry.owned_by(alice) == []
