"""The frame log as the server's other services see it: store a frame, then tell its followers.

Every frame of every session goes through `FrameLog.append`, so the durable log
and the live event sinks (callers, request-scoped streams) never disagree on
order. `ingress` is the door for frames from outside the sandbox: it refuses
what only the server may state (`server_owned.refuse_server_owned`), and a
`user.message` there also wakes the instance (the wake hook is given, not
imported, so this module depends on the store and sessions only). `record`
stores a server's own record that other servers read back from the log and that
is no event of the conversation (`session_record`), pushed to nobody.

`append` is also the last line of the limits (protocol/limits.py): a frame whose
delivery line could not be read by a guest, a client or a caller is refused
before it is stored, so a stored frame is always deliverable. The ingresses
check first, with messages that name the caller's own field.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, contextmanager
from typing import Any, Callable, Iterator, Protocol

import trio

from protocol import Frame
from protocol.frames import FrameType
from protocol.limits import Limits

from ..store.api import FrameStoreAPI
from .server_owned import refuse_server_owned
from .sessions import EventSink, Session, SessionRegistry


class AppendFrame(Protocol):
    """`FrameLog.append` as the services that store frames are given it (one seam, one shape)."""

    async def __call__(
        self, session: Session, type: str, payload: dict[str, Any], *,
        reply_to: str | None = None, msg_id: str | None = None, skip: EventSink | None = None,
        append_id: str | None = None,
    ) -> Frame:
        """Store a frame of `session`, then push it to the session's followers but `skip` (with
        `append_id`: unless it was stored before, then return that frame and push nothing)."""
        ...


class AppendOutcome(Protocol):
    """`FrameLog.append_outcome` as the services that close a request are given it."""

    async def __call__(
        self, session: Session, type: str, payload: dict[str, Any], request_id: str, *, skip: EventSink | None = None,
    ) -> Frame | None:
        """Store the one outcome of `request_id` and push it; None when another outcome was stored first."""
        ...


class LocalAppends(Protocol):
    """Who is told of this server's own appends, so that it does not push them a second time:
    the log tail of a shared store (`features.cluster.LogTail`), which pushes the other servers' frames."""

    def appending(self, instance: str) -> AbstractContextManager[Callable[[int], None]]:
        """Around one append to `instance`: call what it gives with the seq stored (pushed here)."""
        ...


def _ignore_seq(seq: int) -> None:
    """Nobody needs to know which seqs this server appended (one server on its log)."""


class AloneOnTheLog:
    """`LocalAppends` when this server is alone on its log: every frame is appended, and pushed, here."""

    @contextmanager
    def appending(self, instance: str) -> Iterator[Callable[[int], None]]:
        """Nothing to note."""
        yield _ignore_seq


def push_frame(session: Session, frame: Frame, skip: EventSink | None = None) -> None:
    """Push a stored frame of `session` to its followers but `skip` (and a follower that says it
    `acts_for` `skip`): the one push path, for this server's appends (`FrameLog`) and, with a shared
    store, other servers' (`features.cluster.LogTail`)."""
    if session.sinks:
        event = frame.to_event()
        for sink in list(session.sinks):
            if sink is not skip and (skip is None or getattr(sink, "acts_for", None) is not skip):
                sink.push(event)


