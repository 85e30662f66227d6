"""Sessions: one conversation with the agent of an instance, keyed `channel:session_id`.

A session belongs to the caller that opened it (its first `session_message`):
only that caller may send into it, declare its caller tools, answer their
requests and read its events (docs/SECURITY.md, "Callers and sessions"). A
session also remembers which event sinks want its frames.
"""

from __future__ import annotations

import collections
import itertools
import logging
import secrets
import weakref
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Iterable, Protocol

import attrs

from protocol import CallerToolSpec, RelayError, errors, structure

from ..store.api import CursorPruned, FrameQuery, RecordedSession

if TYPE_CHECKING:
    from protocol import Frame

    from ..store.api import FrameStoreAPI
    from .callers import CallerConnection

log = logging.getLogger("oubliette.server.caller_tools")

_declaration_clock = itertools.count(1)


class EventSink(Protocol):
    """Anything that can take a caller event (a flattened frame) without blocking."""

    def push(self, event: dict) -> None:
        """Take one event without waiting (drop it rather than block)."""


def delivers(sink: EventSink) -> bool:
    """Whether an event pushed to `sink` can reach anyone: a sink may say it cannot (a `delivers`
    that is False), so that nobody reads the log for it (the log tail)."""
    return bool(getattr(sink, "delivers", True))


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
    #: `session_record` frames (server_owned.py), so every server can tell the same caller.
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
        server than the one it opened the session on)."""
        return self.owner_identity is not None and caller.identity == self.owner_identity

    def is_owner(self, caller: CallerConnection) -> bool:
        """`caller` owns this session: it opened it here, or (shared store, a session opened on another
        server) its identity is the owner's the log recorded. The one ownership rule of every door."""
        return self.owner is caller or (self.owner is None and self.same_caller(caller))

    @property
    def owner_known(self) -> bool:
        """Its owner is connected here or recorded in the log: this server lists and answers the
        requests of the session that other servers' agents made (pending_requests/)."""
        return self.owner is not None or self.owner_identity is not None

    def check_owner(self, caller: CallerConnection) -> None:
        """Raise `not_yours` unless `caller` owns this session (`is_owner`)."""
        if not self.is_owner(caller):
            raise not_yours(self.id)


async def session_has_frames(store: FrameStoreAPI, instance: str, channel: str, session_id: str) -> bool:
    """The log has frames of the session (or had: its oldest kept frames were pruned after it)."""
    query = FrameQuery(channel=channel, session_id=session_id, after_seq=await store.pruned_below(instance), limit=1)
    try:
        return bool(await store.query(instance, query))
    except CursorPruned:
        return True


def held_by(session: Session, *entries: Iterable[Any]) -> bool:
    """Some entry (anything with a `session`, such as a pending request) is of `session`."""
    return any(entry.session is session for group in entries for entry in group)


class SessionFrames(Protocol):
    """A shared log as `LogCursors` reads it (`features.cluster.LogBus` is one)."""

    store: FrameStoreAPI

    async def frames(self, session: Session, types: tuple[str, ...], after_seq: int, *, known: bool = False) -> list[Frame]:
        """Every frame of `session` of `types` after `after_seq`; with `known`, only those the store
        knows whole without reading (a first part of them, perhaps none)."""
        ...


class LogCursors(weakref.WeakKeyDictionary["Session", int]):
    """Per session, the seq up to which a service has read a shared log (approvals and caller
    tool requests each keep one, to pick up what other servers wrote into their sessions).
    Held weakly: a session the registry forgot takes its cursor with it."""

    async def read_new(
        self, log: SessionFrames, session: Session, types: tuple[str, ...], *, known: bool = False,
    ) -> list[Frame]:
        """The session's frames of `types` since the last read (from the oldest kept frame at
        first), with the cursor moved past them; reads that overlap never move it back. With
        `known`, those the store knows whole without reading (`SessionFrames.frames`), none at first."""
        after = self.get(session)
        if after is None:
            if known:
                return []
            after = await log.store.pruned_below(session.instance)
        frames = await log.frames(session, types, after, known=known)
        if frames:
            after = max(after, frames[-1].seq)
        self[session] = max(after, self.get(session, 0))
        return frames


#: What a session's `session_record` frames say: its owner's identity and its last declaration.
RecordFn = Callable[["Session"], Awaitable[tuple["str | None", "dict[str, Any] | None"]]]


async def _nothing_recorded(session: Session) -> tuple[str | None, dict[str, Any] | None]:
    """Nothing is read back from the log (one server: its memory is all there is)."""
    return None, None


#: The instances whose log records a session `(channel, session_id, owner)`, with what each records
#: (with an owner identity: only the instances it opened the session in).
RecordsFn = Callable[[str, str, "str | None"], Awaitable[list[RecordedSession]]]


