"""Sessions: one conversation with the agent of an instance, keyed `channel:session_id`.

A session belongs to the caller that opened it (its first `session_message`):
only that caller may send into it, declare its caller tools, answer their
requests and read its events (docs/SECURITY.md, "Callers and sessions"). A
session also remembers which event sinks want its frames.
"""

from __future__ import annotations

import itertools
import secrets
from typing import TYPE_CHECKING, Protocol

import attrs

from protocol import CallerToolSpec, RelayError, errors

if TYPE_CHECKING:
    from protocol import Frame

    from .callers import CallerConnection
    from .store_api import FrameStoreAPI

_declaration_clock = itertools.count(1)


class EventSink(Protocol):
    """Anything that can take a caller event (a flattened frame) without blocking."""

    def push(self, event: dict) -> None:
        """Take one event without waiting (drop it rather than block)."""


def new_session_id() -> str:
    """A session id nobody can guess (128 random bits): knowing it is no credential, but it hides the session."""
    return "s-" + secrets.token_hex(16)


def not_yours(session_id: str) -> RelayError:
    """The one refusal a caller gets for another caller's session (messages, declarations, answers, reads)."""
    return RelayError(errors.UNAUTHORIZED, f"session '{session_id}' belongs to another caller")


@attrs.define(eq=False)
class Session:
    """One conversation with an instance's agent (`channel:id`): its caller tools, their owner, and who follows its frames."""

    instance: str
    channel: str
    id: str
    caller_id: str | None = None
    caller_tools: dict[str, CallerToolSpec] = attrs.field(factory=dict)
    owner: CallerConnection | None = None
    #: Shared store only: the owner's `CallerConnection.identity`, as recorded in the session's
    #: `session_record` frames (server_owned.py), so every server can tell the same caller (None with SQLite).
    owner_identity: str | None = None
    declared_at: int = 0
    sinks: set[EventSink] = attrs.field(factory=set)
    #: Whether the owner also gets the `caller_tool_result` event of its own answers
    #: (`context.echo_own_answers`); by default it does not: it knows what it answered.
    echo_own_answers: bool = False

    @property
    def key(self) -> str:
        """`channel:id`, the session's key within its instance."""
        return f"{self.channel}:{self.id}"

    def same_caller(self, caller: CallerConnection) -> bool:
        """`caller` is the session's owner by identity (shared store: possibly connected to another
        server than the one it opened the session on); always False with SQLite."""
        return self.owner_identity is not None and caller.identity == self.owner_identity

    def check_owner(self, caller: CallerConnection) -> None:
        """Raise `not_yours` unless `caller` owns this session."""
        if self.owner is not caller:
            raise not_yours(self.id)

    def declare_caller_tools(self, owner: CallerConnection, caller_id: str, tools: list[CallerToolSpec]) -> None:
        """Replace the session's caller tools with `owner`'s; `not_yours` for another caller."""
        self.check_owner(owner)
        self.caller_id = caller_id
        self.caller_tools = {tool.name: tool for tool in tools}
        self.declared_at = next(_declaration_clock)
        self.sinks.add(owner)


class SessionFrames(Protocol):
    """A shared log as `LogCursors` reads it (`caller_tool_relay.LogBus` is one)."""

    store: FrameStoreAPI

    async def frames(self, session: Session, types: tuple[str, ...], after_seq: int) -> list[Frame]:
        """Every frame of `session` of `types` after `after_seq`."""
        ...


class LogCursors(dict["Session", int]):
    """Per session, the seq up to which a service has read a shared log (approvals and caller
    tool requests each keep one, to pick up what other servers wrote into their sessions)."""

    async def read_new(self, log: SessionFrames, session: Session, types: tuple[str, ...]) -> list[Frame]:
        """The session's frames of `types` since the last read (from the oldest kept frame at
        first), with the cursor moved past them; reads that overlap never move it back."""
        after = self.get(session)
        if after is None:
            after = await log.store.pruned_below(session.instance)
        frames = await log.frames(session, types, after)
        if frames:
            after = max(after, frames[-1].seq)
        self[session] = max(after, self.get(session, 0))
        return frames


class SessionRegistry:
    """All sessions the server knows in this process, by instance and key."""

    def __init__(self) -> None:
        self._sessions: dict[tuple[str, str], Session] = {}

    def get(self, instance: str, channel: str, session_id: str) -> Session | None:
        """The session, or None when it does not exist yet."""
        return self._sessions.get((instance, f"{channel}:{session_id}"))

    def get_or_create(self, instance: str, channel: str, session_id: str) -> Session:
        """The session, created empty on first use."""
        key = (instance, f"{channel}:{session_id}")
        session = self._sessions.get(key)
        if session is None:
            session = Session(instance=instance, channel=channel, id=session_id)
            self._sessions[key] = session
        return session

    def find_by_id(self, session_id: str, instance: str | None = None) -> list[Session]:
        """Sessions with this id (any channel), optionally within one instance."""
        return [
            s for (inst, _), s in self._sessions.items()
            if s.id == session_id and (instance is None or inst == instance)
        ]

    def for_instance(self, instance: str) -> list[Session]:
        """Every session of `instance`."""
        return [s for (inst, _), s in self._sessions.items() if inst == instance]

    def all(self) -> list[Session]:
        """Every session the server knows."""
        return list(self._sessions.values())

    def latest_declarations(self, instance: str) -> dict[str, Session]:
        """Per caller id, the session whose caller tools were declared last."""
        latest: dict[str, Session] = {}
        for session in self.for_instance(instance):
            if session.caller_id is None:
                continue
            current = latest.get(session.caller_id)
            if current is None or session.declared_at > current.declared_at:
                latest[session.caller_id] = session
        return latest

    def owned_by(self, caller: CallerConnection) -> list[Session]:
        """The sessions `caller` opened."""
        return [s for s in self._sessions.values() if s.owner is caller]

    def drop_sink(self, sink: EventSink) -> None:
        """`sink` follows no session any more (its caller is gone)."""
        for session in self._sessions.values():
            session.sinks.discard(sink)