class FrameLog:
    """Appends frames to the store and pushes each to the sinks of its session.

    Needs: the frame store and the session registry; `on_user_message(instance)` is called
    after a `user.message` arrives through `ingress` (the wake service); the server's limits;
    `on_stored(type, seconds)` hears of each frame stored and how long its append took (metrics);
    `local_appends` is told the seq of each (with a shared store, the log tail).
    Raises: `LimitExceeded` for a frame that could never be delivered (nothing is stored),
    `RelayError(INVALID_PARAMS)` for a server-owned type or payload key at `ingress`, and
    whatever the store raises for a frame it refuses (`ValueError`, `TypeError`).
    """

    def __init__(
        self,
        store: FrameStoreAPI,
        sessions: SessionRegistry,
        on_user_message: Callable[[str], object] = lambda instance: None,
        limits: Limits | None = None,
        on_stored: Callable[[str, float], None] = lambda type, seconds: None,
        local_appends: LocalAppends | None = None,
    ) -> None:
        self.store = store
        self.sessions = sessions
        self.on_user_message = on_user_message
        self.limits = limits or Limits()
        self.on_stored = on_stored
        self.local_appends: LocalAppends = local_appends or AloneOnTheLog()

    def _check(
        self, session: Session, type: str, payload: dict[str, Any], msg_id: str | None = None, reply_to: str | None = None,
    ) -> None:
        """`Limits.check_frame` for a frame of `session`: nothing is stored that could not be delivered."""
        self.limits.check_frame(
            payload, instance=session.instance, channel=session.channel, session_id=session.id,
            type=type, msg_id=msg_id, reply_to=reply_to,
        )

    async def append(
        self,
        session: Session,
        type: str,
        payload: dict[str, Any],
        *,
        reply_to: str | None = None,
        msg_id: str | None = None,
        skip: EventSink | None = None,
        append_id: str | None = None,
    ) -> Frame:
        """Store a frame of `session` and push it to everyone following the session but `skip`
        (the caller whose own answer the frame records, which needs no event of it).

        With `append_id` (a guest's, docs/TETHER.md "Exactly-once appends"), the same frame stored
        with that id before is returned instead, and nothing is stored or pushed: its followers heard
        of it when it was stored (from this server, or another's log tail); another frame under that
        id is refused (`AppendIdReused`)."""
        self._check(session, type, payload, msg_id=msg_id, reply_to=reply_to)
        return await self._store_and_push(
            session, type, payload, reply_to=reply_to, msg_id=msg_id, skip=skip, append_id=append_id,
        )

    async def _store_and_push(
        self, session: Session, type: str, payload: dict[str, Any], *,
        reply_to: str | None, msg_id: str | None, skip: EventSink | None = None, append_id: str | None = None,
    ) -> Frame:
        """`append` once the frame passed `Limits.check_frame`."""
        began = trio.current_time()
        with self.local_appends.appending(session.instance) as stored_here:
            if append_id is None:
                frame = await self.store.append(
                    session.instance, channel=session.channel, session_id=session.id,
                    type=type, payload=payload, msg_id=msg_id, reply_to=reply_to,
                )
            else:
                frame, stored = await self.store.append_once(
                    session.instance, append_id, channel=session.channel, session_id=session.id,
                    type=type, payload=payload, msg_id=msg_id, reply_to=reply_to,
                )
                if not stored:
                    return frame  # stored (and pushed) before: nothing new to tell anyone
            stored_here(frame.seq)
        self.on_stored(type, trio.current_time() - began)
        push_frame(session, frame, skip)
        return frame

    async def record(self, session: Session, type: str, payload: dict[str, Any]) -> Frame:
        """Store a server's own record of `session` (a `session_record`, a `policy_decision`;
        server_owned.py) and push it to nobody: it is no event of the conversation (other servers
        read a `session_record` back from the log; an operator reads both)."""
        self._check(session, type, payload)
        began = trio.current_time()
        with self.local_appends.appending(session.instance) as stored_here:
            frame = await self.store.append(
                session.instance, channel=session.channel, session_id=session.id, type=type, payload=payload,
            )
            stored_here(frame.seq)
        self.on_stored(type, trio.current_time() - began)
        return frame

    async def append_outcome(
        self,
        session: Session,
        type: str,
        payload: dict[str, Any],
        request_id: str,
        *,
        skip: EventSink | None = None,
    ) -> Frame | None:
        """Store the one outcome frame of `request_id` and push it as `append` does; None (nothing
        stored, nobody told) when another outcome of it was stored first, by any server."""
        self._check(session, type, payload)
        began = trio.current_time()
        with self.local_appends.appending(session.instance) as stored_here:
            frame = await self.store.append_outcome(
                session.instance, request_id, channel=session.channel, session_id=session.id, type=type, payload=payload,
            )
            if frame is not None:
                stored_here(frame.seq)
        if frame is not None:
            self.on_stored(type, trio.current_time() - began)
            push_frame(session, frame, skip)
        return frame

    async def ingress(
        self,
        instance: str,
        channel: str,
        session_id: str,
        type: str,
        payload: dict[str, Any],
        *,
        msg_id: str | None = None,
        reply_to: str | None = None,
    ) -> Frame:
        """Append a frame from outside the sandbox; a `user.message` wakes the instance.

        The frame is checked before its session is looked up or made: a refused frame leaves
        nothing behind, not even a session in memory.

        Raises: `RelayError(INVALID_PARAMS)` for a type or payload key only the server writes
        (`refuse_server_owned`: nothing is stored), the limits' refusals, and what `append` raises.
        """
        refuse_server_owned(type, payload)
        self.limits.check_frame(
            payload, instance=instance, channel=channel, session_id=session_id, type=type, msg_id=msg_id, reply_to=reply_to,
        )
        session = self.sessions.get_or_create(instance, channel, session_id)
        frame = await self._store_and_push(session, type, payload, msg_id=msg_id, reply_to=reply_to)
        if type == FrameType.USER_MESSAGE:
            self.on_user_message(instance)
        return frame
