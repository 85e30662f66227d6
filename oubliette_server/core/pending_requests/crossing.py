"""How pending requests cross servers: the one strategy a request service is given.

`SingleServer` (SQLite, one server) does nothing across servers: nothing is read from the
log, a wait is woken only by this server's own changes, an outcome is appended as any frame.
`SharedStore` (PostgreSQL, docs/SCALING.md) reads other servers' requests and outcomes from
the log, races a wait against the log, and stores every outcome with `append_outcome`, so
exactly one wins across servers. The services (caller tool requests, approvals) call the same
methods either way and never ask which one they hold.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Awaitable, Callable, Protocol

import trio

from protocol import Frame

from ...store.api import FrameStoreAPI, RecordedSession
from ..frame_log import AppendFrame as AppendFn
from ..frame_log import AppendOutcome
from ..sessions import SessionRegistry

if TYPE_CHECKING:
    from ..sessions import LogCursors, Session

#: A session, its recorded owner identity and its last recorded declaration.
SessionRecord = tuple["Session", "str | None", "dict[str, Any] | None"]
#: Gets the payload of each progress report stored on a request another server waits for.
ProgressPayloadFn = Callable[[dict[str, Any]], None]


class SharedLog(Protocol):
    """The log other servers share, as pending requests use it (`features.cluster.LogBus` is one)."""

    store: FrameStoreAPI
    append_outcome: AppendOutcome

    async def frames(self, session: Session, types: tuple[str, ...], after_seq: int, *, known: bool = False) -> list[Frame]:
        """Every frame of `session` of `types` after `after_seq`; with `known`, only those the store
        knows whole without reading (a first part of them, perhaps none)."""
        ...

    async def wait_frames(self, session: Session, types: tuple[str, ...], after_seq: int) -> list[Frame]:
        """Wait until `session` has frames of `types` after `after_seq`."""
        ...

    async def wait_outcome(
        self, session: Session, request_id: str, after_seq: int,
        on_progress: ProgressPayloadFn | None = None, outcome_types: tuple[str, ...] = (),
    ) -> Frame:
        """Wait for the outcome frame of `request_id` (one of `outcome_types`), by any server."""
        ...

    async def session_record(self, session: Session) -> tuple[str | None, dict[str, Any] | None]:
        """`(owner identity, last declaration)` the session's `session_record` frames hold."""
        ...


class Crossing(Protocol):
    """What a request service does across servers; `SingleServer` and `SharedStore` are the two."""

    async def read_new(
        self, cursors: LogCursors, session: Session, types: tuple[str, ...], *, known: bool = False,
    ) -> list[Frame]:
        """The session's frames of `types` other servers stored since the last read (none on one server);
        with `known`, only those the store knows whole without reading (`LogCursors.read_new`)."""
        ...

    async def wait_change(
        self, changed: trio.Event, session: Session, types: tuple[str, ...], after_seq: int,
        then: Callable[[Session], Awaitable[None]],
    ) -> None:
        """Return when `changed` is set or (across servers) a frame of `types` is stored after `after_seq` (then `then`)."""
        ...

    async def store_outcome(
        self, append: AppendFn, session: Session, type: str, payload: dict[str, Any], *, skip: Any = None,
    ) -> Frame | None:
        """Store a request's outcome frame; None when another server's outcome won (never on one server)."""
        ...

    async def outcome_of(self, session: Session, request_id: str, after_seq: int, types: tuple[str, ...]) -> Frame | None:
        """The stored outcome of `request_id` (of `types`, after its request at `after_seq`), if any."""
        ...

    async def wait_outcome(
        self, session: Session, request_id: str, after_seq: int, types: tuple[str, ...],
        on_progress: ProgressPayloadFn | None = None,
    ) -> Frame:
        """Wait for the outcome of a request whose answerer is on another server (never returns on one server)."""
        ...

    async def owner_elsewhere(self, session: Session, *, recorded_only: bool) -> bool:
        """A request of `session` may be answered on another server, so it waits in the log: always
        (`recorded_only` False), or only if the log records an owner (True). Never on one server."""
        ...

    async def recorded_owner(self, session: Session) -> str | None:
        """The owner identity the session's log records (None on one server)."""
        ...

    async def record_of(self, session: Session) -> tuple[str | None, dict[str, Any] | None]:
        """`(owner identity, last declaration)` the session's log records, for a server that holds
        no owner of it (nothing on one server, whose memory is all there is)."""
        ...

    async def recorded_sessions(self, channel: str, session_id: str, owner: str | None = None) -> list[RecordedSession]:
        """The instances whose log records an owner or declaration of the session (with `owner`: only
        those `owner` opened), with what each records: one store read, bounded
        (`MAX_RECORDED_INSTANCES`); none on one server."""
        ...

    async def session_record(self, session_of: Callable[[], Session]) -> SessionRecord | None:
        """The session `session_of()` makes, with the owner identity and last declaration its log
        records; None on one server (where `session_of` is not called)."""
        ...

    def announce(self, request: dict[str, Any], **fields: Any) -> None:
        """Add to a request's payload what other servers need to list and close it (nothing on one server)."""
        ...