async def _no_records(channel: str, session_id: str, owner: str | None = None) -> list[RecordedSession]:
    """No instance's log is searched for a session (one server)."""
    return []


#: Sessions of one instance held in memory at most (besides those in use); `max_sessions`.
DEFAULT_MAX_SESSIONS = 10_000


class SessionRegistry:
    """The sessions this process holds in memory, keyed by instance, channel and id; at most
    `max_sessions` idle ones per instance.

    Every lookup is a dict lookup (by key, or by id through an index), never a scan of all
    sessions. When an instance holds more than `max_sessions`, the least recently used idle
    ones are forgotten: a session is in use while its owner is connected, someone follows its
    frames, or a check given to `keep_while` says so (pending requests and approvals). A
    forgotten session is only forgotten here: its frames stay in the log, and the next use
    makes it again (docs/SECURITY.md, "Session keys at every door").
    """

    def __init__(self, max_sessions: int = DEFAULT_MAX_SESSIONS) -> None:
        if not isinstance(max_sessions, int) or isinstance(max_sessions, bool) or max_sessions < 1:
            raise ValueError(f"max_sessions must be a positive integer, got {max_sessions!r}")
        self.max_sessions = max_sessions
        # instance -> (channel, id) -> session, least recently used first
        self._by_instance: dict[str, collections.OrderedDict[tuple[str, str], Session]] = {}
        # id -> (instance, channel) -> session: `find_by_id` without a scan
        self._by_id: dict[str, dict[tuple[str, str], Session]] = {}
        # owner -> its sessions (as a dict used as an ordered set)
        self._by_owner: dict[CallerConnection, dict[Session, None]] = {}
        # instance -> sessions given a follower (some may have none left: `followed` drops those)
        self._followed: dict[str, set[Session]] = {}
        self._in_use: list[Callable[[Session], bool]] = []
        self._read_record: RecordFn = _nothing_recorded
        self._find_records: RecordsFn = _no_records
        #: How many sessions were forgotten so far (for tests and benchmarks).
        self.forgotten = 0

    def keep_while(self, in_use: Callable[[Session], bool]) -> None:
        """Never forget a session while `in_use(session)` is true (a service holding requests of it)."""
        self._in_use.append(in_use)

    def get(self, instance: str, channel: str, session_id: str) -> Session | None:
        """The session, or None when it is not held (never made, or forgotten)."""
        sessions = self._by_instance.get(instance)
        if sessions is None:
            return None
        session = sessions.get((channel, session_id))
        if session is not None:
            sessions.move_to_end((channel, session_id))
        return session

    def get_or_create(self, instance: str, channel: str, session_id: str) -> Session:
        """The session, made empty on first use (or on the first use after it was forgotten).

        The caller has checked the key (`protocol.session_keys`) at its door."""
        session = self.get(instance, channel, session_id)
        if session is not None:
            return session
        session = Session(instance=instance, channel=channel, id=session_id)
        sessions = self._by_instance.setdefault(instance, collections.OrderedDict())
        sessions[(channel, session_id)] = session
        self._by_id.setdefault(session_id, {})[(instance, channel)] = session
        if len(sessions) > self.max_sessions:
            self._forget_idle(sessions)
        return session

    # -- ownership: the one place a session's owner, declaration and followers are written ---------

    def learn_from(self, read_record: RecordFn, find_records: RecordsFn) -> None:
        """Read a session's recorded owner and declaration with `read_record` (one instance's log), and
        look for a session this process does not hold in every instance's log with `find_records`,
        one store read (a shared store; by default nothing is read back: one server knows its
        sessions from memory)."""
        self._read_record = read_record
        self._find_records = find_records

    async def learn(
        self, session_id: str, channel: str, instance: str | None = None, owner: str | None = None,
    ) -> list[Session]:
        """The sessions with this id (of `instance`, else of any instance; with `owner`, an identity,
        only the ones it opened) that the log records an owner of, made here with that owner and its
        last declaration: any server then serves the owner as the server it opened the session on
        does (docs/SCALING.md, "Every server knows every session"). Sessions held with a known owner
        are returned as they are; an id no log records makes nothing: a guess costs one store read
        (of `instance`'s log, else one query across every instance's, at most
        `MAX_RECORDED_INSTANCES` of them), never memory.
        """
        found = [s for s in self.find_by_id(session_id, instance) if s.channel == channel]
        known = {s.instance for s in found if s.owner_known}
        if instance is None:
            records = await self._find_records(channel, session_id, owner)
        elif instance in known:
            records = []
        else:
            owner, declared = await self._read_record(Session(instance=instance, channel=channel, id=session_id))
            records = [RecordedSession(instance, owner, declared)]
        for record in records:
            if record.instance in known or record.owner is None:
                continue
            session = self.get_or_create(record.instance, channel, session_id)  # held, or made meanwhile: the same one
            if not session.owner_known:
                self.adopt_record(session, record.owner, record.declared)
            if session not in found:
                found.append(session)
        return found

    def adopt_record(self, session: Session, owner: str | None, declared: dict[str, Any] | None) -> None:
        """What the log records of a session this server holds no owner of: its owner identity and,
        when there is one, its last declaration (written by a server of the deployment, yet never
        trusted blindly: one that does not read is ignored)."""
        self.note_owner(session, owner)
        if session.owner is not None or declared is None:
            return  # declared here: memory is current
        try:
            tools = [structure(tool, CallerToolSpec) for tool in declared.get("tools", [])]
        except Exception as exc:
            log.warning("session %s: ignoring a declaration in the log that does not read (%s)", session.key, exc)
            return
        self.adopt_declaration(session, str(declared.get("caller_id") or ""), tools)

    async def claim(
        self, instance: str, channel: str, session_id: str | None, caller: CallerConnection,
        has_history: Callable[[str], Awaitable[bool]],
    ) -> Session:
        """The caller's session `session_id` (a new one when None), claimed for it if nobody opened
        it; else `not_yours` (docs/SECURITY.md, "Callers and sessions").

        A session with no owner in this process but with frames in the log (`has_history`:
        opened before a restart, or by the HTTP tether API) is refused too: its owner cannot be
        known, and claiming it would hand its history to whoever asks first. With a shared store
        the log may record its owner (opened on another server): that caller is taken, by identity.
        """
        if session_id is None:
            created = self.get_or_create(instance, channel, new_session_id())
            self.set_owner(created, caller)
            return created
        session = self.get(instance, channel, session_id)
        if session is not None and session.owner_known:
            session.check_owner(caller)
            return session
        has_frames = await has_history(session_id)
        # Another call may have claimed it while the log was read: look again.
        session = self.get(instance, channel, session_id)
        if session is not None and session.owner_known:
            session.check_owner(caller)
            return session
        if has_frames:
            # Opened on another server (shared store): its owner, by the identity the log
            # recorded, sends into it here too; the owner stays an identity, not this connection.
            for learned in await self.learn(session_id, channel, instance):
                learned.check_owner(caller)
                return learned
            raise not_yours(session_id)
        created = self.get_or_create(instance, channel, session_id)
        self.set_owner(created, caller)
        return created

    async def owns(self, caller: CallerConnection, session_id: str, channel: str, instance: str | None = None) -> list[Session]:
        """The caller's sessions of `channel` with this id; `not_yours` if only other callers have one.

        Shared store: a session opened on another server is the caller's too when the owner
        identity its log recorded is the caller's (docs/SCALING.md, "Caller identity"), even if
        this server never held it (`learn`).
        """
        mine, known = await self.mine_first(caller, session_id, channel, instance)
        if known and not mine:
            raise not_yours(session_id)
        return mine

    async def mine_first(
        self, caller: CallerConnection, session_id: str, channel: str, instance: str | None = None,
    ) -> tuple[list[Session], list[Session]]:
        """`(the caller's sessions of channel with this id, every one found)`: held here, else learned.

        A session id is a name anybody may use: when only other callers' sessions of the id are
        found (held here, or the first `MAX_RECORDED_INSTANCES` the log records), the caller's own
        are looked up by its identity (one more bounded read), so what others named their sessions
        never hides the caller's. In one instance an id is one session: nothing can hide it.
        """
        known = [s for s in self.find_by_id(session_id, instance) if s.channel == channel]
        if not known:
            known = await self.learn(session_id, channel, instance)
        await self.load_owners(known)
        mine = [s for s in known if s.is_owner(caller)]
        if known and not mine and instance is None:
            mine = [s for s in await self.learn(session_id, channel, instance, caller.identity) if s.is_owner(caller)]
        return mine, known

    async def load_owners(self, sessions: list[Session]) -> None:
        """Read the recorded owner of each session that has no owner in this process (shared store)."""
        for session in sessions:
            if session.owner is None and session.owner_identity is None:
                session.owner_identity = (await self._read_record(session))[0]

    @staticmethod
    def note_owner(session: Session, identity: str | None) -> None:
        """The session's owner identity, as recorded in (or read from) the shared log; None keeps the one known."""
        session.owner_identity = identity or session.owner_identity

    def declare(
        self, session: Session, owner: CallerConnection, caller_id: str, tools: list[CallerToolSpec],
        echo_own_answers: bool | None = None,
    ) -> None:
        """Replace the session's caller tools with `owner`'s, who follows the session from now on
        (and, when given, whether it gets the events of its own answers); `not_yours` for another caller."""
        session.check_owner(owner)
        self.adopt_declaration(session, caller_id, tools)
        self.follow(session, owner)
        if echo_own_answers is not None:
            session.echo_own_answers = echo_own_answers

    @staticmethod
    def adopt_declaration(session: Session, caller_id: str, tools: list[CallerToolSpec]) -> None:
        """Take `caller_id`'s tools as the session's declaration (declared here, or read from the shared log)."""
        session.caller_id = caller_id
        session.caller_tools = {tool.name: tool for tool in tools}
        session.declared_at = next(_declaration_clock)

    def follow(self, session: Session, sink: EventSink) -> None:
        """`sink` gets the session's frames from now on."""
        session.sinks.add(sink)
        self._followed.setdefault(session.instance, set()).add(session)

    def followed(self, instance: str) -> bool:
        """Some session of `instance` held here has a follower (a lookup, not a scan of its sessions:
        the log tail asks on every append to a shared log)."""
        sessions = self._followed.get(instance)
        if not sessions:
            return False
        for session in list(sessions):
            if session.sinks:
                return True
            sessions.discard(session)
        del self._followed[instance]
        return False

    def unfollow(self, session: Session, sink: EventSink) -> None:
        """`sink` gets the session's frames no more."""
        session.sinks.discard(sink)
        if not session.sinks:
            self._unfollowed(session)

    def _unfollowed(self, session: Session) -> None:
        """`session` has no follower left: out of the `followed` index (which holds nothing else)."""
        sessions = self._followed.get(session.instance)
        if sessions is not None:
            sessions.discard(session)
            if not sessions:
                del self._followed[session.instance]

    def set_owner(self, session: Session, owner: CallerConnection) -> None:
        """`owner` opened `session` (the one place an owner is recorded, so `owned_by` is a lookup)."""
        if session.owner is not None:
            self._unindex_owner(session)
        session.owner = owner
        self._by_owner.setdefault(owner, {})[session] = None

    def find_by_id(self, session_id: str, instance: str | None = None) -> list[Session]:
        """Sessions with this id (any channel), optionally within one instance."""
        found = self._by_id.get(session_id)
        if not found:
            return []
        return [s for (inst, _), s in found.items() if instance is None or inst == instance]

    def for_instance(self, instance: str) -> list[Session]:
        """Every session of `instance` held now."""
        return list(self._by_instance.get(instance, {}).values())

    def count(self, instance: str | None = None) -> int:
        """How many sessions are held, of `instance` or of all."""
        if instance is not None:
            return len(self._by_instance.get(instance, ()))
        return sum(len(sessions) for sessions in self._by_instance.values())

    def all(self) -> list[Session]:
        """Every session held now."""
        return [s for sessions in self._by_instance.values() for s in sessions.values()]

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
        """The sessions `caller` opened (that are held now)."""
        return list(self._by_owner.get(caller, ()))

    def drop_sink(self, sink: EventSink) -> None:
        """`sink` follows no session any more (its caller is gone)."""
        for sessions in list(self._followed.values()):
            for session in list(sessions):
                self.unfollow(session, sink)

    def in_use(self, session: Session) -> bool:
        """The session must stay in memory: its owner is connected, someone follows its frames,
        or a service holds requests of it."""
        owner = session.owner
        if owner is not None and not owner.closed.is_set():
            return True
        return bool(session.sinks) or any(check(session) for check in self._in_use)

    def _forget_idle(self, sessions: collections.OrderedDict[tuple[str, str], Session]) -> None:
        """Forget least recently used idle sessions until `max_sessions` are left; one in use is
        moved to the back (it is being used), and each is looked at once at most."""
        for _ in range(len(sessions) - 1):  # never the one just made (the last)
            if len(sessions) <= self.max_sessions:
                return
            key, session = next(iter(sessions.items()))
            if self.in_use(session):
                sessions.move_to_end(key)
                continue
            self.forget(session)

    def forget(self, session: Session) -> None:
        """Forget `session` from memory (its frames stay in the log; the next use makes it again)."""
        sessions = self._by_instance[session.instance]
        del sessions[(session.channel, session.id)]
        by_id = self._by_id[session.id]
        del by_id[(session.instance, session.channel)]
        if not by_id:
            del self._by_id[session.id]
        if session.owner is not None:
            self._unindex_owner(session)
        self._unfollowed(session)
        self.forgotten += 1

    def _unindex_owner(self, session: Session) -> None:
        assert session.owner is not None
        owned = self._by_owner.get(session.owner)
        if owned is not None:
            owned.pop(session, None)
            if not owned:
                del self._by_owner[session.owner]
