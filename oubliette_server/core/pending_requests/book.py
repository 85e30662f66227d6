"""The book of one kind of pending request: what is pending, what ended, who waits for a change.

One `RequestBook` per request service (caller tool requests, approvals). An entry is a
`Pending` (its `frame_seq` 0 until its request frame is stored). Entries
this server waits for are `local`; requests another server's agent made, read from the shared
log, are `remote` (always empty on one server). An ended request is remembered (`finished`,
the last `RESOLVED_MEMORY`) so a late answer is told what happened. A turn wait learns of a
change through a per-session `trio.Event` (and, across servers, the log: the crossing races
the two), never by polling.
"""

from __future__ import annotations

import collections
from typing import (
    TYPE_CHECKING,
    Any,
    Awaitable,
    Callable,
    Generic,
    Iterator,
    TypeVar,
)

import attrs
import trio

from ..sessions import LogCursors, Session, held_by
from .crossing import Crossing

if TYPE_CHECKING:
    from protocol import Frame

    from ..callers import CallerConnection

#: Ended requests remembered, so a late answer is refused with what happened to it.
RESOLVED_MEMORY = 10_000


#: How one request of a kind ended (a caller tool call's result or error, an approval's decision).
Outcome = TypeVar("Outcome")


@attrs.define(eq=False, kw_only=True)
class Pending(Generic[Outcome]):
    """A request waiting for exactly one outcome, as the engine keeps it (service.py); each kind
    adds what its requests carry (caller_tool_relay/pending.py `PendingCall`, approvals/service.py
    `PendingApproval`)."""

    request_id: str
    session: Session
    caller: CallerConnection | None
    """Its owner when it was asked (None: none connected here)."""
    expires_at: str = ""
    frame_seq: int = 0
    """The seq of its request frame; 0 until stored (not yet listed as pending)."""
    outcome: Outcome | None = None
    """Its one outcome; None while it is open."""
    done: trio.Event = attrs.field(factory=trio.Event)
    """Set by its one outcome: a caller's answer only once its frame is stored."""
    recorded: trio.Event = attrs.field(factory=trio.Event)
    """Set once its outcome's frame is stored (or, for an end the server decided, its store failed)."""
    claim: trio.Lock = attrs.field(factory=trio.Lock)
    """Held while a caller's answer is being stored: the timeout and the agent's cancel wait for it,
    then find it answered, or still pending if that store failed."""
    caller_left: bool = False
    """Its owner left while its answer was being stored: if that store fails, it ends as a disconnect."""
    unconfirmed: bool = False
    """An answer's store failed, yet its commit may have happened unseen."""
    waiting: trio.CancelScope | None = None
    """Its wait for an outcome in the shared log, stopped when it ends here."""
    remote: bool = False
    """Another server's request, read from the shared log (answered through it)."""
    in_log: bool = False
    """This server's request whose owner may answer on another server (it waits in the log)."""
    meta: dict[str, str] | None = None
    """The server's span of the request as W3C trace context (`traceparent`, `tracestate`), for the caller."""


E = TypeVar("E", bound=Pending[Any])


class RequestBook(Generic[E]):
    """The pending requests of one kind, by request id, and the sessions' change events.

    Needs: the crossing (`SingleServer` or `SharedStore`) and the frame types its requests
    and outcomes are stored as (what a wait reads from the shared log).
    """

    def __init__(self, crossing: Crossing, types: tuple[str, ...]) -> None:
        self.crossing = crossing
        self.types = types
        self.local: dict[str, E] = {}
        self.remote: dict[str, E] = {}
        self.cursors = LogCursors()
        self.finished: collections.OrderedDict[str, Any] = collections.OrderedDict()
        self._changed: dict[int, trio.Event] = {}

    def find(self, request_id: str) -> E | None:
        """The pending request `request_id`, this server's or (shared store) another's."""
        return self.local.get(request_id) or self.remote.get(request_id)

    def known(self, request_id: str) -> bool:
        """The request is pending here or remotely, or has ended."""
        return request_id in self.local or request_id in self.finished or request_id in self.remote

    def holds(self, session: Session) -> bool:
        """Some request of `session` has not ended (the session registry keeps the session meanwhile)."""
        return held_by(session, self.local.values(), self.remote.values())

    def listed(self, session: Session, is_open: Callable[[E], bool]) -> list[E]:
        """The open requests of `session`, oldest first: this server's once stored, and others' as last read."""
        local = [p for p in self.local.values() if p.session is session and p.frame_seq and is_open(p)]
        remote = [p for p in self.remote.values() if p.session is session and is_open(p)]
        return sorted(local + remote, key=lambda p: p.frame_seq) if remote else local

    def notify(self, session: Session) -> None:
        """Wake every wait on `session` (a request was stored or ended)."""
        event = self._changed.pop(id(session), None)
        if event is not None:
            event.set()

    def remember(self, request_id: str, finished: Any) -> None:
        """Remember how `request_id` ended (the oldest memory goes past `RESOLVED_MEMORY`)."""
        self.finished[request_id] = finished
        while len(self.finished) > RESOLVED_MEMORY:
            self.finished.popitem(last=False)

    async def read_new(self, session: Session, *, known: bool = False) -> list[Frame]:
        """The session's request and outcome frames other servers stored since the last read; only
        for a session whose owner is connected here or recorded in the log (it answers them here).
        With `known`, only those the store knows whole without reading (`Crossing.read_new`)."""
        if not session.owner_known:
            return []
        return await self.crossing.read_new(self.cursors, session, self.types, known=known)

    async def read_news(self, session: Session, request_type: str, *, known: bool = False) -> list[tuple[str, Frame]]:
        """`read_new` as `(request_id, frame)` pairs: frames without a request id are dropped, and
        so are `request_type` frames of requests already known here (pending or ended)."""
        news = []
        for frame in await self.read_new(session, known=known):
            request_id = frame.payload.get("request_id")
            if isinstance(request_id, str) and not (frame.type == request_type and self.known(request_id)):
                news.append((request_id, frame))
        return news

    async def wait_change(self, session: Session, then: Callable[[Session], Awaitable[None]]) -> None:
        """Return at the session's next change: a request stored or ended, here or (read, then `then`) elsewhere."""
        event = self._changed.get(id(session))
        if event is None:
            event = self._changed[id(session)] = trio.Event()
        if not session.owner_known:
            await event.wait()
            return
        await self.crossing.wait_change(event, session, self.types, self.cursors.get(session, 0), then)

    async def wait_pending(
        self, session: Session, sync: Callable[[Session], Awaitable[None]], pending_for: Callable[[Session], list[E]],
    ) -> list[E]:
        """Return the session's pending requests as soon as there is at least one (one already pending counts)."""
        while True:
            await sync(session)
            pending = pending_for(session)
            if pending:
                return pending
            await self.wait_change(session, sync)

    def followed_sessions(self, owner: Any, session: Session | None = None) -> list[Session]:
        """The sessions (or just `session`) of `owner` whose other servers' requests this server read."""
        return [s for s in self.cursors if s.owner is owner and session in (None, s)]

    def remote_of(self, sessions: list[Session]) -> Iterator[E]:
        """Other servers' requests of `sessions` still listed here."""
        return (entry for entry in self.remote.values() if entry.session in sessions)