class SingleServer:
    """One server: every request is answered where it was asked; nothing crosses."""

    async def read_new(
        self, cursors: LogCursors, session: Session, types: tuple[str, ...], *, known: bool = False,
    ) -> list[Frame]:
        """Nothing: no other server writes requests."""
        return []

    async def wait_change(
        self, changed: trio.Event, session: Session, types: tuple[str, ...], after_seq: int,
        then: Callable[[Session], Awaitable[None]],
    ) -> None:
        """Only this server's own changes wake the wait."""
        await changed.wait()

    async def store_outcome(
        self, append: AppendFn, session: Session, type: str, payload: dict[str, Any], *, skip: Any = None,
    ) -> Frame | None:
        """Append the outcome as any frame: nobody else can store one."""
        return await append(session, type, payload, skip=skip)

    async def outcome_of(self, session: Session, request_id: str, after_seq: int, types: tuple[str, ...]) -> Frame | None:
        """None: only this server stores outcomes, and it knows them."""
        return None

    async def wait_outcome(
        self, session: Session, request_id: str, after_seq: int, types: tuple[str, ...],
        on_progress: ProgressPayloadFn | None = None,
    ) -> Frame:
        """Never returns: no other server answers (the caller's deadline ends the wait)."""
        await trio.sleep_forever()
        raise AssertionError("unreachable")

    async def owner_elsewhere(self, session: Session, *, recorded_only: bool) -> bool:
        """False: there is no elsewhere."""
        return False

    async def recorded_owner(self, session: Session) -> str | None:
        """None: owners are known in memory only."""
        return None

    async def record_of(self, session: Session) -> tuple[str | None, dict[str, Any] | None]:
        """Nothing: every session this server serves was opened here."""
        return None, None

    async def recorded_sessions(self, channel: str, session_id: str, owner: str | None = None) -> list[RecordedSession]:
        """None: no other server opens sessions."""
        return []

    async def session_record(self, session_of: Callable[[], Session]) -> SessionRecord | None:
        """Nothing is recorded for other servers."""
        return None

    def announce(self, request: dict[str, Any], **fields: Any) -> None:
        """Nothing to add."""



class SharedStore:
    """Several servers on one store: requests, outcomes and progress cross through the log.

    Needs: the shared log (`SharedLog`) and this server's id, written in each request so
    survivors can tell whose wait died (abandoned_requests.py).
    """

    def __init__(self, log: SharedLog, server_id: str | None = None) -> None:
        self.log = log
        self.server_id = server_id

    async def read_new(
        self, cursors: LogCursors, session: Session, types: tuple[str, ...], *, known: bool = False,
    ) -> list[Frame]:
        """The session's frames of `types` since the cursor, the cursor moved past them."""
        return await cursors.read_new(self.log, session, types, known=known)

    async def wait_change(
        self, changed: trio.Event, session: Session, types: tuple[str, ...], after_seq: int,
        then: Callable[[Session], Awaitable[None]],
    ) -> None:
        """Race this server's own changes against a frame of `types` any server stores."""
        log = self.log
        async with trio.open_nursery() as race:

            async def local() -> None:
                await changed.wait()
                race.cancel_scope.cancel()

            async def logged() -> None:
                await log.wait_frames(session, types, after_seq)
                await then(session)
                race.cancel_scope.cancel()

            race.start_soon(local)
            race.start_soon(logged)

    async def store_outcome(
        self, append: AppendFn, session: Session, type: str, payload: dict[str, Any], *, skip: Any = None,
    ) -> Frame | None:
        """Store through `append_outcome`: the first outcome of the request wins, a later one gets None."""
        return await self.log.append_outcome(session, type, payload, payload["request_id"], skip=skip)

    async def outcome_of(self, session: Session, request_id: str, after_seq: int, types: tuple[str, ...]) -> Frame | None:
        """The first stored frame of `types` about `request_id` after `after_seq`."""
        for frame in await self.log.frames(session, types, after_seq):
            if frame.payload.get("request_id") == request_id:
                return frame
        return None

    async def wait_outcome(
        self, session: Session, request_id: str, after_seq: int, types: tuple[str, ...],
        on_progress: ProgressPayloadFn | None = None,
    ) -> Frame:
        """Wait in the log for the request's outcome, whoever stores it."""
        return await self.log.wait_outcome(session, request_id, after_seq, on_progress, outcome_types=types)

    async def owner_elsewhere(self, session: Session, *, recorded_only: bool) -> bool:
        """Always, or (`recorded_only`) when the log records the session's owner (read once)."""
        if not recorded_only:
            return True
        if session.owner_identity is None:
            SessionRegistry.note_owner(session, await self.recorded_owner(session))
        return session.owner_identity is not None

    async def recorded_owner(self, session: Session) -> str | None:
        """The identity the session's first `session_record` holds."""
        return (await self.log.session_record(session))[0]

    async def record_of(self, session: Session) -> tuple[str | None, dict[str, Any] | None]:
        """Read from the session's `session_record` frames."""
        return await self.log.session_record(session)

    async def recorded_sessions(self, channel: str, session_id: str, owner: str | None = None) -> list[RecordedSession]:
        """The store's `session_records`: one indexed query over every instance's log."""
        return await self.log.store.session_records(channel, session_id, owner=owner)

    async def session_record(self, session_of: Callable[[], Session]) -> SessionRecord | None:
        """Read from the session's `session_record` frames."""
        session = session_of()
        owner, declared = await self.log.session_record(session)
        return session, owner, declared

    def announce(self, request: dict[str, Any], **fields: Any) -> None:
        """Add every given field (None ones left out) and this server's id."""
        request.update({key: value for key, value in fields.items() if value is not None})
        if self.server_id is not None:
            request["server"] = self.server_id  # whose lease says this wait is alive (abandoned_requests.py)
